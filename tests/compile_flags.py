"""The XLA flags the suite compiles with (tests/conftest.py sets them before JAX starts), and a
process environment without them, for a test that runs jshard as a user does.

The suite compiles far more than it runs, and its tests read XLA:CPU's results, HLO, buffers and
collectives, never its machine code. So it compiles with LLVM's optimisation off, and where the
JAX release still has them (0.10), with XLA:CPU's loop emitters in place of its MLIR fusion
emitters, which took 2-7x longer to emit the same fusions (a ZeRO-3 GPT step: 3.5 s -> 1.3 s;
a MoE pipeline test 77 s -> 12 s). The emitters' buffers differ by a fraction of a percent and
FP8's rounding a little (the 100-step FP8 run's last losses 6.1% from bf16's, not 5.1%): every
parity test holds the numbers, and the FP8 run runs without these flags.
"""

import os

import jax

CPU_COMPILE_FLAGS = ["--xla_backend_optimization_level=0"] + (
    ["--xla_cpu_use_fusion_emitters=false"] if jax.__version_info__ < (0, 11) else [])


def users_environment() -> dict[str, str]:
    """This process's environment with XLA_FLAGS as a user's would be: the suite's own left out."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in CPU_COMPILE_FLAGS]
    return dict(os.environ, XLA_FLAGS=" ".join(flags))
