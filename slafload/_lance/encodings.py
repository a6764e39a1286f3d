"""The page encodings the direct reader decodes, recognised from their protobuf messages.

Each page of a Lance 2.x data file names its encoding in the file's metadata: a ``Page``'s
``encoding`` field (``file2.proto``) is an ``Encoding`` whose ``direct`` (2) holds a
``DirectEncoding`` whose ``encoding`` (1) is a ``google.protobuf.Any``: a type URL, then the
message. The footer walk (:mod:`slafload._lance.footer`) finds those bytes; this module decodes
them with a small reader of protobuf's wire format (varints and length-delimited fields), and
recognises, field by field, the few messages the direct reader decodes:

- 2.0 (``/lance.encodings.ArrayEncoding``, ``encodings_v2_0.proto``): ``flat`` (1) values of
  one page buffer with no compression, bare or inside ``nullable`` (2) ``no_nulls`` (1);
- 2.1 and 2.2 (``/lance.encodings21.PageLayout``, ``encodings_v2_1.proto``): a
  ``mini_block_layout`` (1) of one ``REPDEF_ALL_VALID_ITEM`` layer, no levels, no dictionary
  and no repetition index, whose ``value_compression`` is a ``CompressiveEncoding`` of
  ``flat`` (1, uncompressed), ``inline_bitpacking`` (5) or ``rle`` (8: flat values, flat
  8-bit run lengths); and a ``constant_layout`` (2, written from Lance 2.2) of one such layer
  with its value inline and no levels.

Every field of each message must be one the proto defines with the wire type it defines (an
``optional`` sub-message absent, a number its default where it must be), or the page is not
one of these: a field a later Lance adds, whatever it means, leaves the file with Lance. The
decoder runs once per page a file lists when the file is first opened, never per row.
"""

from __future__ import annotations

from typing import NamedTuple

VARINT, FIXED64, BYTES, FIXED32 = 0, 1, 2, 5  # the wire types a message may hold
ARRAY_ENCODING = "lance.encodings.ArrayEncoding"  # 2.0 pages' message
PAGE_LAYOUT = "lance.encodings21.PageLayout"  # 2.1+ pages' message
ALL_VALID_ITEM = 1  # RepDefLayer.REPDEF_ALL_VALID_ITEM
FLAT, INLINE_BITPACKING, RLE = 1, 5, 8  # CompressiveEncoding's fields the decoder reads

Fields = dict[int, list[tuple[int, int | bytes]]]
"""A message's fields: by number, each occurrence's wire type and value (an int, or the
bytes of a length-delimited field), in the order written."""


class MiniBlock(NamedTuple):
    """A ``MiniBlockLayout`` the decoder reads: its values' compression (:data:`FLAT`,
    :data:`INLINE_BITPACKING` or :data:`RLE`) and their bits, its value buffers per chunk,
    ``has_large_chunk`` and ``num_items``.
    """

    compression: int
    bits: int
    n_buffers: int
    large: bool
    items: int


class Constant(NamedTuple):
    """A ``ConstantLayout`` the decoder reads: every row is ``value`` (its bytes)."""

    value: bytes


def parse(data: bytes) -> Fields | None:
    """The fields of the protobuf message ``data``; ``None`` where it is malformed (a varint
    over 10 bytes or 64 bits, a field past the message's end, a group or unknown wire type).
    """
    fields: Fields = {}
    i, end = 0, len(data)
    while i < end:
        key, i = _varint(data, i)
        if i < 0:
            return None
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == VARINT:
            value, i = _varint(data, i)
        elif wire == BYTES:
            n, i = _varint(data, i)
            value, i = (data[i : i + n], i + n) if i >= 0 and n <= end - i else (b"", -1)
        elif wire in (FIXED64, FIXED32):
            n = 8 if wire == FIXED64 else 4
            value, i = int.from_bytes(data[i : i + n], "little"), i + n if n <= end - i else -1
        else:
            return None
        if i < 0 or number == 0:
            return None
        fields.setdefault(number, []).append((wire, value))
    return fields


