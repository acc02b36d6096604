"""Benchmarks: `jshard bench <what>`, one module per benchmark.

Each module measures and prints its rows; `jshard.cli.bench` registers the sub-commands and
calls them with what the flags say.
"""

from jshard.bench import collective_bandwidth, schedule_costs, step_time, strategies

__all__ = ["collective_bandwidth", "schedule_costs", "step_time", "strategies"]
