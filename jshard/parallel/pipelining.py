"""Pipeline parallelism inside the step: a schedule's tick table, run as one SPMD program.

The stacked `layers` are split over the stage axis; each device holds v chunks of them
(chunk c on device d is pipeline position c·p + d). `schedules.py` says what every device
does at every tick: forward F, full backward BW, or the zero-bubble split into B (input
gradient) and W (weight gradient). `tick_program.py` turns that table into integers, and
`value_and_grad` executes them in a `lax.scan` over ticks. Each tick, on every device:

    1. read this tick's action: which kind (F, BW, B, W or none), at which position in the
       pipeline, on which micro-batch and chunk, with which buffer slots
    2. send, beside the compute, what the last tick produced and nobody reads before now
       (a "late" send; `ppermute`s run on every device, so none can deadlock)
    3. one `lax.cond` per kind, in an order that writes each buffer before it is read: F runs
       the chunk forward and keeps what its backward needs; B pulls the output gradient back
       to the input and hands W what it needs; W adds up the weight gradients (BW: B then W).
       Each updates its buffers, or the gradients, in place
    4. send the forward output to the next position and the input gradient to the previous
       one, unless they go late; store what arrived in the slots the table assigned

A chunk is three segments: the loss's `first` part (embeddings) at position 0, one segment
per layer, the loss's `last` part (head and loss) at the last position. F keeps each
segment's residuals, as `backward.keep` finds them (`stage_remat="none"`, the default): a
backward then costs what an unpipelined backward costs, for the memory of those residuals
per micro-batch in flight. `stage_remat="full"` keeps only the stage's input instead, and
each backward recomputes the chunk's forward first (Megatron's full recompute: a third more
work, one activation per micro-batch in flight). Either way B and W run the two halves of
each segment's backward (`backward.Backward`), so B + W computes what BW computes.

A buffer holds as many micro-batches as the schedule keeps in flight (its slots:
`tick_program.py`): m for GPipe, p for 1F1B on the first stage.

Layers that the chunks do not divide (`schedules.stage_layers`: 6 on 4 stages run 1, 2, 2, 1)
are held padded: `layer_slots` rows per chunk, its layers first, zeros after (`held_slots`).
A padding row is skipped: a `lax.cond` per row makes it the identity, with zero residuals, input
gradient passed through and zero weight gradient, so it costs no FLOPs and its params and
optimizer state stay zero.

Collectives inside an action (FSDP gathers, TP reductions) only ever group devices of one
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
from jshard.nn.losses import scaled_losses
from jshard.nn.params import gathers_weights, holds_replicas, remat_policy
from jshard.models.stack import StagedLoss, layer_call, scan_stack
from jshard.parallel import backward
from jshard.parallel.schedules import Schedule
from jshard.parallel.tick_program import KINDS, ROLES, SEGMENTS, compile_program, segments

PADDING_SCOPE = "layer_or_padding"  # the cond that skips a padding row of the layer stack
ENDS_SCOPE = "grads_at_the_ends"  # the cond that adds the params outside the stack at the first and last positions
# The tick row's flags, each naming the scope of the send (a cond around a ppermute) it decides.
SEND_SCOPES = ("sends_forward", "sends_backward", "late_forward", "late_backward")


# --- what a chunk computes ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Stages:
    """What a chunk computes, from the differentiable params `diff`: the loss's `first` part
    at position 0, the chunk's layers, the `last` part at the end; each result typed varying
    over `act_axes` (an activation) or `loss_axes` (the loss), so every branch returns one type.

    Each segment is a function of the leaves it computes with (the model's, or one layer's)
    and its input, so that `backward.keep` finds every weight among its arguments."""

    loss: StagedLoss
    model_of: Callable  # diff -> the model
    one_value: Callable  # a micro-batch's loss -> one value per batch shard
    virtual: int
    act_axes: frozenset = frozenset()
    loss_axes: frozenset = frozenset()
    layer_mask: np.ndarray | None = None  # [position, row]: which rows of each chunk hold a layer; None: all
    stage_axis: str | None = None  # (to find this device's position, with a `layer_mask`)

    def _layers_here(self, chunk):
        """Which rows of this device's `chunk` hold a layer (the rest is padding); None: all of them."""
        if self.layer_mask is None:
            return None
        stages = self.layer_mask.shape[0] // self.virtual
        return jnp.asarray(self.layer_mask)[chunk * stages + lax.axis_index(self.stage_axis)]

    def _first(self, model, mb):
        return vma.vary(self.loss.first(model, mb), self.act_axes)

    def _last(self, model, y, mb):
        return vma.vary(self.one_value(self.loss.last(model, y, mb)), self.loss_axes)

    def _chunk_of(self, model, chunk):
        layers = self.loss.layers(model)
        if self.virtual == 1:
            return layers
        graphdef, state = nnx.split(layers)
        size = jax.tree.leaves(state)[0].shape[0] // self.virtual
        return nnx.merge(graphdef, jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, chunk * size, size), state))

    def forward(self, role, diff, x, mb, chunk, keep: bool = False):
        """The chunk at this `role`: its output (an activation, or at the end, the loss) and,
        with `keep`, each segment's residuals and `Backward` ({} and {} without)."""
        model = self.model_of(diff)
        graphdef, state = nnx.split(model)
        leaves, tree = jax.tree.flatten(state)
        mb_leaves = jax.tree.leaves(mb)
        saved, backwards = {}, {}

        def run(segment, fn, inputs):
            if not keep:
                return fn(leaves, inputs)
            if gathers_weights() or holds_replicas():  # as the stack's layers: keep no gathered weight
                fn = jax.checkpoint(fn, policy=remat_policy)
            out, saved[segment], backwards[segment] = backward.keep(fn, leaves, inputs, mb_leaves)
            return out

        def merged(leaves):
            return nnx.merge(graphdef, tree.unflatten(leaves))

        if role == "first":
            x = run("first", lambda leaves, _: self._first(merged(leaves), mb), ())
        layers = self._chunk_of(model, chunk)
        apply = layer_call(layers)
        here = self._layers_here(chunk)

        def layer(x, module, *real):
            layer_graphdef, layer_state = nnx.split(module)
            layer_leaves, layer_tree = jax.tree.flatten(layer_state)

            def fn(layer_leaves, inputs):
                return apply(nnx.merge(layer_graphdef, layer_tree.unflatten(layer_leaves)), inputs[0])

            def run(x):
                if not keep:
                    return fn(layer_leaves, (x,)), None
                y, kept, backwards["layers"] = backward.keep(fn, layer_leaves, (x,))
                return y, kept

            return _unless_padding(real, run, lambda zeros, x: (x, zeros[1]), x)

        x, saved["layers"] = scan_stack(layers, x, layer, *_rows(here))
        if not keep:
            saved = {}
        if role == "last":
            x = run("last", lambda leaves, inputs: self._last(merged(leaves), inputs[0], mb), (x,))
        return x, saved, backwards

    def _leaves(self, diff, chunk):
        """The leaves each segment's backward reads: the model's, and the chunk's (stacked)."""
        model = self.model_of(diff)
        return jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(self._chunk_of(model, chunk)))

    def b(self, role, backwards, diff, saved, g, mb, chunk):
        """B: the gradient of the chunk's input (None at position 0) and the crossover W needs."""
        model_leaves, chunk_leaves = self._leaves(diff, chunk)
        known = model_leaves + jax.tree.leaves(mb)
        crossover = {}
        if role == "last":
            (g,), crossover["last"] = backwards["last"].b(known, saved["last"], g)

        def layer(g, xs):
            leaves, kept, *real = xs
            (g,), crossover = _unless_padding(real, lambda g: backwards["layers"].b(leaves, kept, g),
                                              lambda zeros, g: ((g,), zeros[1]), g)
            return g, crossover

        here = self._layers_here(chunk)
        g, crossover["layers"] = lax.scan(layer, g, (chunk_leaves, saved["layers"], *_rows(here)), reverse=True)
        if role == "first":
            _, crossover["first"] = backwards["first"].b(known, saved["first"], g)
            g = None
        return g, crossover

    def w(self, role, backwards, diff, saved, crossover, mb, chunk):
        """W: the gradient of `diff`, from the crossover B handed over."""
        model_leaves, chunk_leaves = self._leaves(diff, chunk)
        known = model_leaves + jax.tree.leaves(mb)
        model_grads = [None] * len(model_leaves)
        for segment in ("first", "last"):
            if segment in crossover:
                grads = backwards[segment].w(known, saved[segment], crossover[segment])
                model_grads = [a if b is None else b if a is None else a + b for a, b in zip(model_grads, grads)]

        def layer(_, xs):
            leaves, kept, handed, *real = xs
            return None, _unless_padding(real, lambda: backwards["layers"].w(leaves, kept, handed),
                                         lambda zeros: zeros)

        here = self._layers_here(chunk)
        _, chunk_grads = lax.scan(layer, None, (chunk_leaves, saved["layers"], crossover["layers"], *_rows(here)))

        # Back from the leaves the segments computed with to `diff` (slicing and wrapping only).
        def zero_if_none(grads, leaves):
            return [vma.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]

        _, pull = jax.vjp(lambda d: self._leaves(d, chunk), diff)
        return pull((zero_if_none(model_grads, model_leaves), zero_if_none(chunk_grads, chunk_leaves)))[0]