def _varint(data: bytes, i: int) -> tuple[int, int]:
    """The varint at ``data[i:]`` and where it ends; ``(0, -1)`` where it is malformed."""
    value = 0
    for shift in range(0, 70, 7):
        if i >= len(data):
            break
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (value, i) if value < 1 << 64 else (0, -1)
    return 0, -1


class _Message:
    """One parsed message, read strictly: :meth:`done` is true only if every field was read
    by one of the accessors below, each with the wire type the proto gives it.
    """

    def __init__(self, fields: Fields) -> None:
        self.fields = fields
        self.bad = False
        self.seen: set[int] = set()

    def _one(self, number: int, wire: int) -> int | bytes | None:
        self.seen.add(number)
        found = self.fields.get(number, [])
        if len(found) > 1 or any(w != wire for w, _ in found):
            self.bad = True  # given twice (a sub-message would merge: not Lance's writing)
            return None
        return found[0][1] if found else None

    def number(self, number: int) -> int:
        """A varint field's value (0, its default, where absent)."""
        value = self._one(number, VARINT)
        return value if isinstance(value, int) else 0

    def data(self, number: int) -> bytes | None:
        """A ``bytes`` field's value; ``None`` where absent."""
        value = self._one(number, BYTES)
        return value if isinstance(value, bytes) else None

    def message(self, number: int) -> _Message | None:
        """A sub-message field, parsed; ``None`` where absent (or malformed: then not
        :meth:`done`).
        """
        value = self.data(number)
        if value is None:
            return None
        fields = parse(value)
        if fields is None:
            self.bad = True
            return None
        return _Message(fields)

    def enums(self, number: int) -> list[int]:
        """A repeated enum field's values, packed or not."""
        self.seen.add(number)
        out: list[int] = []
        for wire, value in self.fields.get(number, []):
            if wire == VARINT and isinstance(value, int):
                out.append(value)
                continue
            if not isinstance(value, bytes):  # a fixed-width value: not an enum
                self.bad = True
                return []
            at = 0
            while at < len(value):
                item, at = _varint(value, at)
                if at < 0:
                    self.bad = True
                    return []
                out.append(item)
        return out

    def done(self) -> bool:
        """Whether every field was read, as what the proto defines."""
        return not self.bad and self.seen.issuperset(self.fields)


def unwrap(encoding: bytes) -> tuple[str, bytes] | None:
    """The full name of the message a page's ``Encoding`` (as the footer holds it) wraps,
    and that message's bytes; ``None`` unless it is a direct encoding of one ``Any``.
    """
    fields = parse(encoding)
    outer = None if fields is None else _Message(fields)
    direct = None if outer is None else outer.message(2)
    wrapped = None if direct is None else direct.message(1)
    if outer is None or direct is None or wrapped is None:
        return None
    url, value = wrapped.data(1), wrapped.data(2)
    if not (outer.done() and direct.done() and wrapped.done()) or url is None:
        return None
    try:
        name = url.decode("ascii").rpartition("/")[2]  # Any's URL ends in the full name
    except UnicodeDecodeError:
        return None
    return name, value or b""


def flat_bits(encoding: bytes) -> int | None:
    """Bits per value of a 2.0 page whose ``Encoding`` message is ``encoding``, where it is
    flat values of one page buffer with no nulls and no compression; ``None`` otherwise.
    """
    wrapped = unwrap(encoding)
    fields = parse(wrapped[1]) if wrapped is not None and wrapped[0] == ARRAY_ENCODING else None
    if fields is None:
        return None
    array = _Message(fields)
    nullable = array.message(2)
    if nullable is not None:  # Nullable{no_nulls: NoNull{values: ArrayEncoding}}
        no_nulls = nullable.message(1)
        inner = None if no_nulls is None else no_nulls.message(1)
        if not (array.done() and nullable.done()) or no_nulls is None or not no_nulls.done():
            return None
        if inner is None:
            return None
        array = inner
    flat = array.message(1)
    if flat is None or not array.done():
        return None
    bits, buffer = flat.number(1), flat.message(2)
    compressed = flat.message(3)
    if buffer is None or compressed is not None or not flat.done():
        return None
    # Buffer{buffer_index: 0, buffer_type: page (0)}: the page's first buffer
    if buffer.number(1) != 0 or buffer.number(2) != 0 or not buffer.done():
        return None
    return bits


