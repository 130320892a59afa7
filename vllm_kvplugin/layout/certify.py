"""Start-up certification: the real kernels against the independent reference.

Called by the worker right after ``register_kv_caches``, before any request
has touched the cache.  It borrows two blocks, saves their bytes, fills them
with random bytes, gathers through :mod:`vllm_kvplugin.ops` and through
:mod:`.reference`, scatters a random chunk (with skipped tokens) both ways,
checks a neighbouring block stayed byte-identical, and restores the blocks.
Any difference raises :class:`CertificationError` naming the layout, and the
engine does not start.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_kvplugin import ops
from vllm_kvplugin.layout.descriptor import KVLayout
from vllm_kvplugin.layout.reference import reference_gather, reference_scatter


class CertificationError(RuntimeError):
    """The kernels disagree with the reference for a registered layout."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(
        {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _random_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random finite values (random bytes could be NaN, which compares unequal)."""
    vals = torch.randn(t.shape, generator=gen, dtype=torch.float32)
    return vals.to(t.dtype).to(t.device)


def _pick_blocks(layout: KVLayout) -> tuple[int, int, int]:
    n = layout.num_blocks
    if n >= 4:
        return n - 1, n // 2, n // 2 + 1  # two test blocks and one neighbour
    if n >= 2:
        return n - 1, n - 2, n - 2
    return 0, 0, 0


def certify(layout: KVLayout, layers: Sequence[torch.Tensor], seed: int = 0) -> None:
    """Raise :class:`CertificationError` unless gather/scatter match the reference."""
    gen = torch.Generator().manual_seed(seed)
    dev = layers[0].device
    b0, b1, neighbour = _pick_blocks(layout)
    bs = layout.block_size
    slots = torch.cat([torch.arange(b0 * bs, b0 * bs + bs), torch.arange(b1 * bs, b1 * bs + bs)])
    slots = slots.view(1, 2 * bs).to(torch.int64)
    nslots = None
    if neighbour not in (b0, b1):
        nslots = torch.arange(neighbour * bs, neighbour * bs + bs).repeat(2).view(1, 2 * bs)

    def gather_ref(s: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((1, *layout.chunk_shape(s.shape[1])), dtype=layout.dtype, device=dev)
        reference_gather(layout, layers, s, out)
        return out

    saved = gather_ref(slots)
    saved_neighbour = gather_ref(nslots) if nslots is not None else None
    problems: list[str] = []
    try:
        problems += _gather_problems(layout, layers, slots, gen, gather_ref)
        problems += _scatter_problems(layout, layers, slots, gen, gather_ref)
        if nslots is not None and not torch.equal(_bits(gather_ref(nslots)), _bits(saved_neighbour)):
            problems.append(f"scatter wrote into block {neighbour}, which it was not given")
    except Exception as exc:  # a kernel that refuses the descriptor fails certification too
        problems.append(f"the kernel raised {type(exc).__name__}: {exc}")
    finally:
        reference_scatter(layout, layers, slots, saved)
    if problems:
        raise CertificationError(
            "vllm-kvplugin: the gather/scatter kernels failed start-up certification for "
            f"{layout.describe()}: " + "; ".join(problems))


def _gather_problems(layout, layers, slots, gen, gather_ref) -> list[str]:
    """Fill the blocks through the reference, read them through the kernel."""
    dev = layers[0].device
    truth = _random_like(gather_ref(slots), gen)
    reference_scatter(layout, layers, slots, truth)
    got = _random_like(truth, gen)  # poison: every element must be overwritten
    ops.gather(layers, slots.to(dev), layout.strides, layout.block_size, layout.kernel_block_size,
               layout.num_blocks, got)
    if torch.equal(_bits(got), _bits(truth)):
        return []
    bad = (_bits(got) != _bits(truth)).nonzero()[:3].tolist()
    return [f"gather differs from the reference at [c, l, kv, t, h, d] {bad}"]


def _scatter_problems(layout, layers, slots, gen, gather_ref) -> list[str]:
    """Write through the kernel with skipped tokens, read back through the reference."""
    dev = layers[0].device
    bs, tokens = layout.block_size, slots.shape[1]
    before = gather_ref(slots)
    src = _random_like(before, gen)
    partial = slots.clone()
    partial[0, : max(1, bs // 4)] = -1  # partial first block
    partial[0, -max(1, bs // 3):] = -1  # partial last block
    ops.scatter(layers, partial.to(dev), layout.strides, bs, layout.kernel_block_size,
                layout.num_blocks, src)
    expect = torch.where((partial >= 0).view(1, 1, 1, tokens, 1, 1).to(dev), src, before)
    after = gather_ref(slots)
    if torch.equal(_bits(after), _bits(expect)):
        return []
    bad = (_bits(after) != _bits(expect)).nonzero()[:3].tolist()
    return [f"scatter differs from the reference at [c, l, kv, t, h, d] {bad}"]
