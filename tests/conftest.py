"""Shared fixtures: tiny local models (built once, cached; no downloads)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in-process: hooks see them
if "VLLM_RPC_BASE_PATH" not in os.environ:
    # vLLM's ZMQ sockets (``ipc://<base>/<uuid>``) of engines in their own processes: a test that
    # kills one would leave its socket in the machine's temporary folder; here they go with the run
    _rpc = tempfile.mkdtemp(prefix="kvplugin-tests-rpc-")
    os.environ["VLLM_RPC_BASE_PATH"] = _rpc
    atexit.register(shutil.rmtree, _rpc, True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def qwen3_model() -> str:
    from vllm_kvplugin import tiny_model

    return str(tiny_model.build(tiny_model.QWEN3))


@pytest.fixture(scope="session")
def demo_model() -> str:
    """The demo's model: Qwen3-8B's per-layer KV (8 KV heads x head dim 128, bf16), 8 layers."""
    from vllm_kvplugin import tiny_model

    return str(tiny_model.build(tiny_model.DEMO))


@pytest.fixture(scope="session")
def llama_model() -> str:
    from vllm_kvplugin import tiny_model

    return str(tiny_model.build(tiny_model.LLAMA))


def pytest_collection_modifyitems(config, items):
    """The longest tests first (slow ones, then those that start engines): with the workers
    stealing work from each other (``--dist worksteal``), no long test is left for the end of a
    run while the other worker idles."""
    def rank(item) -> int:
        return 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("engine") else 2

    items.sort(key=rank)  # stable: collection order within each rank


@pytest.fixture(autouse=True)
def _no_client_left_running():
    """A cache-server client a test opened and did not close keeps its heartbeat thread alive in
    the worker, where a later test that counts the plugin's threads fails for it: fail here, in
    the test that left it."""
    before = set(threading.enumerate())
    yield
    left = [t for t in threading.enumerate() if t.name == "kvplugin-mp-heartbeat" and t not in before]
    for t in left:
        t.join(timeout=2.0)  # a closed client's thread ends at its next wake
    left = [t for t in left if t.is_alive()]
    assert not left, f"{len(left)} cache server client(s) opened by this test were not closed"
