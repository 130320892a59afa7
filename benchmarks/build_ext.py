"""Fallback build of ``vllm_kvplugin._C`` with the CUDA kernel, in place.

For a machine whose setuptools is too old for ``pyproject.toml`` (PEP 639
license field, setuptools < 77): compiles the same sources with the same flags
as ``setup.py`` through ``torch.utils.cpp_extension.load`` and copies the
library to ``vllm_kvplugin/_C<EXT_SUFFIX>``.  The normal build is
``KVPLUGIN_BUILD_CUDA=1 python setup.py build_ext --inplace``.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

from torch.utils import cpp_extension as ce

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0;10.0+PTX")
    build = ROOT / "build" / "jit"
    build.mkdir(parents=True, exist_ok=True)
    ce.load(
        name="_C",
        sources=[str(ROOT / "csrc" / f) for f in ("kvplugin_ops.cpp", "digests.cpp", "cuda/kvplugin_cuda.cu",
                                                  "cuda/kvplugin_cuda_ops.cpp", "cuda/digests.cu")],
        extra_cflags=["-O3", "-std=c++17", "-DKVPLUGIN_WITH_CUDA"],
        extra_cuda_cflags=["-O3", "-std=c++17", "-DKVPLUGIN_WITH_CUDA", "--use_fast_math", "-lineinfo"],
        build_directory=str(build),
        is_python_module=False,
        verbose=True,
    )
    target = ROOT / "vllm_kvplugin" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    shutil.copy2(build / "_C.so", target)
    print(f"built {target}")


if __name__ == "__main__":
    main()
