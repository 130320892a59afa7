"""The canonical chunk: a fixed header followed by the payload.

Payload: ``[L, 2, T, H, D]`` (attention and sliding window) or ``[L, 1, T, 1, D]``
(MLA, the same bytes as ``[L, T, D_latent]``), model dtype, contiguous; a
recurrent (Mamba/GDN) state checkpoint is ``[L, 1, 1, 1, S]`` raw bytes (uint8),
each layer's state tensors back to back, their dtypes and shapes named in the
header's ``spec`` (e.g. ``bfloat16[3,512];float32[2,128,128]``).  It does not
depend on the vLLM version, backend or physical layout.

Header (little-endian, :data:`HEADER_SIZE` bytes)::

    magic b"KVPC" | format version u16 | header size u16 | group kind u8 |
    dtype code u8 | KV u8 | pad u8 | L u32 | T u32 | H u32 | D u32 |
    token start u64 | token end u64 | TP size u16 | TP rank u16 |
    group index u16 | pad u16 | model fingerprint 32B | chunk key 32B |
    layers digest 16B | spec 64B (ASCII, NUL-padded) |
    payload bytes u64 | payload digest u64 | header xxh3-64 u64

``layers digest`` names the group's layers (which layers' KV this is), so that
two groups of equal shape can never be mistaken for each other.

The payload digest (:func:`payload_checksum`) is the xxh3-64 of each
:data:`SEGMENT_BYTES` segment of the payload, then the xxh3-64 of those
digests (little-endian u64): segments a GPU hashes side by side, over bytes
already copied to it (``kvplugin::segment_digests``), and a host with the
xxhash library at its full speed.

A reader checks the header against what it expects (:class:`ChunkExpect`)
and the payload checksum before a byte reaches the KV cache; every mismatch
has a reason name that becomes a ``load_failures`` counter.

Torch-free: the cache server reads headers with this module.  Dtypes are named
as torch names them without the ``torch.`` prefix (``dtype_name``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

MAGIC = b"KVPC"
FORMAT_VERSION = 3  # 3: the segmented payload digest (2: one xxh3-64 of the whole payload); keys.KEY_VERSION follows it
_BODY = struct.Struct("<4sHHBBBBIIIIQQHHHH32s32s16s64sQQ")
SPEC_SIZE = 64
#: the payload digest hashes segments of this many bytes (the last one may be shorter).  A
#: segment's 1 KiB blocks are folded in order; on a device a warp loads and sums 8 of them at a
#: time (csrc/cuda/digests.cu).  The host's xxh3 of an object in segments of this size runs at
#: about 0.87 of one call over the object (benchmarks/NOTES.md, "Digests on the device")
SEGMENT_BYTES = 256 << 10
HEADER_SIZE = _BODY.size + 8  # + header checksum

#: dtype name -> (header code, element size)
DTYPES: dict[str, tuple[int, int]] = {
    "float16": (1, 2), "bfloat16": (2, 2), "float32": (3, 4),
    "float8_e4m3fn": (4, 1), "float8_e5m2": (5, 1), "uint8": (6, 1),
}
_U64 = (1 << 64) - 1
_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` (or ``"bfloat16"``) -> ``"bfloat16"``; raises for a dtype chunks cannot hold."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot be stored in a chunk (supported: {sorted(DTYPES)})")
    return name


class ChunkError(Exception):
    """A chunk that must not be served; ``reason`` names the counter."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class ChunkExpect:
    """What a reader requires of a chunk before it may be loaded."""

    fingerprint: bytes
    key: bytes
    kind: int
    dtype: str  # dtype_name()
    shape: tuple[int, int, int, int, int]  # L, KV, T, H, D
    token_start: int
    token_end: int
    tp_size: int  # ranks of the engine's model-parallel group
    tp_rank: int
    group_index: int
    layers: bytes = b"\0" * 16  # layers_digest() of the group's layer names
    spec: str = ""  # recurrent groups: the state tensors (state_spec())

    @property
    def payload_nbytes(self) -> int:
        L, KV, T, H, D = self.shape
        return L * KV * T * H * D * DTYPES[self.dtype][1]