def _rows(here) -> tuple:
    """What a scan over a chunk's rows takes beside them: which hold a layer, if any is padding."""
    return () if here is None else (here,)


def _unless_padding(real: tuple, run: Callable, skip: Callable, *operands):
    """`run(*operands)` on a row of the layer stack that holds a layer; on a padding row
    (`real`, one boolean or none: every row a layer) `skip(zeros, *operands)`, with `zeros` like
    run's outputs: the identity, passed through in one `lax.cond`, so a padding row costs no FLOPs."""
    if not real:
        return run(*operands)
    # (the shapes found before the cond: `run` records its `Backward` as it traces, last in the cond)
    zeros = jax.tree.map(lambda a: _zeros(a, vma.aval_axes(a)), jax.eval_shape(run, *operands))
    with jax.named_scope(PADDING_SCOPE):  # (named, for `tick_branches` to find it in the program)
        return lax.cond(real[0], run, lambda *operands: skip(zeros, *operands), *operands)


def typed(stages: Stages, diff, mb, stage_axis: str) -> tuple[Stages, jax.ShapeDtypeStruct, jax.ShapeDtypeStruct, dict]:
    """`stages` with the varying axes of what travels between stages, the loss's and an
    activation's abstract values, and each segment's `Backward`. The activation's type is a fixed point: a stage's
    output may vary over more axes than its input (found abstractly, no compute)."""
    stages = dataclasses.replace(stages, act_axes=frozenset({stage_axis}))
    backwards = {}

    def forward(role, keep=False):
        def run(diff, x, mb):
            out, saved, found = stages.forward(role, diff, x, mb, 0, keep)
            backwards.update(found)
            return out, saved
        return lambda diff, x: nnx.eval_shape(run, diff, x, mb)[0]

    while True:
        x = forward("first")(diff, None)
        grown = stages.act_axes | vma.varying_axes(x) | vma.varying_axes(forward("middle")(diff, x))
        if grown == stages.act_axes:
            break
        stages = dataclasses.replace(stages, act_axes=grown)
    stages = dataclasses.replace(stages, loss_axes=frozenset({stage_axis}))
    loss_abstract = forward("last")(diff, x)
    stages = dataclasses.replace(stages, loss_axes=vma.varying_axes(loss_abstract) | {stage_axis})
    forward("first", keep=True)(diff, None)
    forward("last", keep=True)(diff, x)
    return stages, loss_abstract, x, backwards


