"""A pipelined step's time on GPUs as jshard's executor runs it (`parallel.pipelining`).

The executor is one SPMD program: every stage starts each tick of the schedule's table
(`Schedule.table()`) together, runs its own action (a forward, a backward, B or W of one
micro-batch through one chunk, or nothing), and the sends at the tick's end wait for every
stage. So a tick lasts as long as its slowest stage's action, and the step is the sum over
ticks of that, not the (p-1)/(m+p-1) bubble of stages that each run their actions back to back
(Megatron's, one process a stage). Under 1F1B a steady-state tick pairs one stage's forward with
another's backward, which is twice as long: the lockstep step tends to 4/3 of the back-to-back one
as m grows; GPipe's ticks run one kind of action each and lose nothing to it (docs/planning.md).

Each action is costed for its own stage (`action_terms`): its chunk's layers
(`parallel.schedules.stage_layers`, uneven where the stages do not divide the layers), the head
and the loss on the last position, the forward again where the stage recomputes it
(`stage_remat="full"`: once for BW, once for each of ZB-H1's B and W), and what the executor does
on every backward (`accumulate_bytes`): each micro-batch's gradients added into the step's
accumulator, its chunk's rows of the layer stack and, at the first and last positions, the
embedding, head and norms, and the buffers it moves on every action (`EXECUTOR_BYTES`): the
residuals a forward keeps written into their slot (every segment's: a stage not last writes
zeros into the head's) and read back, the chunk's weights sliced out of the stack, their
gradients stacked. Each tick also runs its loop iteration and the sends its row makes, which the
compiled program runs synchronously at the tick's end (none of its permutes overlapped:
docs/planning.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jshard.parallel.pipelining import SEND_SCOPES
from jshard.parallel.schedules import Schedule
from jshard.parallel.step_plan import Plan
from jshard.planner import physics
from jshard.planner.memory import (ACTIVATIONS, activation_bytes_per_token_layer, crossover_bytes_per_token_layer,
                                   stack_bytes)
from jshard.planner.planned_step import PlannedStep, cached_program, local

# What the executor moves through HBM beyond the layers' own work, per action, in bytes per byte
# of what one micro-batch's chunk keeps for its backward (its layers' residuals: `memory`'s
# activations per token and layer), of the head's residual slot (its logits), and of the chunk's
# weights. A forward: the residuals stacked by the layers' scan, copied and written into their
# slot, the head's slot likewise (zeros at a position that is not the last), the weights sliced
# out of the stack (XLA materialises the slices). A backward: the residuals read back, the weights
# sliced again, their gradients stacked (zeros, then each layer's written) for the sums. Fitted by
# least squares to the compiled programs of docs/results/compile-pipelines-lockstep-h100x8-jax0.12.
# 0.1-2026-12-01.json that keep their residuals (compiled for H100s by `jshard compile`, timed
# along their schedules by `planner.schedule`, less the layers' own work and the gradient sums:
# Llama 3.2 1B, 3.1 8B and a GPT; 1F1B, GPipe, ZB-H1, interleaved, TP; 1 to 5 layers a stage, 2048
# to 8192 tokens a micro-batch): every forward; the backwards of those not under full remat (whose
# layers' own backward the plan over-reads: docs/planning.md). ZB-H1's B reads the residuals back,
# its W stacks the weights' gradients; a stage that recomputes its chunk keeps nothing forward
# (its weights only, there and again in each backward action).
LOOKED_UP = ("token_embed", "pos_embed")  # the decoders' `nn.Embed` tables (their paths)
EXECUTOR_BYTES = dict(forward=dict(kept=5.87, head=3.08, weights=2.1), backward=dict(kept=5.62, weights=10.71))


def accumulate_bytes(step: Plan) -> tuple[int, int]:
    """What one backward's gradients cost the executor's accumulator (`pipelining._execute`'s
    carry), the sum read and written in the accumulation dtype (the param's, widened to the
    reduction's) and the gradient read in the param's dtype: (the layer stack's, its chunk's
    rows of it: all of them, or under interleaving its slice, where the stack's rows are split
    over the stage axis alone; every other param's, which only the first and last positions add)."""
    stack = others = 0
    for p in step.params:
        wide = np.promote_types(p.held, p.reduce).itemsize
        nbytes = local(p.elements * (2 * wide + p.held.itemsize), p.param, step.mesh_sizes)
        if not p.stacked:
            others += nbytes
        elif p.param[0] == (step.stage_axis,):
            stack += nbytes // step.schedule.virtual
        else:
            stack += nbytes
    return stack, others


class Moved(NamedTuple):
    """What one micro-batch's chunk moves beside its layers' work, in bytes (`moved_bytes`)."""

    kept: float  # what its layers keep for the backward
    head: float  # the head's residual slot (its logits)
    weights: float  # the chunk's weights
    crossover: float = 0.0  # what ZB-H1's B hands its W
    tables: float = 0.0  # the looked-up tables (token and position embeddings), whose gradient the first position makes


def moved_bytes(planned: PlannedStep) -> Moved:
    """`Moved` of the planned step's chunk: its layers' kept residuals (`memory`'s activations per
    token and layer, over the chunk's rows of layers), the head's slot (its logits, in the compute
    dtype), the chunk's weights, what B hands W where the backward is split
    (`memory.crossover_bytes_per_token_layer`), the embedding tables (`nn.Embed`'s)."""
    config, step, sizes = planned.config, planned.step, planned.sizes
    tokens, tensor, sp = planned.rows * planned.local_seq, planned.tensor, step.sequence_parallel
    rows = tokens * step.layer_slots
    kept = activation_bytes_per_token_layer(config, tensor, sp, planned.flash, ACTIVATIONS[planned.hw.platform])
    split = step.schedule.backward == "B"
    return Moved(kept=rows * kept, head=tokens * config.vocab / tensor * jnp.dtype(config.dtype).itemsize,
                 weights=stack_bytes(step) / step.schedule.virtual,
                 crossover=rows * crossover_bytes_per_token_layer(config, tensor, sp) if split else 0.0,
                 tables=sum(local(p.bytes, p.param, sizes) for p in step.params if p.path.startswith(LOOKED_UP)))


@dataclasses.dataclass(frozen=True)
class Lockstep:
    """One pass through a schedule's tick table, in seconds."""

    seconds: float  # Σ over ticks of the slowest stage's action, the tick's loop iteration and its sends
    busy: tuple[float, ...]  # each stage's own actions (and their share of the sends), in all
    terms: dict[str, float]  # the mean stage's by term (`timing.TERMS` and the executor's three)
    ticks: int

    @property
    def bubble(self) -> float:
        """The share of the pass the mean stage is idle: the schedule's bubble and the ticks its
        action is shorter than the slowest one."""
        return 1 - sum(self.busy) / len(self.busy) / self.seconds if self.seconds else 0.0


def executor_bytes(kind: str, moved: Moved, recompute: bool = False, first: bool = False) -> float:
    """The HBM traffic one action of `kind` adds to a chunk's work (`EXECUTOR_BYTES`, of `moved`):
    a forward writes what its layers keep and the head's slot, a backward reads them back; each
    slices the chunk's weights, a backward stacks their gradients; ZB-H1's B writes what it hands
    W as a forward writes, W reads it back as a backward reads; where the stage recomputes its
    forward for each backward, the forward keeps nothing and each backward slices the weights
    again; at the `first` position the backward that makes the weights' gradients also makes the
    looked-up tables' (zeros written, the rows added in: read and written again)."""
    forward, backward = EXECUTOR_BYTES["forward"], EXECUTOR_BYTES["backward"]
    if kind == "F":
        kept = 0.0 if recompute else forward["kept"] * moved.kept + forward["head"] * moved.head
        return forward["weights"] * moved.weights + kept
    traffic = forward["weights"] * moved.weights if recompute else 0.0
    if kind in ("B", "BW"):
        traffic += backward["kept"] * moved.kept
    if kind in ("W", "BW"):
        traffic += backward["weights"] * moved.weights + (2 * moved.tables if first else 0.0)
    if kind == "B":
        traffic += forward["kept"] * moved.crossover
    if kind == "W":
        traffic += backward["kept"] * moved.crossover
    return traffic


def action_terms(kind: str, chunk: dict, head: dict | None, recompute: bool, accumulate_s: float,
                 executor_s: float = 0.0) -> dict[str, float]:
    """One action's seconds by term: `chunk` and `head` (`timing.phase_terms`' pieces of this
    chunk's layers, and of the head where the chunk is the last) by phase; F a forward, B and W
    backward's parts (ZB-H1), BW both; `recompute`: the stage recomputes its forward for each
    backward action; each action that finishes the weights' gradients adds them up
    (`accumulate_s`, what its position adds); each moves the executor's buffers (`executor_s`)."""
    phases = {"F": ("F",), "B": ("B",), "W": ("W",), "BW": ("B", "W")}[kind]
    if recompute and kind != "F":
        phases = ("F",) + phases
    pieces = (chunk,) + ((head,) if head else ())
    terms = {term: sum(piece[phase][term] for piece in pieces for phase in phases) for term in chunk["F"]}
    terms["gradient_sums"] = accumulate_s if kind in ("BW", "W") else 0.0
    terms["pipeline_buffers"] = executor_s
    return terms


def lockstep(schedule: Schedule, stage_layers: tuple[int, ...], stage_remat: str, pieces,
             accumulate_s: tuple[float, float], send_s: float, hw, scale: float = 1.0,
             moved: Moved = Moved(0.0, 0.0, 0.0)) -> Lockstep:
    """The tick table summed as the executor runs it. `pieces(layers)`: `timing.phase_terms` of a
    chunk of that many layers (its "layers" and "head" pieces); `accumulate_s`: a backward's
    gradient sums (`accumulate_bytes` at the streaming bandwidth: the stack's, and the others'
    at the first and last positions); `send_s`: one send; `scale`:
    each action stretched by the collectives it waits on (TP's, EP's: on its critical path);
    `moved`: what a chunk's actions move beside its layers' work (`moved_bytes`)."""
    p, v = schedule.stages, schedule.virtual
    program = cached_program(schedule, stage_remat)
    recompute = stage_remat == "full"

    @functools.cache
    def cost(kind: str, virtual: int, stage: int) -> dict[str, float]:
        position = virtual * p + stage
        chunk = pieces(stage_layers[position])
        last = position == p * v - 1
        summed = accumulate_s[0] + (accumulate_s[1] if last or position == 0 else 0.0)
        return action_terms(kind, chunk["layers"], chunk["head"] if last else None, recompute, summed,
                            executor_bytes(kind, moved, recompute, first=position == 0) / hw.stream_bw)

    seconds, busy, terms = 0.0, [0.0] * p, {}
    for tick, row in enumerate(schedule.table()):
        sends = send_s * sum(bool(getattr(program, flag)[tick]) for flag in SEND_SCOPES)
        slowest = 0.0
        for stage, action in enumerate(row):
            if action is None:
                continue
            spent = cost(action.kind, action.virtual, stage)
            took = scale * sum(spent.values())
            busy[stage] += took
            slowest = max(slowest, took)
            for term, s in spent.items():
                terms[term] = terms.get(term, 0.0) + scale * s / p
        seconds += slowest + sends + physics.loop_seconds(1, hw)
        busy = [b + sends for b in busy]
        terms["pipeline_sends"] = terms.get("pipeline_sends", 0.0) + sends
    return Lockstep(seconds, tuple(busy), terms, schedule.ticks)
