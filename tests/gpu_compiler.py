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


def scatter_before_the_last_loop(hlo_text: str, shapes: tuple[str, ...]) -> tuple[str, bool]:
    """In the entry of a scheduled GPU program, the one reduce-scatter of a buffer of one of
    `shapes` (e.g. "bf16[512,128256]"; alone or combined with others) and whether it is done
    before the entry's last loop (the layers' backward): an output head's weight gradient, ordered
    first (`Plan.head_backward_first`)."""
    lines = hlo_text[hlo_text.index("ENTRY "):].splitlines()
    starts = [line.split(" = ")[0].split("%")[-1] for line in lines
              if " reduce-scatter-start(" in line and any(s + "{" in line.split(" reduce-scatter")[0] for s in shapes)]
    assert len(starts) == 1, starts
    done = next(i for i, line in enumerate(lines) if f"reduce-scatter-done(%{starts[0]})" in line)
    return starts[0], done < max(i for i, line in enumerate(lines) if " while(" in line)