# --- the executor --------------------------------------------------------------------------------


def _buffer(avals, slots: int, layers: int | None = None):
    """A buffer of `slots` (+ one nobody reads) per aval, each slot stacked over `layers` if
    given; [] when nothing is buffered."""
    lead = (slots + 1,) + ((layers,) if layers is not None else ())
    return [vma.vary(jnp.zeros((*lead, *a.shape), a.dtype), vma.aval_axes(a)) for a in avals] if slots else []


def _read(buffer, slot):
    return [lax.dynamic_index_in_dim(b, slot, keepdims=False) for b in buffer]


def _set(array, slot, value):
    # (A slot is always in range: an update in place, where `.at[slot].set` keeps an out-of-range
    # slot's old value, which XLA reads back to select between: a third more traffic.)
    return lax.dynamic_update_index_in_dim(array, value, slot, 0)


def _after(value, *done):
    """`value`, made to wait for each of `done` (pytrees): a zero read from a leaf of each is
    added to it, a leaf varying over no axis that `value` does not. (XLA:CPU starts independent
    collectives in either order on each device, and two devices that disagree wait in different
    rendezvous for ever; it drops an optimization barrier, but not a data dependency.)"""
    for d in done:
        leaf = next((a for a in jax.tree.leaves(d) if vma.varying_axes(a) <= vma.varying_axes(value)), None)
        if leaf is None:
            raise ValueError(f"pipelining: nothing in {jax.tree.structure(d)} varies over only {set(vma.varying_axes(value))}"
                             " to order this tick's collectives by")
        first = jnp.ravel(leaf)[0]
        value = value + (jnp.where(jnp.isfinite(first), first, 0) * 0).astype(value.dtype)
    return value