def page_layout(encoding: bytes) -> MiniBlock | Constant | None:
    """What a 2.1+ page whose ``Encoding`` message is ``encoding`` holds, where it is one
    of the layouts the decoder reads (see the module docstring); ``None`` otherwise.
    """
    wrapped = unwrap(encoding)
    fields = parse(wrapped[1]) if wrapped is not None and wrapped[0] == PAGE_LAYOUT else None
    if fields is None:
        return None
    layout = _Message(fields)
    mini, constant = layout.message(1), layout.message(2)
    if not layout.done():
        return None
    if mini is not None:
        return None if constant is not None else _mini_block(mini)
    return None if constant is None else _constant(constant)


def _mini_block(layout: _Message) -> MiniBlock | None:
    """A ``MiniBlockLayout`` of all-valid values with no levels, dictionary or repetition
    index, and values compressed as the decoder reads them; ``None`` otherwise.
    """
    if layout.message(1) is not None or layout.message(2) is not None:  # rep, def levels
        return None
    values, dictionary = layout.message(3), layout.message(4)
    if values is None or dictionary is not None or layout.number(5) != 0:
        return None
    if layout.enums(6) != [ALL_VALID_ITEM] or layout.number(8) != 0:
        return None
    n_buffers, items, large = layout.number(7), layout.number(9), layout.number(10)
    found = _compression(values)
    if found is None or not layout.done() or large > 1:
        return None
    return MiniBlock(found[0], found[1], n_buffers, bool(large), items)


def _compression(encoding: _Message) -> tuple[int, int] | None:
    """``(kind, bits)`` of a ``CompressiveEncoding`` the decoder reads: flat values (with
    no buffer compression), inline bit-packing of values of ``bits``, or runs of flat values
    with flat 8-bit run lengths; ``None`` otherwise.
    """
    present = set(encoding.fields)
    if len(present) != 1:
        return None
    (kind,) = present
    inner = encoding.message(kind)
    if inner is None or not encoding.done():
        return None
    if kind == FLAT:
        bits = _flat(inner)
    elif kind == INLINE_BITPACKING:  # {uncompressed_bits_per_value: 1, values: 2 (absent)}
        bits = inner.number(1)
        bits = bits if inner.message(2) is None and inner.done() else None
    elif kind == RLE:  # {values: 1, run_lengths: 2}
        values, lengths = inner.message(1), inner.message(2)
        runs = None if values is None else _compression(values)
        run_bits = None if lengths is None else _compression(lengths)
        ok = inner.done() and runs is not None and runs[0] == FLAT and run_bits == (FLAT, 8)
        bits = runs[1] if ok and runs is not None else None
    else:
        return None
    return None if bits is None else (kind, bits)


def _flat(flat: _Message) -> int | None:
    """A 2.1 ``Flat``'s bits per value, where its buffer is not compressed (``data`` absent)."""
    bits = flat.number(1)
    return bits if flat.message(2) is None and flat.done() else None


def _constant(layout: _Message) -> Constant | None:
    """A ``ConstantLayout`` of one all-valid layer, its value inline and no levels; ``None``
    otherwise.
    """
    layers, value = layout.enums(5), layout.data(6)
    if layers != [ALL_VALID_ITEM] or value is None:
        return None
    if layout.message(7) is not None or layout.message(8) is not None:  # rep, def compression
        return None
    if layout.number(9) != 0 or layout.number(10) != 0 or not layout.done():
        return None
    return Constant(value)
