"""The README's tables are rendered from the data (config fields, compat matrix), not copied by hand."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_kvplugin import adapters
from vllm_kvplugin.config import config_table_markdown

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _block(name: str) -> str:
    m = re.search(rf"<!-- BEGIN {name}[^>]*-->\n(.*?)\n<!-- END {name} -->", README, re.S)
    assert m, f"README has no {name} block"
    return m.group(1)


def test_config_table_is_current():
    assert _block("config-table") == config_table_markdown()


def test_compat_matrix_is_current():
    assert _block("compat-matrix") == adapters.matrix_markdown().rstrip("\n")
