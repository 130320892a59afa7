"""An engine shut down leaves nothing of the plugin behind (vLLM calls the connector's
``shutdown``): its stores finish first, the store finisher's thread and the server connection's
heartbeat end, and the worker half -- with the KV cache views, the pinned tier and the device
staging it holds -- is freed.  Before, each engine left its finisher thread running, which held
its worker: on the H200 a lane of many engines ran short of device memory."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
from harness import engine, generate, shutdown
from test_cache_hits import _baseline
from test_integrity import BLOCK, CHUNK, P
from test_server_tier import server, workdir  # noqa: F401  (fixtures)

import vllm_kvplugin
from vllm_kvplugin import counters

pytestmark = pytest.mark.engine

THREADS = ("kvplugin-store-finisher", "kvplugin-mp-heartbeat")


def _plugin_threads(older: set[threading.Thread]) -> list[str]:
    """The plugin's live threads but ``older`` (those of earlier tests in this process)."""
    return sorted(t.name for t in threading.enumerate() if t.name in THREADS and t.is_alive() and t not in older)


@pytest.mark.parametrize("tier", ["local", pytest.param("server", marks=[pytest.mark.server, pytest.mark.newest_lane])])
def test_an_engine_shut_down_finishes_its_stores_and_leaves_nothing_running(qwen3_model, tier, request,
                                                                             monkeypatch):
    """The finisher on its own thread (as on a GPU), its stores held until 0.3 s after the
    engine is told to shut down: the engine stops while P's stores are still finishing.  They
    complete (counted; through the server a new engine then hits P in full), no plugin thread is
    left and the worker half is garbage."""
    from vllm_kvplugin.connector import finisher
    from vllm_kvplugin.connector import worker as wmod

    monkeypatch.setattr(finisher, "ASYNC_ON_HOST", True)
    finish, gate = wmod.WorkerSide._finish, threading.Event()
    monkeypatch.setattr(wmod.WorkerSide, "_finish", lambda self, e: (gate.wait(30), finish(self, e))[1])
    want = _baseline(qwen3_model, BLOCK, [[P]], budget=CHUNK)[0]
    cfg = {"chunk_size": CHUNK}
    if tier == "server":
        cfg.update(cpu_bytes=0, server=request.getfixturevalue("server").address)
    expected = ["kvplugin-store-finisher"] + (["kvplugin-mp-heartbeat"] if tier == "server" else [])
    older = set(threading.enumerate())
    counters.STATS.reset()
    llm = engine(qwen3_model, BLOCK, cfg, budget=CHUNK)
    try:
        assert generate(llm, [P])[0].token_ids == want
        worker = weakref.ref(wmod.registered())
        assert worker().finisher.busy()  # P's stores still finishing as the engine stops
        assert sorted(set(_plugin_threads(older))) == sorted(expected)
    finally:
        threading.Timer(0.3, gate.set).start()  # the stores finish while shutdown waits for them
        shutdown(llm)
    del llm
    gc.collect()
    assert vllm_kvplugin.stats()["stored_tokens"] == 8 * CHUNK
    assert _plugin_threads(older) == []
    assert worker() is None, gc.get_referrers(worker())
    if tier == "server":
        counters.STATS.reset()
        llm = engine(qwen3_model, BLOCK, cfg, budget=CHUNK)
        try:
            r = generate(llm, [P])[0]
            assert r.token_ids == want and r.num_cached_tokens == 8 * CHUNK
            assert vllm_kvplugin.stats()["load_failures"] == {}
        finally:
            shutdown(llm)
