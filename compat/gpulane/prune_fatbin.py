"""Zero the CUDA binaries of a shared library that a given GPU can never load.

vLLM's ``_C`` library carries machine code for many GPU generations; the GPU
lane's payload must fit one 64 MiB transfer.  Every fatbin container in the
ELF's ``.nv_fatbin`` section is walked; entries other than the target's cubin
(and, where a container has no such cubin, PTX the driver could compile for
it) get their payload bytes zeroed.  Offsets and sizes stay as they were, so
the library loads as before; the zeros compress to nothing.

    python3 prune_fatbin.py IN OUT [SM, default 90]
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys

FATBIN_MAGIC = 0xBA55ED50
PTX, CUBIN = 1, 2


def _section(path: str, name: str) -> tuple[int, int]:
    out = subprocess.check_output(["readelf", "-S", "-W", path], text=True)
    for line in out.splitlines():
        m = re.search(r"\]\s+(\S+)\s+\S+\s+[0-9a-f]+\s+([0-9a-f]+)\s+([0-9a-f]+)", line)
        if m and m.group(1) == name:
            return int(m.group(2), 16), int(m.group(3), 16)
    raise SystemExit(f"{path} has no {name} section")


def _containers(buf: bytes, off: int, size: int):
    """Yield the entries of each container: (kind, arch, payload offset, payload size)."""
    p, end = off, off + size
    while p + 16 <= end:
        magic, _ver, hsize, fsize = struct.unpack_from("<IHHQ", buf, p)
        if magic != FATBIN_MAGIC:
            p += 8  # alignment padding between containers
            continue
        q, cend, entries = p + hsize, p + hsize + fsize, []
        while q < cend:
            kind, _, ehsize, psize = struct.unpack_from("<HHIQ", buf, q)
            (arch,) = struct.unpack_from("<I", buf, q + 28)
            entries.append((kind, arch, q + ehsize, psize))
            q += ehsize + psize
        yield entries
        p = cend


def prune(src: str, dst: str, sm: int = 90) -> tuple[int, int]:
    data = bytearray(open(src, "rb").read())
    off, size = _section(src, ".nv_fatbin")
    kept = zeroed = 0
    for entries in _containers(bytes(data), off, size):
        has_cubin = any(k == CUBIN and a == sm for k, a, _, _ in entries)
        for kind, arch, at, n in entries:
            if (kind == CUBIN and arch == sm) or (kind == PTX and arch <= sm and not has_cubin):
                kept += n
            else:
                data[at:at + n] = bytes(n)
                zeroed += n
    with open(dst, "wb") as f:
        f.write(data)
    return kept, zeroed


if __name__ == "__main__":
    k, z = prune(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 90)
    print(f"{sys.argv[1]}: kept {k / 1e6:.1f} MB of CUDA binaries, zeroed {z / 1e6:.1f} MB")
