"""What ``vllm-kvplugin verify`` runs inside each vLLM worker process (``collective_rpc``).

Each function takes vLLM's worker object first (unused: the plugin's own worker half of
this process is :func:`~vllm_kvplugin.connector.worker.registered`) and returns plain data.
"""

from __future__ import annotations

from typing import Any

from vllm_kvplugin import counters
from vllm_kvplugin.connector.worker import registered


def _worker_half():
    ws = registered()
    if ws is None:
        raise RuntimeError("no KVPluginConnector worker is registered in this process: is the connector "
                           "KVPluginConnector, with kv_role kv_both?")
    return ws


def info(_worker: Any) -> dict:
    """This rank, its chunk size and its KV cache groups."""
    ws = _worker_half()
    return {"rank": ws.rank, "world": ws.world, "chunk_size": ws.chunk_size,
            "groups": [g.kind.name for g in ws.groups], "drafter": any(g.drafter for g in ws.groups),
            "device": str(ws.device)}


def load_counters(_worker: Any) -> dict:
    """This process's load counters (tokens and bytes loaded, failures by reason)."""
    s = counters.WORKER.snapshot()
    return {"loaded_tokens": s["loaded_tokens"], "loaded_bytes": s["loaded_bytes"],
            "load_failures": sum(s[counters.FAILURES].values())}


def poison(_worker: Any, seed: int) -> int:
    """Finite noise, in each tensor's own dtype, into every KV block of every layer and every
    recurrent state this rank holds (states last: groups may overlay one buffer); the number of
    elements overwritten."""
    import torch

    ws = _worker_half()
    rec = [g.is_state for g in ws.groups]
    tensors = [t for g, layers in enumerate(ws.layers) if not rec[g] for t in layers]
    tensors += [t for g, layers in enumerate(ws.layers) if rec[g] for views in layers for t in views]
    n = 0
    for i, t in enumerate(tensors):
        gen = torch.Generator(device=t.device).manual_seed(seed * 1000 + i)
        t.copy_(torch.randn(t.shape, generator=gen, device=t.device).to(t.dtype))
        n += t.numel()
    if tensors and tensors[0].device.type == "cuda":
        torch.cuda.synchronize(tensors[0].device)  # done before the next request is timed
    return n


def skip_loads(_worker: Any, on: bool) -> bool:
    """The negative control: hits are verified and claimed as usual, but no byte is written
    into the KV cache (``verify`` must then fail)."""
    ws = _worker_half()
    if on:  # every load goes through ``_load`` (from the step's metadata, or ``load_now``)
        ws._load = lambda req, epoch: None
    else:
        ws.__dict__.pop("_load", None)
    return on
