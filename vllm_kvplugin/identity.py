"""A model's weights, named by their bytes: part of the model fingerprint.

Chunks outlive engines (the cache server's L2 survives restarts), so a model
directory whose weights changed must never hit chunks computed with the old
ones.  :func:`weights_digest` names the weight files by their names, sizes and
sampled content (windows at fixed positions of every file): a fine-tune, a
re-quantization or a swapped file changes it, while the same files copied to
another machine or path keep it, so engines there still share one cache.  It
reads a few hundred KiB per file, once per process and file state.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

#: files whose bytes are weights (or decide them: quantization scales live in them too)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
#: bytes read at each sampled position, and how many positions per file
WINDOW = 64 << 10
SAMPLES = 8


def _file_digest(h, path: Path, size: int) -> None:
    with open(path, "rb") as f:
        if size <= WINDOW * SAMPLES:
            h.update(f.read())
            return
        for i in range(SAMPLES):
            f.seek((size - WINDOW) * i // (SAMPLES - 1))
            h.update(f.read(WINDOW))


@functools.lru_cache(maxsize=16)
def _digest(root: str, state: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256(b"kvplugin/weights/v1\x00")
    for rel, size, _mtime in state:
        h.update(f"{rel}\x00{size}\x00".encode())
        _file_digest(h, Path(root) / rel, size)
    return h.hexdigest()


def weights_digest(model_dir: str | os.PathLike) -> str | None:
    """Digest of the weight files under ``model_dir``; None when it is not a local directory
    or holds no weight file (a hub name: its revision names the weights instead)."""
    root = Path(model_dir)
    if not root.is_dir():
        return None
    state = []
    for path in sorted(root.rglob("*")):
        if path.suffix in WEIGHT_SUFFIXES and path.is_file():
            st = path.stat()
            state.append((str(path.relative_to(root)), st.st_size, st.st_mtime_ns))
    if not state:
        return None
    return _digest(str(root.resolve()), tuple(state))
