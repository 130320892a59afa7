"""Builds the optional kernels of kvplugin::gather / kvplugin::scatter.

The kernels are compiled against the torch found at build time, so they are
built only when torch is importable in the build environment, i.e. with
`pip install --no-build-isolation`.  Otherwise (or with KVPLUGIN_BUILD_OPS=0)
the package installs without them and the ops run on the pure-torch path;
`vllm-kvplugin info` says which one is active.  KVPLUGIN_BUILD_CUDA=0/1 forces
the CUDA kernel off/on (default: on when torch has CUDA, nvcc is found and a GPU
is visible).
"""

import os
import sys

from setuptools import setup


def _want(name: str, default: str = "auto") -> str:
    value = os.environ.get(name, default).strip().lower()
    if value not in ("0", "1", "auto"):
        sys.exit(f"{name} must be 0, 1 or auto, got {value!r}")
    return value


def _extensions():
    if _want("KVPLUGIN_BUILD_OPS") == "0":
        return [], {}
    try:
        import torch  # noqa: F401
        from torch.utils import cpp_extension as ce
    except ImportError:
        print("vllm-kvplugin: torch not importable at build time; building without kernels "
              "(install with --no-build-isolation next to vLLM to build them)")
        return [], {}
    sources = ["csrc/kvplugin_ops.cpp", "csrc/digests.cpp"]
    cxx = ["-O3", "-std=c++17"]
    want_cuda = _want("KVPLUGIN_BUILD_CUDA")
    has_cuda = torch.version.cuda is not None and ce.CUDA_HOME is not None
    if want_cuda == "1" and not has_cuda:
        sys.exit("KVPLUGIN_BUILD_CUDA=1 but torch has no CUDA or nvcc/CUDA_HOME was not found")
    if want_cuda == "auto" and has_cuda and not torch.cuda.is_available():
        print("vllm-kvplugin: no GPU visible; building the CPU kernel only "
              "(KVPLUGIN_BUILD_CUDA=1 builds the CUDA kernel anyway)")
        has_cuda = False
    if want_cuda != "0" and has_cuda:
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if not arch:
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0;10.0+PTX"
        ext = ce.CUDAExtension(
            "vllm_kvplugin._C",
            sources + ["csrc/cuda/kvplugin_cuda.cu", "csrc/cuda/kvplugin_cuda_ops.cpp", "csrc/cuda/digests.cu"],
            extra_compile_args={"cxx": cxx + ["-DKVPLUGIN_WITH_CUDA"],
                                "nvcc": ["-O3", "-std=c++17", "-DKVPLUGIN_WITH_CUDA",
                                         "--use_fast_math", "-lineinfo"]},
        )
    else:
        ext = ce.CppExtension("vllm_kvplugin._C", sources, extra_compile_args={"cxx": cxx})
    return [ext], {"build_ext": ce.BuildExtension}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
