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
embedding, head and norms, and the
buffers it moves on every action (`EXECUTOR_BYTES`): the residuals a forward keeps written into
their slot (every segment's: a stage not last writes zeros into the head's) and read back, the
chunk's weights sliced out of the stack. Each tick also runs its loop iteration and the sends its
row makes, which the compiled program runs synchronously at the tick's end (none of its permutes
overlapped: docs/planning.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from jshard.parallel.pipelining import SEND_SCOPES
from jshard.parallel.schedules import Schedule
from jshard.parallel.step_plan import Plan
from jshard.planner import physics
from jshard.planner.memory import ACTIVATIONS, activation_bytes_per_token_layer
from jshard.planner.planned_step import PlannedStep, cached_program, local

# What the executor moves through HBM beyond the layers' own work, per action, in bytes per byte
# of what one micro-batch's chunk keeps for its backward (its layers' residuals: `memory`'s
# activations per token and layer), of the head's residual slot (its logits), and of the chunk's
# weights: the residuals stacked by the layers' scan, zeroed, copied and written into their slot
# (a select reading the slot back), the head's slot likewise, the weights sliced out of the stack
# (XLA materialises the slices). Fitted by least squares to the forwards of the 11 pipelined
# programs that keep their residuals in docs/results/compile-pipelines-lockstep-h100x8-jax0.12.0.1-
# 2026-12-01.json (compiled for H100s by `jshard compile`, timed along their schedules by
# `planner.schedule`, less the layers' own work and the gradient sums: Llama 3.2 1B, 3.1 8B and a
# GPT; 1F1B, GPipe, ZB-H1, interleaved, TP; 1 to 5 layers a stage, 2048 to 8192 tokens a
# micro-batch, remat none and full; docs/planning.md), and charged to every action of a chunk (a
# backward reads back what its forward wrote: not fitted); a stage that recomputes its chunk keeps
# nothing forward, its weights only.
EXECUTOR_BYTES = dict(kept=7.31, head=3.65, weights=2.54)


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


def moved_bytes(planned: PlannedStep) -> tuple[float, float, float]:
    """What `executor_bytes` counts of one micro-batch's chunk: the bytes its layers keep for the
    backward (`memory`'s activations per token and layer, over the chunk's rows of layers), the
    head's residual slot (its logits, in the compute dtype) and the chunk's weights."""
    config, step, tokens = planned.config, planned.step, planned.rows * planned.local_seq
    per_layer = activation_bytes_per_token_layer(config, planned.tensor, step.sequence_parallel, planned.flash,
                                                 ACTIVATIONS[planned.hw.platform])
    head = tokens * config.vocab / planned.tensor * jnp.dtype(config.dtype).itemsize
    weights = sum(local(p.bytes, p.param, planned.sizes) for p in step.params if p.stacked)
    return tokens * step.layer_slots * per_layer, head, weights / step.schedule.virtual


@dataclasses.dataclass(frozen=True)
class Lockstep:
    """One pass through a schedule's tick table, in seconds."""

    seconds: float  # Σ over ticks of the slowest stage's action, the tick's loop iteration and its sends
    busy: tuple[float, ...]  # each stage's own actions (and their share of the sends), in all
    terms: dict[str, float]  # the mean stage's by term (`timing.TERMS`, gradient_sums, pipeline_buffers, _sends)
    ticks: int

    @property
    def bubble(self) -> float:
        """The share of the pass the mean stage is idle: the schedule's bubble and the ticks its
        action is shorter than the slowest one."""
        return 1 - sum(self.busy) / len(self.busy) / self.seconds if self.seconds else 0.0


def executor_bytes(kept: float, head: float, weights: float, recomputing_forward: bool = False) -> float:
    """The HBM traffic one action of a chunk adds (`EXECUTOR_BYTES`): `kept`, the bytes its layers
    keep for a micro-batch's backward; `head`, the head's residual slot; `weights`, the chunk's."""
    if recomputing_forward:  # (keeps nothing: its backward runs the forward again)
        kept = head = 0.0
    return EXECUTOR_BYTES["kept"] * kept + EXECUTOR_BYTES["head"] * head + EXECUTOR_BYTES["weights"] * weights


def action_terms(kind: str, chunk: dict, head: dict | None, recompute: bool, accumulate_s: float,
                 executor_s: float = 0.0, forward_executor_s: float = 0.0) -> dict[str, float]:
    """One action's seconds by term: `chunk` and `head` (`timing.phase_terms`' pieces of this
    chunk's layers, and of the head where the chunk is the last) by phase; F a forward, B and W
    backward's parts (ZB-H1), BW both; `recompute`: the stage recomputes its forward for each
    backward action; each action that finishes the weights' gradients adds them up
    (`accumulate_s`, what its position adds); each moves the executor's buffers (`executor_s`; a
    recomputing stage's forward `forward_executor_s`)."""
    phases = {"F": ("F",), "B": ("B",), "W": ("W",), "BW": ("B", "W")}[kind]
    if recompute and kind != "F":
        phases = ("F",) + phases
    pieces = (chunk,) + ((head,) if head else ())
    terms = {term: sum(piece[phase][term] for piece in pieces for phase in phases) for term in chunk["F"]}
    terms["gradient_sums"] = accumulate_s if kind in ("BW", "W") else 0.0
    terms["pipeline_buffers"] = forward_executor_s if recompute and kind == "F" else executor_s
    return terms


def lockstep(schedule: Schedule, stage_layers: tuple[int, ...], stage_remat: str, pieces,
             accumulate_s: tuple[float, float], send_s: float, hw, scale: float = 1.0,
             moved: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> Lockstep:
    """The tick table summed as the executor runs it. `pieces(layers)`: `timing.phase_terms` of a
    chunk of that many layers (its "layers" and "head" pieces); `accumulate_s`: a backward's
    gradient sums (`accumulate_bytes` at the streaming bandwidth: the stack's, and the others'
    at the first and last positions); `send_s`: one send; `scale`:
    each action stretched by the collectives it waits on (TP's, EP's: on its critical path);
    `moved`: what a chunk's actions move (`executor_bytes`' kept, head and weights bytes)."""
    p, v = schedule.stages, schedule.virtual
    program = cached_program(schedule, stage_remat)
    recompute = stage_remat == "full"
    executor_s = executor_bytes(*moved) / hw.stream_bw
    forward_executor_s = executor_bytes(*moved, recomputing_forward=True) / hw.stream_bw

    @functools.cache
    def cost(kind: str, virtual: int, stage: int) -> dict[str, float]:
        position = virtual * p + stage
        chunk = pieces(stage_layers[position])
        last = position == p * v - 1
        summed = accumulate_s[0] + (accumulate_s[1] if last or position == 0 else 0.0)
        return action_terms(kind, chunk["layers"], chunk["head"] if last else None, recompute, summed,
                            executor_s, forward_executor_s)

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
