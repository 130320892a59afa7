"""vLLM asks ``has_connector_metadata()`` only to decide whether to call a layer's two hooks.

``KVPluginConnector.has_connector_metadata`` answers False while no store DMA waits to be issued,
so that vLLM skips ``wait_for_layer_load`` and ``save_kv_layer`` (whose one job is to issue those
DMAs).  That is right only while vLLM's sole use of the method outside connector implementations
is the per-layer gate in ``maybe_transfer_kv_layer``, and that gate guards exactly those two
hooks.  Read from the installed vLLM's sources in every lane (cpu-0.26 ... cpu-0.32, api-0.33).
"""

from __future__ import annotations

import ast
from pathlib import Path

#: connector implementations (vLLM's own connectors call it on themselves)
CONNECTORS = ("distributed/kv_transfer/kv_connector/v1/",)
GATE = "model_executor/layers/attention/kv_transfer_utils.py"


def _callers(root: Path) -> dict[str, list[str]]:
    """vLLM file (relative) -> the innermost functions that call ``.has_connector_metadata()``."""
    out: dict[str, list[str]] = {}

    def visit(node: ast.AST, fn: str | None, rel: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr == "has_connector_metadata" and inner not in out.get(rel, [])):
                out.setdefault(rel, []).append(inner)
            visit(child, inner, rel)

    for path in sorted(root.rglob("*.py")):
        text = path.read_text(errors="replace")
        if "has_connector_metadata" in text:
            visit(ast.parse(text), None, path.relative_to(root).as_posix())
    return out


def test_vllm_asks_has_connector_metadata_only_before_a_layers_hooks():
    import vllm

    root = Path(vllm.__file__).resolve().parent
    outside = {f: fns for f, fns in _callers(root).items() if not f.startswith(CONNECTORS)}
    assert outside == {GATE: ["wrapper"]}, (
        f"vLLM {vllm.__version__} calls has_connector_metadata() outside its connectors at {outside}; "
        f"the plugin's override (connector/connector.py) assumes only {GATE}'s per-layer gate")

    # the gate: `if <...> or not connector.has_connector_metadata(): return func(...)`, and after
    # it the only connector calls are the two per-layer hooks
    wrapper = next(n for n in ast.walk(ast.parse((root / GATE).read_text()))
                   if isinstance(n, ast.FunctionDef) and n.name == "wrapper")
    gate = next(i for i, st in enumerate(wrapper.body) if isinstance(st, ast.If)
                and "has_connector_metadata" in ast.unparse(st.test))
    guard = wrapper.body[gate]
    assert ast.unparse(guard.test).endswith("not connector.has_connector_metadata()")
    assert [type(st) for st in guard.body] == [ast.Return] and not guard.orelse
    after = [n.func.attr for st in wrapper.body[gate + 1:] for n in ast.walk(st)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == "connector"]
    assert after == ["wait_for_layer_load", "save_kv_layer"], (
        f"vLLM {vllm.__version__}: after its has_connector_metadata() gate the wrapper calls {after}")
