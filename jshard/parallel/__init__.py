"""Training steps: collectives explicit and derived from the rules (`step.py`), or placed by
XLA's partitioner under the same layouts (`compiled.py`); both read one `Plan` (`plan.py`)."""

from jshard.parallel.compiled import CompiledStep
from jshard.parallel.plan import Plan, make_plan
from jshard.parallel.state import TrainState, abstract_batch
from jshard.parallel.step import ShardedStep, build_step

__all__ = ["CompiledStep", "Plan", "ShardedStep", "TrainState", "abstract_batch", "build_step", "make_plan"]
