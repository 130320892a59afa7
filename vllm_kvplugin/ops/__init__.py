"""The custom ops ``kvplugin::gather`` and ``kvplugin::scatter``.

One schema, registered once per process by :func:`load`:

    gather(Tensor[] kv_layers, Tensor slots, int[] strides, int block_size,
           int kernel_block_size, int num_blocks, Tensor(a!) out) -> ()
    scatter(Tensor(a!)[] kv_layers, Tensor slots, int[] strides, int block_size,
            int kernel_block_size, int num_blocks, Tensor src) -> ()

``gather`` copies paged KV into canonical chunks ``out[C, L, KV, T, H, D]``;
``scatter`` copies chunks back.  ``slots[c, t]`` is the paged slot
(``block_id * block_size + offset``) of chunk token ``t`` or ``-1`` (skip).
``strides`` are the paged view's element strides ``[block, sub, tok, head, kv,
dim]`` (see :class:`vllm_kvplugin.layout.KVLayout`).

Which implementation runs is decided here, once, when the ops are loaded: the
compiled module ``vllm_kvplugin._C`` (C++ CPU kernel, plus the CUDA kernel
when it was built with CUDA) or, for a device it has no kernel for, the pure
torch path below.  :func:`info` reports the choice; nothing switches later.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GATHER_SCHEMA = (
    "gather(Tensor[] kv_layers, Tensor slots, int[] strides, int block_size, "
    "int kernel_block_size, int num_blocks, Tensor(a!) out) -> ()"
)
SCATTER_SCHEMA = (
    "scatter(Tensor(a!)[] kv_layers, Tensor slots, int[] strides, int block_size, "
    "int kernel_block_size, int num_blocks, Tensor src) -> ()"
)


@dataclass(frozen=True)
class OpsInfo:
    """Which implementation serves each device type."""

    cpu: str
    cuda: str
    compiled_module_error: str | None = None

    def describe(self) -> str:
        text = f"cpu: {self.cpu}; cuda: {self.cuda}"
        if self.compiled_module_error:
            text += f" (compiled ops not loaded: {self.compiled_module_error})"
        return text


_LOCK = threading.Lock()
_INFO: OpsInfo | None = None
_LIBS: list[torch.library.Library] = []  # keep registrations alive


def _check_slots(op: str, slots: torch.Tensor, num_blocks: int, block_size: int) -> None:
    if slots.numel() == 0:
        return
    lo, hi = int(slots.min()), int(slots.max())
    limit = num_blocks * block_size
    if lo < -1 or hi >= limit:
        bad = lo if lo < -1 else hi
        raise RuntimeError(
            f"{op}: slot {bad} is outside the cache ({num_blocks} blocks of {block_size} tokens)"
        )


def _torch_move(
    op: str,
    to_chunk: bool,
    kv_layers: Sequence[torch.Tensor],
    slots: torch.Tensor,
    strides: Sequence[int],
    block_size: int,
    kernel_block_size: int,
    num_blocks: int,
    chunk: torch.Tensor,
) -> None:
    """Pure-torch implementation shared by both ops (same contract as the kernels)."""
    if chunk.dim() != 6:
        raise RuntimeError(f"{op}: chunk must be [C, L, KV, T, H, D], got {tuple(chunk.shape)}")
    C, L, KV, T, H, D = chunk.shape
    if len(kv_layers) != L:
        raise RuntimeError(f"{op}: {len(kv_layers)} layers given for a chunk of L={L}")
    if tuple(slots.shape) != (C, T) or slots.dtype != torch.int64:
        raise RuntimeError(f"{op}: slots must be int64 [{C}, {T}], got {slots.dtype} {tuple(slots.shape)}")
    if block_size % kernel_block_size:
        raise RuntimeError(f"{op}: block_size {block_size} must be a multiple of kernel_block_size {kernel_block_size}")
    for t in kv_layers:
        if t.dtype != chunk.dtype or t.device != chunk.device:
            raise RuntimeError(f"{op}: layer {t.dtype}/{t.device} != chunk {chunk.dtype}/{chunk.device}")
    _check_slots(op, slots, num_blocks, block_size)
    flat = slots.reshape(-1)
    where = torch.nonzero(flat >= 0).squeeze(1)
    if where.numel() == 0:
        return
    idx = flat[where]
    block = idx // block_size
    offset = idx % block_size
    sub = offset // kernel_block_size
    tok = offset % kernel_block_size
    c = where // T
    t = where % T
    r = block_size // kernel_block_size
    for layer_index, layer in enumerate(kv_layers):
        view = layer.as_strided(
            (num_blocks, r, kernel_block_size, H, KV, D), tuple(strides), layer.storage_offset()
        )
        if to_chunk:
            chunk[c, layer_index, :, t] = view[block, sub, tok].permute(0, 2, 1, 3)
        else:
            view[block, sub, tok] = chunk[c, layer_index, :, t].permute(0, 2, 1, 3)


def _torch_gather(kv_layers, slots, strides, block_size, kernel_block_size, num_blocks, out):
    _torch_move("kvplugin::gather", True, kv_layers, slots, strides, block_size,
                kernel_block_size, num_blocks, out)


def _torch_scatter(kv_layers, slots, strides, block_size, kernel_block_size, num_blocks, src):
    _torch_move("kvplugin::scatter", False, kv_layers, slots, strides, block_size,
                kernel_block_size, num_blocks, src)


def _register_fakes() -> None:
    def _fake(kv_layers, slots, strides, block_size, kernel_block_size, num_blocks, chunk):
        torch._check(chunk.dim() == 6, lambda: "chunk must be [C, L, KV, T, H, D]")
        torch._check(len(kv_layers) == chunk.shape[1], lambda: "one layer per chunk layer")
        torch._check(slots.dim() == 2, lambda: "slots must be [C, T]")
        torch._check(len(strides) == 6, lambda: "six strides")
        return None

    torch.library.register_fake("kvplugin::gather")(_fake)
    torch.library.register_fake("kvplugin::scatter")(_fake)


def load() -> OpsInfo:
    """Register the ops in this process (idempotent) and return which kernels serve them."""
    global _INFO
    with _LOCK:
        if _INFO is not None:
            return _INFO
        error = None
        try:
            from vllm_kvplugin import _C  # noqa: F401  (registers schema + kernels)

            compiled, compiled_cuda = True, bool(_C.HAS_CUDA_KERNEL)
        except Exception as exc:  # ImportError, or a build for another torch (undefined symbols)
            compiled, compiled_cuda, error = False, False, f"{type(exc).__name__}: {exc}"
        if compiled:
            cpu = "C++ kernel"
        else:
            lib = torch.library.Library("kvplugin", "DEF")
            lib.define(GATHER_SCHEMA)
            lib.define(SCATTER_SCHEMA)
            lib.impl("gather", _torch_gather, "CPU")
            lib.impl("scatter", _torch_scatter, "CPU")
            _LIBS.append(lib)
            cpu = "pure torch"
        if compiled_cuda:
            cuda = "CUDA kernel"
        elif torch.version.cuda is None and not torch.cuda.is_available():
            cuda = "n/a (torch without CUDA)"
        else:
            lib = torch.library.Library("kvplugin", "IMPL")
            lib.impl("gather", _torch_gather, "CUDA")
            lib.impl("scatter", _torch_scatter, "CUDA")
            _LIBS.append(lib)
            cuda = "pure torch"
        _register_fakes()
        _INFO = OpsInfo(cpu=cpu, cuda=cuda, compiled_module_error=error)
        if error:
            logger.warning("vllm-kvplugin: compiled ops unavailable, using pure torch (%s)", error)
        return _INFO


def info() -> OpsInfo:
    return load()


def gather(kv_layers, slots, strides, block_size, kernel_block_size, num_blocks, out) -> None:
    """Paged KV -> canonical chunks ``out[C, L, KV, T, H, D]`` (see module doc)."""
    load()
    torch.ops.kvplugin.gather(list(kv_layers), slots, list(strides), block_size,
                              kernel_block_size, num_blocks, out)


def scatter(kv_layers, slots, strides, block_size, kernel_block_size, num_blocks, src) -> None:
    """Canonical chunks ``src[C, L, KV, T, H, D]`` -> paged KV (see module doc)."""
    load()
    torch.ops.kvplugin.scatter(list(kv_layers), slots, list(strides), block_size,
                               kernel_block_size, num_blocks, src)


def torch_reference_impl():
    """The pure-torch implementation, for tests that compare it with the kernels."""
    return _torch_gather, _torch_scatter
