"""Pieces of the server without processes: header mirror, ids, allocator, addresses, flags."""

from __future__ import annotations

import os
import random

import pytest

from vllm_kvplugin.server import chunkhdr
from vllm_kvplugin.server.config import ServerConfigError, config_from_args, parse_bytes
from vllm_kvplugin.server.pool import Allocator, block_size_for
from vllm_kvplugin.server.protocol import (
    OBJECT_ID_SIZE,
    PAYLOAD_ALIGN,
    object_id,
    parse_address,
    split_object_id,
)

pytestmark = [pytest.mark.server, pytest.mark.newest_lane]


def test_server_reads_what_the_plugin_writes():
    """The header the worker writes names the object the server stores it under."""
    from vllm_kvplugin.chunk import format as F

    key, fp = bytes(range(32)), bytes(range(32, 64))
    payload = bytes(random.Random(1).randbytes(4 * 2 * 8 * 2 * 16 * 2))
    expect = F.ChunkExpect(fp, key, 1, "bfloat16", (4, 2, 8, 2, 16), 256, 264, 4, 3, 2)
    ref = F.ChunkHeader.for_payload(expect, payload).pack()
    mine = chunkhdr.pack_header(key=key, group=2, rank=3, world=4, payload_nbytes=len(payload),
                                checksum=chunkhdr.payload_checksum(payload), fingerprint=fp, kind=1,
                                dtype="bfloat16", shape=(4, 2, 8, 2, 16), token_start=256, token_end=264)
    assert mine == ref
    h = chunkhdr.parse_header(ref)
    assert chunkhdr.header_object_id(h) == object_id(key, 2, 3, 4)
    assert h.object_size == chunkhdr.HEADER_SIZE + len(payload)
    bad = bytearray(ref)
    bad[40] ^= 1
    with pytest.raises(chunkhdr.HeaderError) as ei:
        chunkhdr.parse_header(bytes(bad))
    assert ei.value.reason == "header_checksum"


def test_object_id_roundtrip_and_checks():
    key = bytes(range(32))
    oid = object_id(key, 7, 3, 8)
    assert len(oid) == OBJECT_ID_SIZE == 38
    assert split_object_id(oid) == (key, 7, 3, 8)
    assert object_id(key, 0, 0, 1) != object_id(key, 0, 0, 2)
    for bad in [(key[:31], 0, 0, 1), (key, 0, 1, 1), (key, -1, 0, 1), (key, 0, 0, 0), (key, 70000, 0, 1)]:
        with pytest.raises(ValueError):
            object_id(*bad)


def test_allocator_best_fit_and_coalescing():
    cap = 1 << 20
    a = Allocator(cap)
    rng = random.Random(0)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            size = rng.choice([256, 512, 4096, 8192, 65536])
            off = a.alloc(size)
            if off is None:
                continue
            assert off % PAYLOAD_ALIGN == 0 and off + size <= cap
            for o, s in live.items():  # no overlap
                assert off + size <= o or o + s <= off
            live[off] = size
    assert a.used == sum(live.values())
    for off, size in list(live.items()):
        a.free(off, size)
    assert a.used == 0 and a.free_extents == 1 and a.largest_free() == cap
    # an exact-size hole is reused before the big free tail
    a.alloc(4096)
    y = a.alloc(8192)
    a.alloc(4096)
    a.free(y, 8192)
    assert a.alloc(8192) == y
    assert block_size_for(1) == PAYLOAD_ALIGN


def test_addresses():
    assert parse_address("unix:///tmp/a.sock").path == "/tmp/a.sock"
    assert parse_address("/tmp/a.sock").zmq == "ipc:///tmp/a.sock"
    a = parse_address("tcp://127.0.0.1:5555")
    assert (a.kind, a.host, a.port, a.is_loopback) == ("tcp", "127.0.0.1", 5555, True)
    assert parse_address("tcp://[::1]:7").is_loopback
    assert not parse_address("tcp://0.0.0.0:7").is_loopback
    assert not parse_address("tcp://10.1.2.3:7").is_loopback
    for bad in ["", "http://x", "tcp://nohost", "tcp://h:99999", "unix://" + "/x" * 80]:
        with pytest.raises(ValueError):
            parse_address(bad)


def test_flags_errors_name_the_flag(tmp_path):
    cfg = config_from_args(["--listen", f"unix://{tmp_path}/s", "--l1-bytes", "1GiB", "--lease-s", "3"])
    assert cfg.l1_bytes == 1 << 30 and cfg.lease_s == 3 and cfg.l2_dir is None and cfg.token is None
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("4G") == 4 << 30 and parse_bytes("123") == 123
    cases = [
        (["--l1-bytes", "lots"], "--l1-bytes"),
        (["--l1-bytes", "10"], "--l1-bytes"),
        (["--listen", "tcp://0.0.0.0:5555"], "--token-file"),
        (["--listen", "tcp://127.0.0.1:5555"], "--token-file"),  # loopback too: every local user reaches it
        (["--listen", "tcp://10.0.0.1:5555"], "--listen"),
        (["--listen", "ftp://x"], "--listen"),
        (["--lease-s", "0"], "--lease-s"),
        (["--heartbeat-s", "-1"], "--heartbeat-s"),
        (["--high-watermark", "1.5"], "--high-watermark"),
        (["--low-watermark", "0.99", "--high-watermark", "0.9"], "--low-watermark"),
        (["--l2-dir", str(tmp_path), "--l2-bytes", "0"], "--l2-bytes"),
        (["--token", "a-secret-on-the-command-line"], "/proc/PID/cmdline"),
        (["--token-file", str(tmp_path / "missing")], "--token-file"),
    ]
    for argv, flag in cases:
        with pytest.raises(ServerConfigError) as ei:
            config_from_args(argv)
        assert flag in str(ei.value), (argv, str(ei.value))
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-the-node\n")
    token.chmod(0o644)  # others could read it
    with pytest.raises(ServerConfigError, match="nobody else"):
        config_from_args(["--listen", "tcp://0.0.0.0:0", "--token-file", str(token)])
    token.chmod(0o600)
    ok = config_from_args(["--listen", "tcp://0.0.0.0:0", "--token-file", str(token)])
    assert ok.token == "s3cret-token-of-the-node" and not ok.listen.is_loopback
    token.write_text("short")
    with pytest.raises(ServerConfigError, match="at least 16"):
        config_from_args(["--listen", "tcp://0.0.0.0:0", "--token-file", str(token)])


def test_server_and_client_run_without_torch(tmp_path):
    """The server (and the client library) must not need torch: run both with torch blocked."""
    import subprocess
    import sys
    import tempfile
    import textwrap

    sock = os.path.join(tempfile.mkdtemp(prefix="kvs-nt-", dir="/tmp"), "s.sock")  # private, short
    code = textwrap.dedent(f"""
        import sys, threading, time
        sys.modules["torch"] = None  # any import of torch now raises ImportError
        from vllm_kvplugin.server.app import Server
        from vllm_kvplugin.server.config import config_from_args
        from vllm_kvplugin.tiers.mp_client import MPClient
        srv = Server(config_from_args(["--listen", {sock!r}, "--l1-bytes", "8MiB",
                                       "--l2-dir", {str(tmp_path / "l2")!r}]))
        t = threading.Thread(target=srv.run, daemon=True)
        t.start()
        c = MPClient("unix://" + {sock!r})
        print(c.stats()["l1_capacity"])
        c.close()
        srv.running = False
        t.join(5)
        srv.close()
        assert "torch" not in [m for m, v in sys.modules.items() if v is not None]
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(8 << 20)]
