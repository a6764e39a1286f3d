"""A counting HTTP forwarder in front of an S3-compatible endpoint (moto's server on loopback).

Every request a client sends to :attr:`S3Proxy.endpoint` is forwarded to the real endpoint and
counted (requests by method, response body bytes), optionally held ``latency`` seconds first
(an object store's time to first byte). Faults can be planted for the next matching GET: a
``503 SlowDown`` reply, or a connection cut halfway through the body. The benchmark
(``benchmarks/object_store.py``) and the object-store tests use it; moto itself keeps no
counter that can be read cheaply.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade"}
KEYS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
REGION = "us-east-1"


def storage_options(endpoint: str) -> dict[str, str]:
    """Lance storage options for a bucket of moto's server (or a proxy of it) at ``endpoint``."""
    return {**KEYS, "aws_region": REGION, "aws_endpoint": endpoint, "allow_http": "true"}


def upload(directory: Path, endpoint: str, bucket: str, prefix: str) -> str:
    """Copy the files under ``directory`` to ``s3://bucket/prefix/`` (the bucket created
    here) on the server at ``endpoint``; returns that URI.
    """
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION, **KEYS)
    s3.create_bucket(Bucket=bucket)
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(directory).as_posix()}")
    return f"s3://{bucket}/{prefix}"


@dataclass
class Counts:
    """What went through the proxy since the last :meth:`S3Proxy.reset`."""

    requests: dict[str, int] = field(default_factory=dict)  # by method
    bytes: int = 0  # response bodies
    ranges: int = 0  # GETs with a Range header
    dropped: int = 0  # connections that ended in an error (a client gone, a planted cut)

    @property
    def total(self) -> int:
        """Requests of every method."""
        return sum(self.requests.values())


class S3Proxy:
    """Forwards ``http://127.0.0.1:<port>`` to ``upstream``, counting; a context manager."""

    def __init__(self, upstream: str, *, latency: float = 0.0):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.latency = latency
        self.counts = Counts()
        self._lock = threading.Lock()
        self._faults: list[str] = []  # "503" or "cut", taken by the next GETs with a body
        self._agent = ""  # ...whose User-Agent holds this
        self._local = threading.local()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                proxy._forward(self)

            do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                with proxy._lock:  # counted, not printed
                    proxy.counts.dropped += 1

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        """The URL clients use instead of the upstream's."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> S3Proxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> Counts:
        """The counts so far; counting starts again from zero."""
        with self._lock:
            counts, self.counts = self.counts, Counts()
        return counts

    def fail_next(self, *faults: str, agent: str = "") -> None:
        """Plant faults for the next ranged GETs whose User-Agent contains ``agent``, in
        order: ``"503"`` answers ``503 SlowDown``; ``"cut"`` sends the headers and half the
        body, then closes the connection. :attr:`faults_left` says how many are not used yet.
        """
        assert all(f in ("503", "cut") for f in faults), faults
        with self._lock:
            self._faults.extend(faults)
            self._agent = agent

    @property
    def faults_left(self) -> int:
        """Planted faults not used yet."""
        with self._lock:
            return len(self._faults)

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        return conn

    def _forward(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        if self.latency:
            time.sleep(self.latency)
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else None
        ranged = handler.command == "GET" and "Range" in handler.headers
        with self._lock:
            self.counts.requests[handler.command] = self.counts.requests.get(handler.command, 0) + 1
            self.counts.ranges += ranged
            agent = self._agent in handler.headers.get("User-Agent", "")
            fault = self._faults.pop(0) if ranged and agent and self._faults else None
        if fault == "503":
            self._reply_503(handler)
            return
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in HOP_HEADERS}
        try:
            conn = self._connection()
            conn.request(handler.command, handler.path, body=body, headers=headers)
            reply = conn.getresponse()
            data = reply.read()
        except (OSError, http.client.HTTPException):
            self._local.conn = None
            conn = self._connection()
            conn.request(handler.command, handler.path, body=body, headers=headers)
            reply = conn.getresponse()
            data = reply.read()
        with self._lock:
            self.counts.bytes += len(data)
        handler.send_response(reply.status, reply.reason)
        head = handler.command == "HEAD"  # its Content-Length is the object's: passed on
        for key, value in reply.getheaders():
            if key.lower() not in HOP_HEADERS and (head or key.lower() != "content-length"):
                handler.send_header(key, value)
        if not head:
            handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if head:
            return
        if fault == "cut":
            handler.wfile.write(data[: len(data) // 2])
            handler.wfile.flush()
            handler.close_connection = True
            handler.connection.close()
            return
        handler.wfile.write(data)

    @staticmethod
    def _reply_503(handler: http.server.BaseHTTPRequestHandler) -> None:
        body = (
            b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>"
        )
        handler.send_response(503, "Slow Down")
        handler.send_header("Content-Type", "application/xml")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
