"""Whether a side-by-side run's engines fit the GPU, checked before any of them starts.

Four default TTFT engines on an H100 ran out of memory only after ~150 s of device time (the
model's build, four engine start-ups).  Called by the parent process of ``gpu_ttft.py`` and
``gpu_serving.py``, which keeps no CUDA context (the engines' children need the memory): the
GPU's size comes from ``nvidia-smi``, the weights' from the model's safetensors files.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

GiB = 1 << 30
#: per engine beside its weights, KV cache and staging: CUDA context, activations, graphs, the
#: sampler, the caching allocator's slack.  Measured (H100, 2026-12-06, 16,384 batched tokens,
#: prompts to 32k): a plugin engine with 5 GiB of KV and 5 of staging held 27.6 GiB, 8.0 beside
#: its 9.6 of weights; three of them, estimated at 67.8 GiB with 3 of work space each, ran out of
#: the card's 79.6.  Three with 3 GiB of KV and 3 of staging ran (estimated now at 70.8).
WORK_BYTES = 8 * GiB


def weights_bytes(model: str) -> int:
    """The model's weights on disk (bf16 safetensors: as many bytes on the GPU)."""
    return sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))


def gpu_bytes() -> int | None:
    """GPU 0's memory (``nvidia-smi``, no CUDA context here); None where it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = out.stdout.strip().splitlines()[:1]
    return int(first[0]) << 20 if out.returncode == 0 and first and first[0].strip().isdigit() else None


def needed_bytes(modes: Sequence[str], weights: int, kv_bytes: int, staging_bytes: int) -> int:
    """What ``modes``' engines take together: each its weights, KV cache and work space, and
    each of the plugin's (``kvplugin*``) its device staging."""
    return sum(weights + kv_bytes + WORK_BYTES + (staging_bytes if m.startswith("kvplugin") else 0)
               for m in modes)


def check(modes: Sequence[str], model: str, kv_bytes: int, staging_bytes: int, hint: str) -> None:
    """Exit with what the engines need and ``hint`` when they cannot fit the GPU; else print it."""
    total, weights = gpu_bytes(), weights_bytes(model)
    need = needed_bytes(modes, weights, kv_bytes, staging_bytes)
    what = (f"{len(modes)} engines ({','.join(modes)}) need ~{need / GiB:.1f} GiB: weights "
            f"{weights / GiB:.1f}, KV {kv_bytes / GiB:.1f} and ~{WORK_BYTES / GiB:.0f} of work space "
            f"each, staging {staging_bytes / GiB:.1f} each for the plugin's")
    if total is not None and need > total:
        raise SystemExit(f"{what}; the GPU has {total / GiB:.1f} GiB. {hint}")
    print(what + (f"; the GPU has {total / GiB:.1f} GiB" if total else ""), flush=True)
