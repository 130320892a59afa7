"""Independent reference for gather/scatter, written from vLLM's layout rules.

Nothing here uses :func:`vllm_kvplugin.layout.build.derive_strides` or the
op kernels: each layer tensor is indexed the way vLLM's own attention code
reads it (plain tensor views and indexing), so a wrong stride in the plugin
shows up as a difference instead of round-tripping through the same mistake.

* GPU fused (FlashAttention & co.): ``kv_cache.transpose(1, 2).split(D, -1)``
  -> K = ``t[b, :, n, :D]``, V = ``t[b, :, n, D:]``.
* CPU_ATTN: ``kv_cache.view(B, H, 2N, D).chunk(2, dim=2)``.
* split: ``t[0]``/``t[1]`` (K/V first) or ``t[:, 0]``/``t[:, 1]`` (blocks first).
* MLA: one latent row per token, ``t[b, n]`` or ``t[b, 0, n]``.
* kernel-block splitting: manager block ``b`` is kernel blocks
  ``b*r .. b*r + r - 1`` (``group_kernel_blocks``: ``unflatten(0, (B, r))``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_kvplugin.layout.descriptor import ContentSemantics, KVLayout


def token_view(sem: ContentSemantics, t: torch.Tensor, head_dim: int, kernel_block_size: int) -> torch.Tensor:
    """A view ``[NBk, N, KV, H, D]`` of one layer, derived from vLLM's reading rules."""
    if sem is ContentSemantics.GPU_FUSED:
        # (NBk, H, N, 2D) -> (NBk, N, H, 2D) -> (NBk, N, H, 2, D) -> (NBk, N, 2, H, D)
        return t.transpose(1, 2).unflatten(-1, (2, head_dim)).transpose(2, 3)
    if sem is ContentSemantics.CPU_FUSED:
        nbk, h = t.shape[0], t.shape[1]
        rows = t.view(nbk, h, 2 * kernel_block_size, head_dim)  # vLLM's own .view
        return rows.unflatten(2, (2, kernel_block_size)).permute(0, 3, 2, 1, 4)
    if sem is ContentSemantics.SPLIT_KV_FIRST:
        return t.permute(1, 2, 0, 3, 4)
    if sem is ContentSemantics.SPLIT_BLOCK_FIRST:
        return t.permute(0, 2, 1, 3, 4)
    if sem is ContentSemantics.MLA_LATENT:
        if t.dim() == 4:  # (NBk, 1, N, D)
            return t.permute(0, 2, 1, 3).unsqueeze(2)
        return t.unsqueeze(2).unsqueeze(2)  # (NBk, N, D) -> (NBk, N, 1, 1, D)
    raise ValueError(f"no reference for {sem}")


def _index(slots: torch.Tensor, block_size: int, kernel_block_size: int):
    T = slots.shape[1]
    flat = slots.reshape(-1)
    where = torch.nonzero(flat >= 0).squeeze(1)
    idx = flat[where]
    r = block_size // kernel_block_size
    kb = (idx // block_size) * r + (idx % block_size) // kernel_block_size
    n = (idx % block_size) % kernel_block_size
    return where // T, where % T, kb, n


def reference_gather(layout: KVLayout, layers: Sequence[torch.Tensor], slots: torch.Tensor,
                     out: torch.Tensor) -> None:
    """``out[C, L, KV, T, H, D]`` <- paged KV at ``slots[C, T]`` (-1 = leave untouched).

    ``out`` may live on another device than the layers (e.g. a host copy of GPU KV).
    """
    c, t, kb, n = _index(slots.cpu(), layout.block_size, layout.kernel_block_size)
    dev = layers[0].device
    c, t = c.to(out.device), t.to(out.device)
    kb, n = kb.to(dev), n.to(dev)
    for li, layer in enumerate(layers):
        view = token_view(layout.semantics, layer, layout.head_dim, layout.kernel_block_size)
        out[c, li, :, t] = view[kb, n].to(out.device)  # [n, KV, H, D]


def reference_scatter(layout: KVLayout, layers: Sequence[torch.Tensor], slots: torch.Tensor,
                      src: torch.Tensor) -> None:
    """Paged KV at ``slots[C, T]`` <- ``src[C, L, KV, T, H, D]`` (-1 = skip); ``src`` on any device."""
    c, t, kb, n = _index(slots.cpu(), layout.block_size, layout.kernel_block_size)
    dev = layers[0].device
    c, t = c.to(src.device), t.to(src.device)
    kb, n = kb.to(dev), n.to(dev)
    for li, layer in enumerate(layers):
        view = token_view(layout.semantics, layer, layout.head_dim, layout.kernel_block_size)
        view[kb, n] = src[c, li, :, t].to(dev)
