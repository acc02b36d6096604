"""Pipeline parallelism inside the step: a schedule's tick table, run as one SPMD program.

The stacked `layers` are split over the stage axis; each device holds v chunks of them
(chunk c on device d is pipeline position c·p + d). `schedules.py` says what every device
does at every tick: forward F, full backward BW, or the zero-bubble split into B (input
gradient) and W (weight gradient). `compile_program` turns that table into integers, and
`value_and_grad` executes them in a `lax.scan` over ticks. Each tick, on every device:

    1. read this tick's action: which branch, micro-batch, chunk and buffer slots
    2. `lax.switch` to that branch: it runs the chunk forward, or recomputes the forward
       under `jax.vjp` and pulls back the output gradient; weight gradients add up in place
    3. `ppermute` the forward output to the next position and the input gradient to the
       previous one (all devices run the same ppermutes, so none can deadlock; a tick in
       which nobody sends skips them)
    4. store what arrived in the slots the table assigned

A micro-batch's stage input waits in an activation slot from its arrival until its last
backward (BW, or W); its output gradient waits in a gradient slot. Slots are assigned in
Python from the table, so the buffers hold as many micro-batches as the schedule keeps in
flight: m for GPipe, p for 1F1B on the first stage. What a slot holds is the stage's
input, not every activation inside it: the backward recomputes the chunk's forward (stage
rematerialisation, one extra forward per backward) so that buffer memory is exactly
peak-in-flight × one activation.

The loss is a `StagedLoss`: its `first` part (embeddings) runs at position 0, its `last`
part (head and loss) at the last position, inside the same branches as the chunk there.
Collectives inside a branch (FSDP gathers, TP reductions) only ever group devices of one
stage, which all take the same branch. Params used on every stage are made stage-varying
before the scan so that no branch needs a collective over the stage axis; their gradients
are summed over it once, at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jshard import vma
from jshard.models.stack import StagedLoss, scan_layers
from jshard.parallel.schedules import Schedule

ROLES = ("first", "middle", "last")  # where in the pipeline a chunk is: position 0, between, p·v - 1
BRANCHES = [("idle", "middle")] + [(kind, role) for kind in ("F", "BW", "B", "W") for role in ROLES]


@dataclasses.dataclass(frozen=True)
class Program:
    """A schedule as arrays the scan reads one row of per tick; [tick, stage] unless noted."""

    branch: np.ndarray  # index into BRANCHES
    microbatch: np.ndarray
    chunk: np.ndarray
    act_slot: np.ndarray  # the activation slot the action reads (its stage input)
    grad_slot: np.ndarray  # the gradient slot it reads (its output's gradient)
    act_arrival: np.ndarray  # where the activation arriving at the end of the tick goes
    grad_arrival: np.ndarray
    sends_forward: np.ndarray  # [tick]: whether any device sends an activation
    sends_backward: np.ndarray  # [tick]: whether any device sends a gradient
    act_slots: int  # the last index of each buffer (= the count) is a slot nobody reads
    grad_slots: int


def _role(position: int, positions: int) -> str:
    return "first" if position == 0 else "last" if position == positions - 1 else "middle"


def _assign_slots(lifetimes: dict, stages: int) -> tuple[dict, int]:
    """Slots for values that live from the end of tick `start` to tick `end` on `stage`.

    A value read for the last time at tick t frees its slot for one arriving at the end of t.
    """
    slot_of, count = {}, 0
    for stage in range(stages):
        free_at: list[int] = []  # per slot, the last tick it is read
        for key, (start, end) in sorted(((k, v) for k, v in lifetimes.items() if k[0] == stage), key=lambda kv: kv[1]):
            slot = next((s for s, last in enumerate(free_at) if last <= start), len(free_at))
            free_at[slot:slot + 1] = [end]
            slot_of[key] = slot
        count = max(count, len(free_at))
    return slot_of, count


def compile_program(schedule: Schedule) -> Program:
    """Which branch, micro-batch, chunk and buffer slots every device uses at every tick."""
    p, v, table = schedule.stages, schedule.virtual, schedule.table()
    positions, ticks = p * v, len(table)
    done = {}  # (kind, micro-batch, position) -> tick
    for tick, row in enumerate(table):
        for stage, action in enumerate(row):
            if action is not None:
                done[schedule.work(action, stage)] = tick
    last_read = {}  # (micro-batch, position) -> the last tick its stage input or output gradient is read
    for (kind, i, k), tick in done.items():
        if kind != "F":
            last_read[i, k] = max(last_read.get((i, k), -1), tick)
    # Stage inputs arrive from F at k-1, output gradients from the backward at k+1.
    acts = {(k % p, i, k): (done["F", i, k - 1], last_read[i, k]) for i in range(schedule.microbatches) for k in range(1, positions)}
    grads = {(k % p, i, k): (done[schedule.backward, i, k + 1], last_read[i, k])
             for i in range(schedule.microbatches) for k in range(positions - 1)}
    act_slot_of, act_slots = _assign_slots(acts, p)
    grad_slot_of, grad_slots = _assign_slots(grads, p)

    shape = (ticks, p)
    arrays = {name: np.zeros(shape, np.int32) for name in ("branch", "microbatch", "chunk")}
    arrays |= {name: np.full(shape, act_slots, np.int32) for name in ("act_slot", "act_arrival")}
    arrays |= {name: np.full(shape, grad_slots, np.int32) for name in ("grad_slot", "grad_arrival")}
    for tick, row in enumerate(table):
        for stage, action in enumerate(row):
            if action is None:
                continue
            kind, i, k = schedule.work(action, stage)
            arrays["branch"][tick, stage] = BRANCHES.index((kind, _role(k, positions)))
            arrays["microbatch"][tick, stage], arrays["chunk"][tick, stage] = i, action.virtual
            arrays["act_slot"][tick, stage] = act_slot_of.get((stage, i, k), act_slots)
            arrays["grad_slot"][tick, stage] = grad_slot_of.get((stage, i, k), grad_slots)
    for (stage, i, k), (start, _) in acts.items():
        arrays["act_arrival"][start, stage] = act_slot_of[stage, i, k]
    for (stage, i, k), (start, _) in grads.items():
        arrays["grad_arrival"][start, stage] = grad_slot_of[stage, i, k]
    # A tick sends when something arrives at its end.
    return Program(**arrays, sends_forward=(arrays["act_arrival"] != act_slots).any(axis=1),
                   sends_backward=(arrays["grad_arrival"] != grad_slots).any(axis=1),
                   act_slots=act_slots, grad_slots=grad_slots)


# --- the executor --------------------------------------------------------------------------------


def _zeros(abstract, axes):
    return vma.vary(jnp.zeros(abstract.shape, abstract.dtype), axes)


@dataclasses.dataclass(frozen=True)
class Stages:
    """What a chunk computes, from the differentiable params `diff`: the loss's `first` part
    at position 0, the chunk's layers, the `last` part at the end; each result typed varying
    over `act_axes` (an activation) or `loss_axes` (the loss), so every branch returns one type."""

    loss: StagedLoss
    model_of: Callable  # diff -> the model
    one_value: Callable  # a micro-batch's loss -> one value per batch shard
    virtual: int
    act_axes: frozenset = frozenset()
    loss_axes: frozenset = frozenset()

    def first(self, diff, mb):
        return vma.vary(self.loss.first(self.model_of(diff), mb), self.act_axes)

    def layers(self, diff, x, chunk):
        return vma.vary(scan_layers(self._chunk_of(self.model_of(diff), chunk), x), self.act_axes)

    def last(self, diff, y, mb):
        return self.one_value(self.loss.last(self.model_of(diff), y, mb))

    def forward(self, role, diff, x, mb, chunk):
        """What the chunk at this `role` computes: an activation, or at the end, the loss."""
        y = self.layers(diff, self.first(diff, mb) if role == "first" else x, chunk)
        return vma.vary(self.last(diff, y, mb), self.loss_axes) if role == "last" else y

    def _chunk_of(self, model, chunk):
        layers = self.loss.layers(model)
        if self.virtual == 1:
            return layers
        graphdef, state = nnx.split(layers)
        size = jax.tree.leaves(state)[0].shape[0] // self.virtual
        return nnx.merge(graphdef, jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, chunk * size, size), state))


def typed(stages: Stages, diff, mb, stage_axis: str) -> tuple[Stages, jax.ShapeDtypeStruct]:
    """`stages` with the varying axes of what travels between stages, and the loss's abstract
    value. The activation's type is a fixed point: a stage's output may vary over more axes
    than its input (found abstractly, no compute)."""
    stages = dataclasses.replace(stages, act_axes=frozenset({stage_axis}))
    while True:
        x = nnx.eval_shape(stages.first, diff, mb)
        grown = stages.act_axes | vma.varying_axes(x) | vma.varying_axes(nnx.eval_shape(stages.layers, diff, x, 0))
        if grown == stages.act_axes:
            break
        stages = dataclasses.replace(stages, act_axes=grown)
    loss_abstract = nnx.eval_shape(stages.last, diff, x, mb)
    return dataclasses.replace(stages, loss_axes=vma.varying_axes(loss_abstract) | {stage_axis}), loss_abstract


def branch(stages: Stages, kind: str, role: str, loss_abstract, microbatches: int) -> Callable:
    """One `lax.switch` branch: action `kind` (idle, F, BW, B, W) of the chunk at `role`.
    (diff, grads, loss_sum, x, g, mb, chunk) -> (grads, loss_sum, output, input gradient)."""

    def act(diff, grads, loss_sum, x, g, mb, chunk):
        zero = jnp.zeros_like(x)
        if kind == "idle":
            return grads, loss_sum, zero, zero
        if kind == "F":
            out = stages.forward(role, diff, x, mb, chunk)
            return (grads, loss_sum + out, zero, zero) if role == "last" else (grads, loss_sum, out, zero)
        if role == "last":  # the gradient of the mean over micro-batches
            g = vma.vary(jnp.full(loss_abstract.shape, 1 / microbatches, loss_abstract.dtype), stages.loss_axes)
        wrt_weights, wrt_input = kind in ("BW", "W"), kind in ("BW", "B") and role != "first"
        if not (wrt_weights or wrt_input):  # B at position 0: no input to pass a gradient to
            return grads, loss_sum, zero, zero
        # A stopped gradient is a symbolic zero: B computes no weight gradient, W no input one.
        weights_if = (lambda d: d) if wrt_weights else lambda d: jax.tree.map(lax.stop_gradient, d)
        input_if = (lambda x: x) if wrt_input else lax.stop_gradient
        _, pull = jax.vjp(lambda d, x: stages.forward(role, weights_if(d), input_if(x), mb, chunk), diff, x)
        weights, dx = pull(g)
        if wrt_weights:
            grads = jax.tree.map(jnp.add, grads, weights)
        return grads, loss_sum, zero, dx if wrt_input else zero

    return act


def value_and_grad(schedule: Schedule, loss: StagedLoss, model_of: Callable, diff, batch, stage_axis: str,
                   one_value: Callable[[jax.Array], jax.Array], accumulate=None):
    """The mean loss over this device's `batch` and its gradient with respect to `diff`.

    `model_of(diff)` builds the model from the differentiable params; `one_value` turns a
    micro-batch's loss into one value per batch shard (a pmean over the axes it is spread on).
    The micro-batches' gradients add up in `accumulate` where it is wider than a param's
    dtype (fp32 over bf16 params), else in the param's.
    """
    p, v, m = schedule.stages, schedule.virtual, schedule.microbatches
    program = compile_program(schedule)
    stage = lax.axis_index(stage_axis)
    micro = jax.tree.map(lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:]), batch)
    # Every param stage-varying: a branch's gradient then needs no psum over the stage axis.
    shared = jax.tree.map(lambda w: stage_axis not in vma.varying_axes(w), diff)
    diff = jax.tree.map(lambda w: vma.vary(w, (stage_axis,)), diff)

    def take(tree, index):
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False), tree)

    stages, loss_abstract = typed(Stages(loss, model_of, one_value, v), diff, take(micro, 0), stage_axis)
    branches = [branch(stages, kind, role, loss_abstract, m) for kind, role in BRANCHES]
    ring = v > 1  # chunks wrap around from the last device to the first
    forward_pairs = [(s, (s + 1) % p) for s in range(p if ring else p - 1)]
    backward_pairs = [((s + 1) % p, s) for s in range(p if ring else p - 1)]

    def send(when, x, pairs):
        return lax.cond(when, lambda x: lax.ppermute(x, stage_axis, pairs), jnp.zeros_like, x)

    def tick(carry, row):
        acts, grad_buf, grads, loss_sum = carry
        here = {name: row[name][stage] for name in ("branch", "microbatch", "chunk", "act_slot", "grad_slot",
                                                    "act_arrival", "grad_arrival")}
        grads, loss_sum, out, dx = lax.switch(
            here["branch"], branches, diff, grads, loss_sum, acts[here["act_slot"]], grad_buf[here["grad_slot"]],
            take(micro, here["microbatch"]), here["chunk"],
        )
        acts = acts.at[here["act_arrival"]].set(send(row["sends_forward"], out, forward_pairs))
        grad_buf = grad_buf.at[here["grad_arrival"]].set(send(row["sends_backward"], dx, backward_pairs))
        return (acts, grad_buf, grads, loss_sum), None

    rows = {field.name: getattr(program, field.name) for field in dataclasses.fields(Program)
            if isinstance(getattr(program, field.name), np.ndarray)}
    x = nnx.eval_shape(stages.first, diff, take(micro, 0))
    carry = (
        _zeros(jax.ShapeDtypeStruct((program.act_slots + 1, *x.shape), x.dtype), stages.act_axes),
        _zeros(jax.ShapeDtypeStruct((program.grad_slots + 1, *x.shape), x.dtype), stages.act_axes),
        jax.tree.map(lambda w: jnp.zeros_like(w, jnp.promote_types(w.dtype, accumulate or w.dtype)), diff),
        _zeros(loss_abstract, stages.loss_axes),
    )
    (_, _, grads, loss_sum), _ = lax.scan(tick, carry, rows)
    grads = jax.tree.map(lambda g, s: lax.psum(g, stage_axis) if s else g, grads, shared)
    return lax.psum(loss_sum, stage_axis) / m, grads


def interleave(x: jax.Array, stages: int, virtual: int, inverse: bool = False) -> jax.Array:
    """Stacked layers from model order to the order the interleaved pipeline stores them in
    (`inverse`: back). Model chunk k = c·p + d must sit on device d as its chunk c; a stage
    axis splits dim 0 in contiguous blocks, so block d holds chunks d, p + d, 2p + d, ..."""
    split = (stages, virtual) if inverse else (virtual, stages)
    return x.reshape(*split, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
