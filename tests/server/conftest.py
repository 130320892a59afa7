from __future__ import annotations

import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from srvutil import ServerProc  # noqa: E402


@pytest.fixture
def short_tmp():
    """A short directory (Unix socket paths are limited to 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="kvs-", dir="/tmp") as d:
        yield d


@pytest.fixture
def server_factory(short_tmp):
    started: list[ServerProc] = []

    def make(*args: str, start: bool = True, **kw) -> ServerProc:
        s = ServerProc(short_tmp, *args, **kw)
        started.append(s)
        return s.start() if start else s

    yield make
    for s in started:
        s.stop()
    from vllm_kvplugin.server.pool import sweep_stale_pools

    sweep_stale_pools("/dev/shm")  # pools of servers the tests killed with SIGKILL


@pytest.fixture
def server(server_factory):
    return server_factory("--l1-bytes", "256MiB")