def _write(buffer, slot, values):
    return [_set(b, slot, v) for b, v in zip(buffer, values)]


def _per_role(make: Callable) -> Callable:
    """One function that runs `make(role)` for the role the tick's row names (a `lax.switch`)."""
    branches = [make(role) for role in ROLES]

    def run(here, *args):
        with jax.named_scope("role"):  # (named, for `tick_branches` to find it in the program)
            return lax.switch(here["role"], branches, *args)

    return run


def actions(stages: Stages, backwards: dict, loss_abstract, microbatches: int, keep: bool, records: dict) -> dict:
    """What each kind of action does at each role, given this tick's row `here` of the program.

    F (diff, loss_sum, x, mb, here) -> (loss_sum, output, residuals of every segment; zeros
    for those its role does not run); B (diff, saved, g, x, mb, here) -> (input gradient,
    crossover of every segment); W (diff, saved, crossover, x, mb, here) -> gradient of diff;
    BW (diff, saved, g, x, mb, here) -> (input gradient, gradient of diff). `records`: the type
    of one slot of each residual and crossover buffer, for the zeros."""

    def complete(found, name):  # every segment's record: zeros for those this role has not
        return {s: found.get(s) or [_zeros(*r) for r in record] for s, record in records[name].items()}

    def saved_of(role, diff, saved, x, mb, here):
        if keep:
            return {s: _read(saved[s], here["saved_slot"][s]) for s in segments(role)}
        return stages.forward(role, diff, x, mb, here["chunk"], keep=True)[1]  # stage remat: F again

    def pulled_back(role, g):
        if role == "last":  # the gradient of the mean over micro-batches
            return vma.vary(jnp.full(loss_abstract.shape, 1 / microbatches, loss_abstract.dtype), stages.loss_axes)
        return g

    def forward(role):
        def run(diff, loss_sum, x, mb, here):
            out, kept, _ = stages.forward(role, diff, x, mb, here["chunk"], keep)
            kept = complete(kept, "saved")
            return (loss_sum + out, jnp.zeros_like(x), kept) if role == "last" else (loss_sum, out, kept)
        return run

    def b(role):
        def run(diff, saved, g, x, mb, here):
            dx, crossover = stages.b(role, backwards, diff, saved_of(role, diff, saved, x, mb, here),
                                     pulled_back(role, g), mb, here["chunk"])
            crossover = complete(crossover, "crossover")
            return (jnp.zeros_like(x) if dx is None else dx), crossover
        return run

    def w(role):
        def run(diff, saved, crossover, x, mb, here):
            handed = {s: _read(crossover[s], here["crossover_slot"][s]) for s in segments(role)}
            return stages.w(role, backwards, diff, saved_of(role, diff, saved, x, mb, here), handed, mb, here["chunk"])
        return run

    def bw(role):
        def run(diff, saved, g, x, mb, here):
            kept = saved_of(role, diff, saved, x, mb, here)
            dx, crossover = stages.b(role, backwards, diff, kept, pulled_back(role, g), mb, here["chunk"])
            grads = stages.w(role, backwards, diff, kept, crossover, mb, here["chunk"])
            return (jnp.zeros_like(x) if dx is None else dx), grads
        return run

    return {"F": _per_role(forward), "B": _per_role(b), "W": _per_role(w), "BW": _per_role(bw)}


