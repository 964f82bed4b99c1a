"""How long a GGUF file's header is, from the first bytes of the file: what a ranged read of a Hub file must fetch so
that `fit` can plan a GGUF quant without downloading it.

A GGUF file starts with its header: magic, version, tensor and key counts, every metadata key/value (the tokenizer's
vocabulary and merges among them: 2-20 MB for the large vocabularies), then one info per tensor (name, shape, ggml
type, offset), then padding to the alignment and the tensor data. `header_length(prefix)` walks the structure over
the bytes it has and returns the header's length, or None when the prefix ends inside it (fetch more and ask again).
It reads nothing into Python objects beyond lengths, so a 150k-token vocabulary costs one pass of struct reads.

The input is untrusted: every count and length is capped before it is used (a hostile header claiming 2^60 keys or a
1 TB string is one typed line, never an allocation or a loop that does not end), and an unknown value type is
refused. Little- and big-endian files are both read (the version word tells which, as the `gguf` package does).
"""

from __future__ import annotations

import struct

from ..errors import CheckpointError

MAGIC = b"GGUF"
MAX_TENSORS = 1 << 20
MAX_KEYS = 1 << 16
MAX_STRING = 64 << 20  # one key or token: far above any real one
MAX_ARRAY = 1 << 26  # elements of one metadata array (a 262k vocabulary's merges are ~0.3 M)
MAX_DIMS = 8
# GGUF value types -> fixed sizes; 8 = string, 9 = array
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class _Short(Exception):
    """The prefix ends inside the header."""


class _Reader:
    def __init__(self, buf: bytes, where: str):
        self.buf, self.pos, self.where, self.end = memoryview(buf), 0, where, "<"

    def take(self, n: int) -> int:
        start = self.pos
        if start + n > len(self.buf):
            raise _Short
        self.pos += n
        return start

    def u32(self) -> int:
        return struct.unpack_from(self.end + "I", self.buf, self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack_from(self.end + "Q", self.buf, self.take(8))[0]

    def bad(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: not a GGUF file moechat can read: {what} at byte {self.pos}",
                               path=self.where)

    def string(self, what: str) -> None:
        n = self.u64()
        if n > MAX_STRING:
            raise self.bad(f"{what} claims {n} bytes (more than {MAX_STRING >> 20} MiB)")
        self.take(n)

    def value(self, kind: int, what: str, depth: int = 0) -> None:
        if kind in _FIXED:
            self.take(_FIXED[kind])
        elif kind == _STRING:
            self.string(what)
        elif kind == _ARRAY:
            if depth > 2:
                raise self.bad(f"{what} nests arrays {depth + 1} deep")
            item, count = self.u32(), self.u64()
            if count > MAX_ARRAY:
                raise self.bad(f"{what} claims {count} elements (more than {MAX_ARRAY})")
            if item in _FIXED:
                self.take(_FIXED[item] * count)  # one step for a fixed-size array, however long
            else:
                for _ in range(count):
                    self.value(item, what, depth + 1)
        else:
            raise self.bad(f"{what} has value type {kind}, which GGUF does not define")


def header_length(prefix: bytes, where: str = "GGUF file") -> int | None:
    """Bytes from the start of the file to the end of its last tensor info (the data's padding not included), or
    None when `prefix` ends before that. CheckpointError when the bytes are not a GGUF header."""
    r = _Reader(prefix, where)
    try:
        if bytes(r.buf[:4]) != MAGIC[: len(r.buf[:4])]:
            raise r.bad(f"it starts with {bytes(r.buf[:4])!r}, not {MAGIC!r}")
        r.take(4)
        version = r.u32()
        if version & 0xFFFF == 0:  # a big-endian file's version read little-endian
            r.end = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            raise r.bad(f"GGUF version {version} (moechat reads versions 2 and 3)")
        tensors, keys = r.u64(), r.u64()
        if tensors > MAX_TENSORS or keys > MAX_KEYS:
            raise r.bad(f"{tensors} tensors and {keys} metadata keys (caps {MAX_TENSORS} and {MAX_KEYS})")
        for i in range(keys):
            r.string(f"metadata key {i}")
            r.value(r.u32(), f"metadata value {i}")
        for i in range(tensors):
            r.string(f"tensor name {i}")
            dims = r.u32()
            if dims > MAX_DIMS:
                raise r.bad(f"tensor {i} has {dims} dimensions")
            r.take(8 * dims + 4 + 8)  # the dims, the ggml type, the data offset
        return r.pos
    except _Short:
        return None
