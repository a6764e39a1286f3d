"""A loopback HTTP/1.1 forwarder that holds every request for a fixed delay (a cloud bucket's latency).

It sits between a client (Lance's object store) and an S3-compatible server on loopback (moto's),
reads each request whole, sleeps ``--delay-ms``, forwards it byte for byte (``Range`` headers and
all) on a kept-alive upstream connection, and streams the response back as it arrives. Each
client connection gets its own upstream connection, so the client's concurrency is the server's.
The delay is per request, before it is forwarded: it models time to first byte, not bandwidth.

    python benchmarks/delay_proxy.py --upstream 127.0.0.1:5000 --delay-ms 20 --port 0

prints ``listening on 127.0.0.1:PORT`` once it accepts connections, then serves until SIGTERM
(or until ``--lifetime`` seconds have passed, so a forgotten proxy does not outlive its
benchmark). ``GET /__proxy_stats`` answers the requests forwarded so far, undelayed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

HEAD_LIMIT = 1 << 16
COPY = 1 << 16


STATS = b"/__proxy_stats"  # GET it for {"requests": forwarded so far, "bytes": response bytes}


class Counter:
    requests = 0
    bytes = 0


async def read_head(reader: asyncio.StreamReader) -> bytes | None:
    """One message head (start line and headers, ending in a blank line); ``None`` at EOF."""
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None


def headers(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    out = {}
    for line in lines:
        if ":" in line:
            name, value = line.split(":", 1)
            out[name.strip().lower()] = value.strip()
    return out


async def copy_exactly(reader, writer, n: int) -> None:
    while n > 0:
        data = await reader.read(min(n, COPY))
        if not data:
            raise ConnectionError(f"connection closed with {n} body bytes to go")
        writer.write(data)
        await writer.drain()
        n -= len(data)


async def copy_chunked(reader, writer) -> None:
    while True:
        line = await reader.readuntil(b"\r\n")
        writer.write(line)
        size = int(line.split(b";")[0].strip(), 16)
        if size == 0:
            while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                writer.write(trailer)
            writer.write(b"\r\n")
            await writer.drain()
            return
        await copy_exactly(reader, writer, size + 2)  # the chunk and its CRLF


async def serve_client(client_r, client_w, upstream: tuple[str, int], delay: float, count):
    up_r = up_w = None
    try:
        while (head := await read_head(client_r)) is not None:
            req = headers(head)
            method = head.split(b" ", 1)[0].upper()
            if "chunked" in req.get("transfer-encoding", "").lower():
                raise ValueError("chunked request bodies are not supported")
            body = await client_r.readexactly(int(req.get("content-length", 0)))
            if head.split(b" ", 2)[1] == STATS:  # answered here, never delayed or forwarded
                stats = json.dumps({"requests": count.requests, "bytes": count.bytes}).encode()
                client_w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (len(stats), stats))  # fmt: skip
                await client_w.drain()
                continue
            await asyncio.sleep(delay)
            if up_w is None or up_w.is_closing() or up_r.at_eof():
                if up_w is not None:
                    up_w.close()
                up_r, up_w = await asyncio.open_connection(*upstream)
            up_w.write(head + body)
            await up_w.drain()
            count.requests += 1
            resp = await read_head(up_r)
            if resp is None:
                raise ConnectionError("upstream closed before responding")
            client_w.write(resp)
            res = headers(resp)
            status = int(resp.split(b" ", 2)[1])
            if method == b"HEAD" or status in (204, 304) or 100 <= status < 200:
                pass
            elif "chunked" in res.get("transfer-encoding", "").lower():
                await copy_chunked(up_r, client_w)
            elif "content-length" in res:
                await copy_exactly(up_r, client_w, int(res["content-length"]))
                count.bytes += int(res["content-length"])
            else:  # the body runs to the end of the connection
                while data := await up_r.read(COPY):
                    client_w.write(data)
                await client_w.drain()
                break
            await client_w.drain()
            if res.get("connection", "").lower() == "close":
                up_w.close()
                up_w = None
    except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        pass
    finally:
        for w in (up_w, client_w):
            if w is not None:
                w.close()


async def main(args: argparse.Namespace) -> None:
    host, port = args.upstream.rsplit(":", 1)
    count = Counter()

    async def handle(r, w):
        await serve_client(r, w, (host, int(port)), args.delay_ms / 1e3, count)

    stop = asyncio.get_running_loop().create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.cancel)
    server = await asyncio.start_server(handle, "127.0.0.1", args.port, limit=HEAD_LIMIT)
    bound = server.sockets[0].getsockname()
    print(f"listening on {bound[0]}:{bound[1]}", flush=True)
    try:
        async with server:
            await asyncio.wait_for(stop, args.lifetime)
    except (TimeoutError, asyncio.CancelledError):
        pass
    finally:
        print(f"forwarded {count.requests} requests", file=sys.stderr, flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="HOST:PORT of the S3 server")
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--port", type=int, default=0, help="0: any free port")
    p.add_argument("--lifetime", type=float, default=3600, help="seconds before it stops")
    asyncio.run(main(p.parse_args()))  # SIGINT and SIGTERM end it cleanly