def value_and_grad(schedule: Schedule, loss: StagedLoss, model_of: Callable, diff, batch, stage_axis: str,
                   one_value: Callable[[jax.Array], jax.Array], stacked: tuple[bool, ...], accumulate=None,
                   stage_remat: str = "none", stage_layers: tuple[int, ...] | None = None, ordered: bool = False):
    """The mean loss over this device's `batch` and its gradient with respect to `diff`.

    `model_of(diff)` builds the model from the differentiable params; `one_value` turns a
    micro-batch's loss into one value per batch shard (a pmean over the axes it is spread on).
    `stacked`: per leaf of `diff`, whether it is the layer stack (`ParamLayout.stacked`).
    The micro-batches' gradients add up in `accumulate` where it is wider than a param's
    dtype (fp32 over bf16 params), else in the param's. `stage_remat` (`STAGE_REMAT`): keep
    each segment's residuals from F to its backward, or recompute them there. `stage_layers`:
    the layers of each model chunk (`Plan.stage_layers`), where they differ held padded
    (`held_slots`); None: the stacked rows split evenly, every row a layer. `ordered`: run each
    tick's collectives in one order (`Plan.collectives_ordered`: off a GPU).
    """
    with scaled_losses(1 / schedule.microbatches):  # as each micro-batch's loss is seeded
        return _execute(schedule, loss, model_of, diff, batch, stage_axis, one_value, accumulate, stage_remat,
                        stage_layers=stage_layers, stacked=stacked, ordered=ordered)


def forward_loss(schedule: Schedule, loss: StagedLoss, model_of: Callable, diff, batch, stage_axis: str,
                 one_value: Callable[[jax.Array], jax.Array], stage_layers: tuple[int, ...] | None = None,
                 ordered: bool = False) -> jax.Array:
    """The mean loss over this device's `batch`, forward only (evaluation): the schedule's F
    ticks, up to its last, with nothing kept for a backward."""
    return _execute(schedule, loss, model_of, diff, batch, stage_axis, one_value, grad=False,
                    stage_layers=stage_layers, ordered=ordered)[0]


