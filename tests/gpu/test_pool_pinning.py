"""Page-locking the server's pool mapping in a CUDA worker (``tiers.mp._page_lock``).

Found on the H200: the pool was registered twice (``cudaErrorHostMemoryAlreadyRegistered``)
and the failed call's error, left as CUDA's "last error", made the worker's next
allocation raise, so its first store failed.  Registration now happens once per
mapping, and a failed one costs only speed.
"""

from __future__ import annotations

import logging
import mmap

import pytest
import torch

from vllm_kvplugin.tiers.mp import _page_lock

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _next_cuda_op() -> None:
    x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda").fill_(7)
    torch.cuda.synchronize()
    assert int(x[-1]) == 7


def test_registered_once_and_copies_land_in_the_mapping(caplog):
    m = mmap.mmap(-1, 8 << 20, mmap.MAP_SHARED)
    t = torch.frombuffer(m, dtype=torch.uint8)
    assert not t.is_pinned()
    with caplog.at_level(logging.WARNING, logger="vllm_kvplugin.tiers.mp"):
        _page_lock(t)
        _page_lock(t)  # a second call (the same mapping seen again) must not register again
    assert t.is_pinned() and not caplog.records, caplog.text
    _next_cuda_op()
    src = torch.randint(0, 256, (t.numel(),), dtype=torch.uint8, device="cuda")
    t.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert bytes(m[:4096]) == bytes(src[:4096].cpu().numpy())  # the bytes are in the mapping itself
    assert int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr())) == 0
    del t
    m.close()


def test_a_failed_registration_leaves_no_error_behind(caplog):
    # the premise: a failed cudaHostRegister leaves its error to the next torch CUDA check
    assert int(torch.cuda.cudart().cudaHostRegister(0, 0, 0)) != 0
    with pytest.raises(RuntimeError):
        _next_cuda_op()
    # _page_lock meets the same failure, warns, and the next CUDA operation is unaffected
    with caplog.at_level(logging.WARNING, logger="vllm_kvplugin.tiers.mp"):
        _page_lock(torch.empty(0, dtype=torch.uint8))
    assert "cudaHostRegister of the server pool" in caplog.text
    _next_cuda_op()


def test_restarts_unregister_and_unmap_the_old_pools(tmp_path):
    """A pinning worker under 3 server restarts: each new pool is page-locked once, each old one
    unregistered (cudaHostUnregister) and unmapped once nothing uses it; copies keep landing."""
    import os
    import time

    from srvutil import ServerProc

    from vllm_kvplugin.config import KVPluginConfig
    from vllm_kvplugin.tiers.mp import ServerStore
    from vllm_kvplugin.tiers.mp_client import TierUnavailable

    short = os.path.join("/tmp", f"kvg-{os.getpid()}")
    os.makedirs(short, exist_ok=True)
    srv = ServerProc(short, "--l1-bytes", "64MiB").start()
    cfg = KVPluginConfig.from_extra_config({"server": srv.address, "cpu_bytes": 0})
    ws = ServerStore(cfg, rank=0, world=1, name="gpu-worker", pin_for_cuda=True)
    try:
        first = ws._pool()
        assert first.is_pinned()
        del first
        for _ in range(3):
            assert srv.stop() == 0
            srv.start()
            for _attempt in range(40):  # the call that meets the new instance fails, and the
                try:                    # client backs off for a second before it asks again
                    ws._client.stats()
                    break
                except TierUnavailable:
                    time.sleep(0.25)
            pool = ws._pool()
            assert pool.is_pinned()
            src = torch.randint(0, 256, (4096,), dtype=torch.uint8, device="cuda")
            pool[:4096].copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(pool[:4096].cpu(), src.cpu())
            del pool
            ws._client.stats()  # a call: the old pools are checked and let go
            assert ws._client.mapped_pools == 1 and len(ws._registered) == 1
        _next_cuda_op()  # no CUDA error left behind by the unregistrations
    finally:
        ws.close()
        srv.stop()
