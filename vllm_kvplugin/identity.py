"""A model's weights, named by their bytes: part of the model fingerprint.

Chunks outlive engines (the cache server's L2 survives restarts), so a model
directory whose weights changed must never hit chunks computed with the old
ones.  :func:`weights_digest` names the weight files by their names, sizes and
full content (xxh3-128 of every byte, on several threads): any change to any
byte changes it, while the same files copied to another machine or path keep
it, so engines there still share one cache.  Hashing runs once per file state:
the digest is kept in the plugin's cache directory, keyed by each file's path,
size, inode and modification time, so later starts read nothing.  Only the
scheduler computes it (the workers receive the fingerprint with the metadata).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

#: files whose bytes are weights (quantization scales live in them too)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
_READ = 64 << 20


def _file_hash(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(_READ):
            h.update(block)
    return h.hexdigest()


def _state(root: Path) -> list[tuple[str, int, int, int]]:
    out = []
    for path in sorted(root.rglob("*")):
        if path.suffix in WEIGHT_SUFFIXES and path.is_file():
            st = path.stat()
            out.append((str(path.relative_to(root)), st.st_size, st.st_ino, st.st_mtime_ns))
    return out


def _cache_file(root: Path) -> Path:
    from vllm_kvplugin.tiny_model import cache_dir

    name = hashlib.sha256(str(root).encode()).hexdigest()[:32]
    return cache_dir() / "weights" / f"{name}.json"


@functools.lru_cache(maxsize=16)
def _digest(root: str, state: tuple[tuple[str, int, int, int], ...]) -> str:
    cache = _cache_file(Path(root))
    try:
        kept = json.loads(cache.read_text())
        if kept.get("state") == [list(s) for s in state]:
            return str(kept["digest"])
    except (OSError, ValueError, KeyError):
        pass
    with ThreadPoolExecutor(max(1, min(8, len(state), os.cpu_count() or 1))) as pool:
        hashes = list(pool.map(_file_hash, [Path(root) / rel for rel, *_ in state]))
    h = hashlib.sha256(b"kvplugin/weights/v1\x00")
    for (rel, size, _ino, _mtime), content in zip(state, hashes):
        h.update(f"{rel}\x00{size}\x00{content}\x00".encode())
    digest = h.hexdigest()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"root": root, "state": state, "digest": digest}))
        tmp.replace(cache)
    except OSError:
        pass  # no cache: the next start hashes again
    return digest


def weights_digest(model_dir: str | os.PathLike) -> str | None:
    """Digest of the weight files under ``model_dir``; None when it is not a local directory
    or holds no weight file (a hub name: its revision names the weights instead)."""
    root = Path(model_dir)
    if not root.is_dir():
        return None
    state = _state(root)
    if not state:
        return None
    return _digest(str(root.resolve()), tuple(state))