def _execute(schedule: Schedule, loss: StagedLoss, model_of: Callable, diff, batch, stage_axis: str,
             one_value: Callable, accumulate=None, stage_remat: str = "none", grad: bool = True,
             stage_layers: tuple[int, ...] | None = None, stacked: tuple[bool, ...] = (), ordered: bool = False):
    """`value_and_grad`; without `grad`, (loss, None) from the F ticks alone."""
    p, v, m = schedule.stages, schedule.virtual, schedule.microbatches
    program = compile_program(schedule, stage_remat if grad else "full")  # (full: no residual slots)
    keep = grad and stage_remat == "none"
    if not grad:  # the F ticks up to the last one: no backward action, send or buffer
        forward = program.kind == 1 + KINDS.index("F")
        ticks = int(np.nonzero(forward.any(axis=1))[0].max()) + 1
        never = np.zeros_like(program.sends_backward)
        program = dataclasses.replace(program, kind=np.where(forward, program.kind, 0), sends_backward=never,
                                      late_backward=never, crossover_slots=dict.fromkeys(SEGMENTS, 0))
    rows = program.rows()
    if not grad:
        rows = jax.tree.map(lambda a: a[:ticks], rows)
    stage = lax.axis_index(stage_axis)
    micro = jax.tree.map(lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:]), batch)
    # Every param stage-varying: a branch's gradient then needs no psum over the stage axis.
    shared = jax.tree.map(lambda w: stage_axis not in vma.varying_axes(w), diff)
    diff = jax.tree.map(lambda w: vma.vary(w, (stage_axis,)), diff)

    def take(tree, index):
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False), tree)

    # A micro-batch typed as the ticks take it: picked by a stage-varying index.
    first_mb = jax.tree.map(lambda a: vma.vary(a, (stage_axis,)), take(micro, 0))
    stages = Stages(loss, model_of, one_value, v, layer_mask=layer_mask(stage_layers), stage_axis=stage_axis)
    stages, loss_abstract, x, backwards = typed(stages, diff, first_mb, stage_axis)
    # Residuals and crossover of the layers' segments are stacked over the chunk's layers.
    chunk_layers = nnx.eval_shape(lambda d: jax.tree.leaves(nnx.state(stages._chunk_of(model_of(d), 0))), diff)[0].shape[0]
    buffers = dict(
        act=_zeros(jax.ShapeDtypeStruct((program.act_slots + 1, *x.shape), x.dtype), stages.act_axes),
        grad=_zeros(jax.ShapeDtypeStruct((program.grad_slots + 1, *x.shape), x.dtype), stages.act_axes),
        saved={s: _buffer(backwards[s].saved, program.saved_slots[s], chunk_layers if s == "layers" else None)
               for s in SEGMENTS},
        crossover={s: _buffer(backwards[s].crossover, program.crossover_slots[s], chunk_layers if s == "layers" else None)
                   for s in SEGMENTS},
    )
    records = {name: {s: [(jax.ShapeDtypeStruct(b.shape[1:], b.dtype), vma.varying_axes(b)) for b in buffer]
                      for s, buffer in buffers[name].items()} for name in ("saved", "crossover")}  # one slot's
    act = actions(stages, backwards, loss_abstract, m, keep, records)
    runs = {KINDS[k - 1] for k in set(program.kind.flat) if k}  # the kinds of action the table has
    ring = v > 1  # chunks wrap around from the last device to the first
    forward_pairs = [(s, (s + 1) % p) for s in range(p if ring else p - 1)]
    backward_pairs = [((s + 1) % p, s) for s in range(p if ring else p - 1)]

    def added(grads, weights, here):
        """The step's gradient sums plus one backward's: only what the chunk's backward computed.
        A branch returns every param's gradient, zeros for those it did not compute with, and
        adding those would read and write the whole accumulator each backward (docs/planning.md).
        The layer stack's gradient is the chunk's rows of it (interleaved: added into their slice
        alone, where the stage axis alone splits the stack); the others' (embeddings, head, norms)
        only at the pipeline's first and last positions, a middle chunk's being zeros."""
        acc, tree = jax.tree.flatten(grads)
        new = jax.tree.leaves(weights)
        start = here["chunk"] * chunk_layers
        for i, (a, w) in enumerate(zip(acc, new)):
            if not stacked[i]:
                continue
            if v > 1 and a.shape[0] == v * chunk_layers:
                rows = [lax.dynamic_slice_in_dim(x, start, chunk_layers) for x in (a, w)]
                acc[i] = lax.dynamic_update_slice_in_dim(a, rows[0] + rows[1], start, 0)
            else:
                acc[i] = a + w
        others = [i for i in range(len(acc)) if not stacked[i]]
        if others:
            with jax.named_scope(ENDS_SCOPE):  # (named, for `tick_branches` to find it in the program)
                summed = lax.cond(here["role"] != ROLES.index("middle"), lambda a, w: [x + y for x, y in zip(a, w)],
                                  lambda a, w: a, [acc[i] for i in others], [new[i] for i in others])
            for i, a in zip(others, summed):
                acc[i] = a
        return tree.unflatten(acc)

    def send(row, flag, x, pairs, ever=True):  # `ever`: whether any tick does (else no ppermute at all)
        if not ever:
            return x * 0
        with jax.named_scope(flag):  # (named, for `tick_branches` to find it in the program)
            return lax.cond(row[flag], lambda x: lax.ppermute(x, stage_axis, pairs), jnp.zeros_like, x)

    def tick(carry, row):
        buffers, grads, loss_sum, (out, dx) = carry
        here = jax.tree.map(lambda a: a[stage], {k: v for k, v in row.items() if not k.startswith(("sends", "late"))})
        mb, x = take(micro, here["microbatch"]), buffers["act"][here["act_slot"]]
        # The last tick's sends that nobody reads in this one: they depend on no compute of this tick.
        late_out = send(row, "late_forward", out, forward_pairs, program.late_forward.any())
        late_dx = send(row, "late_backward", _after(dx, late_out) if ordered else dx, backward_pairs,
                       program.late_backward.any())

        g = buffers["grad"][here["grad_slot"]]
        if ordered:  # every action after both, the on-time sends after every action (below)
            x, g = _after(x, late_out, late_dx), _after(g, late_out, late_dx)
        zero = jnp.zeros_like(x)

        # One boolean cond per kind of action, each updating its buffers in place (a `lax.switch`
        # over kinds would copy them whole every tick), in an order that writes each buffer before
        # it is read: residuals at F, before B / W / BW read other slots; the crossover at B, before W.
        def when(kind, action, otherwise, *operands):
            if kind not in runs:
                return otherwise(*operands)
            with jax.named_scope(f"pipeline_{kind}"):
                return lax.cond(here["kind"] == 1 + KINDS.index(kind), action, otherwise, *operands)

        def forward(saved, loss_sum):
            loss_sum, out, kept = act["F"](here, diff, loss_sum, x, mb, here)
            return {s: _write(b, here["saved_write"][s], kept[s]) for s, b in saved.items()}, loss_sum, out

        saved, loss_sum, out = when("F", forward, lambda saved, loss_sum: (saved, loss_sum, zero),
                                    buffers["saved"], loss_sum)

        def backward_input(crossover):
            dx, handed = act["B"](here, diff, saved, g, x, mb, here)
            return {s: _write(b, here["crossover_write"][s], handed[s]) for s, b in crossover.items()}, dx

        crossover, dx_b = when("B", backward_input, lambda crossover: (crossover, zero), buffers["crossover"])
        grads = when("W", lambda grads: added(grads, act["W"](here, diff, saved, crossover, x, mb, here), here),
                     lambda grads: grads, grads)

        def backward(grads):
            dx, weights = act["BW"](here, diff, saved, g, x, mb, here)
            return added(grads, weights, here), dx

        grads, dx_bw = when("BW", backward, lambda grads: (grads, zero), grads)
        dx = dx_b + dx_bw  # (one of them is zero)
        sent_out = send(row, "sends_forward", _after(out, grads) if ordered and grad else out, forward_pairs)
        sent_dx = send(row, "sends_backward", _after(dx, sent_out) if ordered else dx, backward_pairs)
        buffers = dict(
            act=_set(_set(buffers["act"], here["act_arrival"], sent_out), here["act_late"], late_out),
            grad=_set(_set(buffers["grad"], here["grad_arrival"], sent_dx), here["grad_late"], late_dx),
            saved=saved, crossover=crossover)
        return (buffers, grads, loss_sum, (out, dx)), None

    carry = (
        buffers,
        jax.tree.map(lambda w: jnp.zeros_like(w, jnp.promote_types(w.dtype, accumulate or w.dtype)), diff)
        if grad else None,
        _zeros(loss_abstract, stages.loss_axes),
        (buffers["act"][0], buffers["act"][0]),  # this tick's output and input gradient, for a late send
    )
    (_, grads, loss_sum, _), _ = lax.scan(tick, carry, rows)
    if grad:
        grads = jax.tree.map(lambda g, s: lax.psum(g, stage_axis) if s else g, grads, shared)
    return lax.psum(loss_sum, stage_axis) / m, grads


