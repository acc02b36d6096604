"""The step the planner estimates, built without devices: its plan from abstract shapes on the
layout's abstract mesh (`step_plan`, kept for a search), its schedule's executor program, how a
layout splits bytes over the mesh (`shards`, `local`), and `PlannedStep`: what the estimates of
memory, communication and time share of one device's work.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from flax import nnx

from jshard.layout import Layout
from jshard.models import DecoderConfig, decoder
from jshard.nn.step_context import compute_dtype
from jshard.parallel.tick_program import compile_program
from jshard.parallel.step_plan import Plan, make_plan
from jshard.planner.hardware import Hardware


def step_plan(config: DecoderConfig, layout: Layout) -> Plan:
    """The decoder's step plan, the step's own (`parallel.plan.make_plan`, with its checks), from
    abstract shapes on an abstract mesh (the layout's): no memory is allocated, no device is needed."""
    return make_plan(_abstract_decoder(config), layout)


@functools.cache
def _abstract_decoder(config: DecoderConfig):
    return nnx.eval_shape(lambda: decoder(config, nnx.Rngs(0)))


# A schedule's executor program is a pure function of the (frozen) schedule: kept for a search.
cached_program = functools.cache(compile_program)


@functools.cache
def cached_step_plan(config: DecoderConfig, layout: Layout) -> Plan:
    """`step_plan`, kept: a search estimates one plan under many batch and remat choices, which
    the plan does not depend on (the params and their layouts do not change)."""
    return step_plan(config, layout)


def shards(layout, sizes: dict[str, int], skip=frozenset()) -> int:
    return math.prod(sizes[a] for axes in layout for a in axes if a not in skip)


def local(nbytes: int, layout, sizes: dict[str, int]) -> int:
    return nbytes // shards(layout, sizes)


def stage_layers_run(config: DecoderConfig, plan: Plan) -> int:
    """The layers the busiest stage runs: all of them unpipelined, else the most any device's
    chunks hold (`Plan.stage_layers`, uneven where the stages do not divide the layers; chunk
    k = c·p + d is device d's); it sets a pipelined step's pace."""
    if not plan.stage_layers:
        return config.layers
    stages = plan.mesh_sizes[plan.stage_axis]
    return max(sum(plan.stage_layers[d::stages]) for d in range(stages))


def computed(config: DecoderConfig, plan: Plan) -> DecoderConfig:
    """`config` with the dtype its layers compute in under `plan`'s step (`nn.compute_dtype`):
    its own, else the step's precision's. The planner's formulas read `config.dtype` as that."""
    return dataclasses.replace(config, dtype=compute_dtype(config.dtype, plan.compute))


@dataclasses.dataclass(frozen=True)
class PlannedStep:
    """The step being estimated and what it fixes of one device's work: what `memory_per_device`,
    `communication` and `step_time` read (`estimate.planned_step` makes it from a `PlanInput`)."""

    config: DecoderConfig  # the model as its layers compute it (`computed`)
    hw: Hardware
    step: Plan  # the step's plan (`step_plan`)
    sizes: dict[str, int]  # the mesh
    rows: int  # rows per micro-batch on a device
    microbatches: int  # per pass: the pipeline's (1 without one)
    grad_accum: int  # passes a step
    local_seq: int  # the tokens of one sequence on a device (context parallelism splits it)
    tensor: int  # devices over the tensor axes
    layers_local: int  # the layers the busiest stage runs (`stage_layers_run`)
    attention: str  # the attention's kernel (`nn.attention_implementation`), or context parallelism's
    flash: bool  # attention keeps no (seq × seq) scores
    fused: bool  # attention's core is a flash kernel (cuDNN's, or jshard's Pallas kernel): no scores in HBM
