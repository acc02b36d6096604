"""What the gpu_compile tier's files share: the tier's marks (skipped, with the reason, where XLA's
GPU compiler is not installed: `make venv GPU_COMPILE=1`; CI's newest-JAX pass has it) and the
mark of the tests that need cuDNN."""

import importlib.util

import pytest

from jshard import aot

GPU_COMPILE = [pytest.mark.gpu_compile,
               pytest.mark.skipif(aot.gpu_compiler_missing() is not None, reason=str(aot.gpu_compiler_missing()))]


def gpu_compile(test):
    """The tier's marks on one test of a file outside the tier."""
    for mark in GPU_COMPILE:
        test = mark(test)
    return test


def cudnn_installed() -> bool:
    return importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.cudnn") is not None


NEEDS_CUDNN = pytest.mark.skipif(not cudnn_installed(), reason="cuDNN is not installed (nvidia-cudnn-cu13)")
