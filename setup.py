"""Builds lbcomm._C against the torch that is already installed.

Run `pip install --no-build-isolation .`: build isolation would fetch another torch.
Environment switches:
  LBCOMM_CUDA=0|1   force the CUDA kernels off/on (default: on when torch has CUDA and
                    CUDA_HOME is set, never based on whether a GPU is visible)
  LBCOMM_DEBUG=1    build with -O0 -g
"""
import glob
import os
import sys

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:  # pragma: no cover - exercised only on a broken install
    sys.exit(
        "lbcomm: torch must be installed before building lbcomm, and the build must see it.\n"
        "  pip install torch && pip install --no-build-isolation ."
    )

here = os.path.dirname(os.path.abspath(__file__))
debug = os.environ.get("LBCOMM_DEBUG", "0") == "1"
want_cuda = os.environ.get("LBCOMM_CUDA")
use_cuda = (torch.version.cuda is not None and CUDA_HOME is not None) if want_cuda is None else want_cuda == "1"

sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
cxx = ["-O0", "-g"] if debug else ["-O3", "-fno-math-errno"]
# The error-feedback invariant and the reference comparison need the same rounding as the
# plain torch ops, so no fused multiply-adds except where the kernels ask for them.
cxx += ["-ffp-contract=off", "-DPy_LIMITED_API=0x030A0000"]
# at::parallel_for is inline OpenMP in torch's headers: without -fopenmp it silently runs
# serially. The libgomp.so.1 it links resolves to the copy torch has already loaded.
link = []
if sys.platform.startswith("linux") and "OpenMP" in torch.__config__.parallel_info():
    cxx.append("-fopenmp")
    link.append("-fopenmp")
extra = {"cxx": cxx}
ext_cls = CppExtension
if use_cuda:
    sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")) + glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
    extra["nvcc"] = ["-O3", "--fmad=false", "-lineinfo"]
    ext_cls = CUDAExtension

setup(
    ext_modules=[
        ext_cls(
            "lbcomm._C",
            sources,
            include_dirs=[os.path.join(here, "csrc")],
            extra_compile_args=extra,
            extra_link_args=link,
            define_macros=[("LBCOMM_WITH_CUDA", "1")] if use_cuda else [],
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
