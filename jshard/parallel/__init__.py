"""Training steps: collectives explicit and derived from the rules (`step.py`), or placed by
XLA's partitioner under the same layouts (`compiled.py`); both read one `Plan` (`plan.py`)."""

from jshard.parallel.compiled import CompiledStep
from jshard.parallel.step_plan import Plan, make_plan
from jshard.parallel.state import Summed, TrainState, abstract_batch, summed
from jshard.parallel.step import ShardedStep, build_step

__all__ = ["CompiledStep", "Plan", "ShardedStep", "Summed", "TrainState", "abstract_batch", "build_step", "make_plan",
           "summed"]
