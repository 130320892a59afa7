"""The test process imports the installed plugin, with its compiled op.

The nox sessions install the plugin non-editable into each venv (its ``_C`` extension is
built against that venv's torch) and set ``KVPLUGIN_EXPECT_INSTALLED=1``; this test then
proves the tests did not pick up the source tree instead (which would test a ``_C``
built for another torch, or the pure-torch fallback).  Outside nox it is skipped.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("KVPLUGIN_EXPECT_INSTALLED") != "1",
                                reason="only under nox (KVPLUGIN_EXPECT_INSTALLED=1)")


def test_plugin_is_imported_from_the_venv():
    import vllm_kvplugin

    where = Path(vllm_kvplugin.__file__).resolve()
    prefix = Path(sys.prefix).resolve()
    assert prefix in where.parents, f"vllm_kvplugin imported from {where}, not from the venv {prefix}"


def test_compiled_cpu_kernel_is_loaded():
    from vllm_kvplugin import ops

    info = ops.info()
    assert info.cpu == "C++ kernel", info.describe()


def test_matrix_ships_with_the_package():
    from vllm_kvplugin import adapters

    assert adapters.MATRIX_PATH.is_file() and not adapters.MATRIX_PATH.is_symlink()
    assert adapters.matrix(), "empty compat matrix"
