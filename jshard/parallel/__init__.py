"""Training steps: collectives explicit and derived from the rules (`step.py`), or placed by
XLA's partitioner under the same layouts (`compiled.py`)."""

from jshard.parallel.compiled import CompiledStep
from jshard.parallel.step import ShardedStep, TrainState, build_step, check_strategy, stage_axes

__all__ = ["CompiledStep", "ShardedStep", "TrainState", "build_step", "check_strategy", "stage_axes"]