def _zeros(abstract, axes):
    return vma.vary(jnp.zeros(abstract.shape, abstract.dtype), axes)


def layer_mask(stage_layers: tuple[int, ...] | None) -> np.ndarray | None:
    """[position, row]: which of each model chunk's `layer_slots` rows hold a layer (its first
    ones); None where every row does."""
    if not stage_layers or len(set(stage_layers)) == 1:
        return None
    return np.arange(max(stage_layers)) < np.array(stage_layers)[:, None]


def held_slots(stage_layers: tuple[int, ...], stages: int, virtual: int) -> np.ndarray | None:
    """Per row of the stacked layers as a pipeline holds them, the model's layer it holds (-1:
    padding): chunk after chunk in pipeline order, each its layers then zeros up to
    `layer_slots` rows (`layer_mask`), then interleaved (`interleave`). None where that is the
    model's own order (layers the chunks divide, not interleaved)."""
    mask = layer_mask(stage_layers)
    if mask is None:
        mask = np.ones((len(stage_layers), stage_layers[0]), bool)
    rows = np.full(mask.shape, -1)
    rows[mask] = np.arange(sum(stage_layers))  # (row-major: chunk by chunk, in order)
    rows = interleave(rows.reshape(-1), stages, virtual)
    return None if np.array_equal(rows, np.arange(rows.size)) else rows


def to_held(x: jax.Array, slots: np.ndarray) -> jax.Array:
    """A stack of layers (dim 0) in the model's order, as a pipeline holds it (`held_slots`):
    reordered, zeros in the padding rows."""
    real = (slots >= 0).reshape(-1, *(1,) * (x.ndim - 1))
    return jnp.where(real, jnp.take(x, np.maximum(slots, 0), axis=0), 0)


def from_held(x: jax.Array, slots: np.ndarray) -> jax.Array:
    """The inverse of `to_held`: the model's layers, in its order, the padding dropped."""
    real = np.nonzero(slots >= 0)[0]
    return jnp.take(x, real[np.argsort(slots[real])], axis=0)


def interleave(x: jax.Array, stages: int, virtual: int, inverse: bool = False) -> jax.Array:
    """Stacked layers from model order to the order the interleaved pipeline stores them in
    (`inverse`: back). Model chunk k = c·p + d must sit on device d as its chunk c; a stage
    axis splits dim 0 in contiguous blocks, so block d holds chunks d, p + d, 2p + d, ..."""
    split = (stages, virtual) if inverse else (virtual, stages)
    return x.reshape(*split, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
