"""Training steps whose collectives are explicit and derived from the rules."""

from jshard.parallel.step import ShardedStep, TrainState, build_step, check_plan, stage_axes

__all__ = ["ShardedStep", "TrainState", "build_step", "check_plan", "stage_axes"]