@dataclass(frozen=True)
class ChunkHeader:
    fingerprint: bytes
    key: bytes
    kind: int
    dtype: str
    shape: tuple[int, int, int, int, int]  # L, KV, T, H, D
    token_start: int
    token_end: int
    tp_size: int
    tp_rank: int
    group_index: int
    payload_nbytes: int
    checksum: int
    layers: bytes = b"\0" * 16
    spec: str = ""

    @classmethod
    def for_payload(cls, expect: ChunkExpect, payload: memoryview | bytes, checksum: int | None = None) -> ChunkHeader:
        nbytes = len(payload) if not isinstance(payload, memoryview) else payload.nbytes
        return cls(expect.fingerprint, expect.key, expect.kind, expect.dtype, expect.shape,
                   expect.token_start, expect.token_end, expect.tp_size, expect.tp_rank,
                   expect.group_index, nbytes,
                   payload_checksum(payload) if checksum is None else checksum,
                   expect.layers, expect.spec)

    def pack(self) -> bytes:
        L, KV, T, H, D = self.shape
        body = _BODY.pack(
            MAGIC, FORMAT_VERSION, HEADER_SIZE, self.kind, DTYPES[self.dtype][0], KV, 0,
            L, T, H, D, self.token_start, self.token_end, self.tp_size, self.tp_rank,
            self.group_index, 0, self.fingerprint, self.key, self.layers,
            self.spec.encode("ascii").ljust(SPEC_SIZE, b"\0"), self.payload_nbytes, self.checksum)
        return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> ChunkHeader:
        """Parse a header; raises :class:`ChunkError` (bad_magic, version, header_checksum, short_read)."""
        data = bytes(data[:HEADER_SIZE])
        if len(data) < HEADER_SIZE:
            raise ChunkError("short_read", f"header has {len(data)} of {HEADER_SIZE} bytes")
        body, (hsum,) = data[: _BODY.size], struct.unpack("<Q", data[_BODY.size:HEADER_SIZE])
        f = _BODY.unpack(body)
        if f[0] != MAGIC:
            raise ChunkError("bad_magic", f"magic {f[0]!r}")
        if f[1] != FORMAT_VERSION or f[2] != HEADER_SIZE:
            raise ChunkError("version", f"format version {f[1]} header size {f[2]}")
        if xxhash.xxh3_64_intdigest(body) != hsum:
            raise ChunkError("header_checksum", "header bytes do not match their checksum")
        (_, _, _, kind, dcode, kv, _, L, T, H, D, start, end, tps, tpr, gi, _, fp, key, layers, spec,
         n, csum) = f
        if dcode not in _BY_CODE:
            raise ChunkError("header_mismatch", f"unknown dtype code {dcode}")
        try:
            spec_text = spec.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise ChunkError("header_mismatch", "state spec is not ASCII") from None
        return cls(fp, key, kind, _BY_CODE[dcode], (L, kv, T, H, D), start, end, tps, tpr, gi, n, csum,
                   layers, spec_text)

    @property
    def object_size(self) -> int:
        """Header plus payload: the bytes of one stored object."""
        return HEADER_SIZE + self.payload_nbytes

    def mismatch(self, expect: ChunkExpect) -> str | None:
        """The first field that differs from ``expect`` (None when all agree)."""
        checks = (
            ("fingerprint", self.fingerprint, expect.fingerprint),
            ("key", self.key, expect.key),
            ("kind", self.kind, expect.kind),
            ("dtype", self.dtype, expect.dtype),
            ("shape", self.shape, expect.shape),
            ("token range", (self.token_start, self.token_end), (expect.token_start, expect.token_end)),
            ("tensor parallel", (self.tp_size, self.tp_rank), (expect.tp_size, expect.tp_rank)),
            ("group", self.group_index, expect.group_index),
            ("layers", self.layers, expect.layers),
            ("state spec", self.spec, expect.spec),
            ("payload size", self.payload_nbytes, expect.payload_nbytes),
        )
        for name, got, want in checks:
            if got != want:
                return f"{name} is {got!r}, expected {want!r}"
        return None


def layers_digest(layer_names) -> bytes:
    """16 bytes naming a group's layers, in order (the header's ``layers`` field)."""
    return hashlib.sha256("\n".join(layer_names).encode()).digest()[:16]


def state_spec(tensors) -> str:
    """``dtype[shape];...`` of a recurrent layer's state tensors (dtype names as in ``DTYPES``);
    too long for the header: a digest of it."""
    text = ";".join(f"{dtype_name(dt)}[{','.join(str(int(d)) for d in shape)}]" for dt, shape in tensors)
    if len(text) > SPEC_SIZE:
        text = "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:SPEC_SIZE - 7]
    return text


def segment_count(nbytes: int) -> int:
    """Segments of a payload of ``nbytes`` bytes (an empty payload has one, of no bytes)."""
    return max(1, -(-nbytes // SEGMENT_BYTES))


def combine_segments(digests: Sequence[int]) -> int:
    """The payload digest from its segments' xxh3-64 values (as unsigned or as int64 bits)."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *(d & _U64 for d in digests)))


def payload_checksum(payload) -> int:
    """The payload digest of ``payload`` (bytes or a memoryview of any format): see the module."""
    data = memoryview(payload).cast("B") if not isinstance(payload, bytes) else payload
    n = len(data)
    digest = xxhash.xxh3_64_intdigest
    return combine_segments([digest(data[i:i + SEGMENT_BYTES]) for i in range(0, n, SEGMENT_BYTES)] or [digest(b"")])


def check_chunk(header_bytes, payload, expect: ChunkExpect, verify_checksum: bool = True) -> ChunkHeader:
    """Validate a stored chunk against ``expect``; raises :class:`ChunkError` with a reason."""
    header = ChunkHeader.unpack(header_bytes)
    problem = header.mismatch(expect)
    if problem:
        raise ChunkError("header_mismatch", problem)
    nbytes = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    if nbytes != header.payload_nbytes:
        raise ChunkError("short_read", f"payload has {nbytes} of {header.payload_nbytes} bytes")
    if verify_checksum and payload_checksum(payload) != header.checksum:
        raise ChunkError("checksum", "payload bytes do not match the header checksum")
    return header
