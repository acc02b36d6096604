"""A training step as `jax.jit(jax.shard_map(body))`, every collective explicit and derived.

Three layouts per param come from the rules (`jshard.rules`): `param` (how the model
holds it), `opt` (how the optimizer state and the update are split: the ZeRO axes) and
the batch axes (activation rule `batch`). The body:

    1. differentiable view: DP / ZeRO-1 / ZeRO-3 the param itself; ZeRO-2 its `opt`
       shard, paired with the replica the forward uses (`nn.params.ShardWithReplica`). Cast to
       varying over the batch axes, so autodiff leaves batch reductions to step 3; but a
       ZeRO-3 layer's weight, whose gradient its gather sums (`Plan.summed_in_backward`).
    2. loss and grads of this device's share of the batch. Inside, layers gather ZeRO-3
       weights (the transpose: a reduce-scatter, then the sum over the other batch axes) and
       reduce-scatter ZeRO-2 gradients per layer; tensor / sequence parallel collectives
       follow from the names (`jshard.nn`).
    3. grads to the `opt` layout: reduce-scatter over ZeRO axes not yet scattered, sum
       over the other batch axes (in the precision's reduction dtype), divide by the
       number of batch shards.
    4. optax update on the `opt` shard of each param (under `mixed`, of its fp32 master,
       `TrainState.master`), cast to the held dtype, then back to the `param` layout:
       an all-gather for ZeRO-1/2, nothing for DP and ZeRO-3.

A split param reaches the model as its block (`nn.params.LocalBlock`): `nn.params.param` computes with it;
a plain Flax layer's read gets it whole, gathered first (`step.describe` lists those). The
model's other Variables (batch statistics, RNG streams) travel whole in
`TrainState.model_state`; `model_state.py` syncs and checks what the forward writes to them.

Per step, with Ψ the param bytes: DP all-reduces Ψ; ZeRO-1/2 reduce-scatter Ψ and
all-gather Ψ; ZeRO-3 all-gathers Ψ twice (forward, and again in backward: gathered
weights are not saved) and reduce-scatters Ψ. Accumulating k micro-batches (`grad_accum`):
DP and ZeRO-1 the same; ZeRO-2 reduce-scatters k·Ψ; ZeRO-3 gathers 2k·Ψ and reduce-scatters k·Ψ.

Rules that split `layers` over a stage axis make step 2 a pipeline over micro-batches:
`pipelining.py` runs a schedule's tick table (`schedules.py`: GPipe, 1F1B, interleaved,
ZB-H1) and returns the loss and gradients itself; nothing else changes.

With `grad_accum` = k (gradient accumulation), step 2 runs on k micro-batches in a `lax.scan`,
their gradients added up before step 3: steps 3 and 4 run once per step (`build_step`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.extend import core
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from jshard import vma
from jshard.nn.layouts import Layout as AxesLayout, relayout_local
from jshard.nn.params import LocalBlock, ShardWithReplica, gathers_weights, remat_policy
from jshard.nn.step_context import current_step
from jshard.parallel import pipelining
from jshard.parallel.compiled import CompiledStep
from jshard.parallel.model_state import ModelState, sync_batch_norms
from jshard.layout import Layout
from jshard.parallel.step_plan import Plan, make_plan, step_layout, step_mesh
from jshard.parallel.state import (PlannedStep, TrainState, accumulate, lower, over_batch_shards, over_micro_batches,
                                   split_loss)
from jshard.placement import Report, adopt_array_shardings
from jshard.rules import ShardingError, layout_of


def _layouts(spec_tree) -> list[AxesLayout]:
    """One layout (a tuple of mesh axes per dim) per leaf of a tree of PartitionSpecs."""
    return [layout_of(spec) for spec in jax.tree.leaves(spec_tree)]


def _axes_in(layout: AxesLayout) -> set[str]:
    return {a for axes in layout for a in axes}


def _split(layout: AxesLayout, stage_axis) -> AxesLayout | None:
    """The axes a direct read of this param gathers (`nn.params.LocalBlock`): all but a pipeline's
    stage axis, whose layers each stage holds as its own. None where there are none."""
    split = tuple(tuple(a for a in axes if a != stage_axis) for axes in layout)
    return split if any(split) else None


class ShardedStep(PlannedStep):
    """`state, loss = step(state, batch)`: one optimizer step of `loss_fn(model, batch)`.

    `loss_fn` returns the mean loss over the batch it is given (inside the step: this
    device's share, split along dim 0 of every batch leaf over the batch axes); with
    `plan.has_aux`, `(loss, metrics)`, and the step returns `state, (loss, metrics)`: each
    metric (a scalar) averaged over the batch shards as the loss is.
    `.state` is the initial state, placed by the rules (`abstract`: as ShapeDtypeStructs, for
    `lower` only); a step donates the state it is given. `.plan` holds every layout and axis.
    """

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation,
                 loss_fn: Callable[[nnx.Module, Any], jax.Array], plan: Plan, abstract: bool = False):
        self.plan, self.tx, self.loss_fn = plan, tx, loss_fn
        adopt_array_shardings(model)  # (the optimizer's state is laid out as its params)
        self.graphdef, params, others = nnx.split(model, nnx.Param, ...)
        plan.check_params(params)
        self.others = ModelState(others)
        self.param_layouts, self.opt_layouts = plan.layouts("param"), plan.layouts("opt")
        self._param_paths = [p.path for p in plan.params]
        param_specs = plan.specs(params, "param")
        self.grad_specs = grad_specs = plan.specs(params, "opt")  # gradients leave in the opt layout
        # (of the params as held: a pipeline's uneven stages pad its stacks, which then split evenly)
        opt_specs = plan.opt_state_specs(jax.eval_shape(lambda p: tx.init(self._reorder(p, param_specs)), params))
        self.state_specs = TrainState(param_specs, opt_specs, self.others.specs,
                                      grad_specs if self._master_dtype else None)
        self._shardings = jax.tree.map(lambda s: NamedSharding(plan.mesh, s), self.state_specs)
        batch_spec = plan.batch_spec
        body = jax.shard_map(
            self._body, mesh=plan.mesh, in_specs=(self.state_specs, batch_spec),
            out_specs=(self.state_specs, jax.P()), check_vma=True,
        )
        self._step = jax.jit(body, donate_argnums=0, compiler_options=plan.xla_options or None)
        self._grads_sharded = jax.shard_map(
            self._grads_body, mesh=plan.mesh,
            in_specs=(param_specs, self.others.specs, batch_spec, self.state_specs.master),
            out_specs=(jax.P(), grad_specs), check_vma=True,
        )
        self._grads = jax.jit(self._grads_sharded)
        self._loss = jax.jit(jax.shard_map(
            self._loss_body, mesh=plan.mesh,
            in_specs=(param_specs, self.others.specs, batch_spec, self.state_specs.master),
            out_specs=jax.P(), check_vma=True,
        ))
        self.whole_reads: dict[str, tuple[str, ...]] = {}  # filled as the step is traced
        self.state = self._start(params, others, abstract)

    @property
    def _master_dtype(self):
        return self.plan.precision.master if self.plan.precision else None

    @property
    def _param_dtype(self):
        return self.plan.precision.param if self.plan.precision else None

    @property
    def _reduce_dtype(self):
        return self.plan.precision.reduce if self.plan.precision else None

    # -- state -------------------------------------------------------------------------

    def init_state(self, params: nnx.State, others: nnx.State) -> TrainState:
        """The state that starts training from a model's params and other Variables."""
        state = TrainState(None, None, jax.device_put(self.others.stored(others), self._shardings.model_state))
        state = self.with_params(state, self._pipeline_order(params, self.state_specs.params))
        opt_state = jax.jit(self.tx.init, out_shardings=self._shardings.opt_state)(self.full_params(state))
        return dataclasses.replace(state, opt_state=opt_state)

    def _state_of(self, params: nnx.State, others: nnx.State) -> TrainState:
        """`init_state`'s values with no placement: its shapes and dtypes, for an abstract state."""
        cast = lambda tree, dtype: tree if dtype is None else jax.tree.map(lambda p: p.astype(dtype), tree)
        params = self._reorder(params, self.state_specs.params)
        held, master = cast(params, self._param_dtype), cast(params, self._master_dtype) if self._master_dtype else None
        return TrainState(held, self.tx.init(held if master is None else master), self.others.stored(others), master)

    def _held(self, params, dtype, spec_tree):
        """`params` placed by `spec_tree` (`_placed`), then cast shard by shard to `dtype` (None: as they are)."""
        params = self._placed(params, spec_tree)
        return params if dtype is None else jax.tree.map(lambda p: p.astype(dtype), params)

    def with_params(self, state: TrainState, params: nnx.State) -> TrainState:
        """`state` with `params` (in this step's layer order, or the model's for `from_model_order`
        to convert; any dtype and placement): the held params in the precision's param dtype and,
        under a master, the master too. How a checkpoint's full-precision params come back under
        any precision."""
        master = self._held(params, self._master_dtype, self.state_specs.master) if self._master_dtype else None
        return dataclasses.replace(state, params=self._held(params, self._param_dtype, self.state_specs.params),
                                   master=master)

    def full_params(self, state: TrainState) -> nnx.State:
        """The params at full precision: the master where there is one (what a checkpoint saves)."""
        return state.master if state.master is not None else state.params

    def model(self, state: TrainState) -> nnx.Module:
        """The model with the params and other Variables of `state`."""
        params = self._pipeline_order(state.params, self.state_specs.params, inverse=True)
        return nnx.merge(self.graphdef, params, self.others.loaded(state.model_state))

    def to_model_order(self, state: TrainState) -> TrainState:
        """`state` with the stacked layers in the model's order, and only the model's layers: what
        a checkpoint holds, so that it restores under any schedule. The identity unless the
        schedule is interleaved or its stages' layers differ (`pipelining.held_slots`)."""
        return self._state_order(state, inverse=True)

    def from_model_order(self, state: TrainState) -> TrainState:
        """The inverse of `to_model_order`: a state in the model's order, as this step holds it."""
        if self._held_slots is None:
            return state
        return jax.device_put(self._state_order(state), self._shardings)

    def _state_order(self, state: TrainState, inverse: bool = False) -> TrainState:
        return TrainState(self._pipeline_order(state.params, self.state_specs.params, inverse),
                          self._pipeline_order(state.opt_state, self.state_specs.opt_state, inverse),
                          state.model_state,
                          self._pipeline_order(state.master, self.state_specs.master, inverse))

    @functools.cached_property
    def _held_slots(self):
        """Per row of the stacked layers as this step holds them, the model's layer (-1: padding);
        None: held in the model's order (`pipelining.held_slots`)."""
        if not self.schedule:
            return None
        return pipelining.held_slots(self.plan.stage_layers, self.schedule.stages, self.schedule.virtual)

    def _stacked(self, layout: AxesLayout) -> bool:
        return bool(layout) and self.plan.stage_axis in layout[0]

    def _reorder(self, tree, spec_tree, inverse: bool = False):
        """The stacked layers of `tree` from the model's order to the step's (`inverse`: back)."""
        slots = self._held_slots
        if slots is None:
            return tree
        reorder = pipelining.from_held if inverse else pipelining.to_held
        return self._per_leaf(lambda x, layout: reorder(x, slots) if self._stacked(layout) else x,
                              tree, _layouts(spec_tree))

    def _placed(self, tree, spec_tree):
        """`tree` on the mesh by `spec_tree`; a stack in the model's order whose layers the stage axis
        does not divide (uneven stages) whole over that axis: JAX splits a dim only evenly."""
        slots, stage_axis = self._held_slots, self.plan.stage_axis

        def sharding(x, spec):
            layout = layout_of(spec)
            uneven = self._stacked(layout) and x.shape[0] % self.mesh.shape[stage_axis]
            if slots is not None and uneven and x.shape[0] != len(slots):
                spec = jax.P(tuple(a for a in layout[0] if a != stage_axis) or None, *spec[1:])
            return NamedSharding(self.mesh, spec)

        return None if tree is None else jax.device_put(tree, self._per_leaf(sharding, tree, jax.tree.leaves(spec_tree)))

    def _pipeline_order(self, tree, spec_tree, inverse: bool = False):
        """A pipeline holds the stacked layers in its own order where it interleaves its chunks or
        its stages' layers differ (padded: `pipelining.held_slots`); the step's state is in that
        order, what it hands out (`inverse`) in the model's, placed as the model's."""
        tree = self._reorder(tree, spec_tree, inverse)
        return self._placed(tree, spec_tree) if inverse and self._held_slots is not None else tree

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, jax.Array]:
        return self._step(state, batch)

    def value_and_grad(self, state: TrainState, batch) -> tuple[jax.Array, nnx.State]:
        """The loss and its gradient, as the step computes them (gradients in the `opt` layout)."""
        loss, grads = self._grads(state.params, state.model_state, batch, state.master)
        return loss, self._pipeline_order(grads, self.grad_specs, inverse=True)

    def loss(self, state: TrainState, batch) -> jax.Array:
        """The mean loss of `batch` under `state`'s params, forward only and in the same
        layouts (a pipeline runs its F ticks): evaluation. Neither donates nor changes `state`."""
        return self._loss(state.params, state.model_state, batch, state.master)

    def lower(self, state: TrainState, batch, platform: str | None = None):
        """The lowered step, for `.compile()`, HLO and memory analysis. `state` and `batch` may be
        abstract (`.state` of an abstract step, `state.abstract_batch`); on an AbstractMesh the
        program is lowered for `platform` (default: this host's backend)."""
        return lower(self._step, self.mesh, platform, state, batch)

    # -- the body, on each device's blocks ------------------------------------------------

    def _per_leaf(self, fn, tree, *per_leaf_args):
        leaves, treedef = jax.tree.flatten(tree)
        return treedef.unflatten([fn(leaf, *args) for leaf, *args in zip(leaves, *per_leaf_args)])

    def _vary(self, x, layout: AxesLayout):
        """x, cast to varying over the batch (and context) axes it is not split over (no communication)."""
        return vma.vary(x, [a for a in self.plan.grad_axes if a not in _axes_in(layout)])

    def _differentiable(self, params, master):
        """Step 1: what autodiff sees, and the layout its gradient comes out in. ZeRO-2's
        shard is the master where there is one: its gradient then leaves in the master's dtype."""
        if self.rules.zero != 2:
            # A weight whose gradient the backward sums itself (`Plan.summed_in_backward`) stays
            # invariant over those axes.
            def view(w, layout, summed):
                return w if summed else self._vary(w, layout)

            return self._per_leaf(view, params, self.param_layouts, self.plan.summed_in_backward), self.param_layouts
        if master is not None:
            return self._per_leaf(self._vary, master, self.opt_layouts), self.opt_layouts

        def shard(w, have, want):
            return self._vary(relayout_local(w, have, want), want)

        return self._per_leaf(shard, params, self.param_layouts, self.opt_layouts), self.opt_layouts

    def _local(self, block, layout: AxesLayout, path: str, summed: tuple[str, ...] = ()):
        """A param's block as the model holds it: where it is split, an `nn.params.LocalBlock` that
        `nn.params.param` computes with as it is and a plain layer's read gathers whole (its
        gradient summed over `summed` where it is produced)."""
        split = _split(layout, self.plan.stage_axis)
        if not split:
            return block
        return LocalBlock(block, split, self.plan.batch_axes, path, summed, self._reduce_dtype if summed else None)

    def _with_replicas(self, shards, params):
        """ZeRO-2: each param that the opt layout splits, as (shard, replica) for `nn.params.param`."""

        def pair(shard, replica, have, want, path):
            split = [d for d, (h, w) in enumerate(zip(have, want)) if h != w]
            if not split:  # (a master of a param ZeRO leaves whole: computed with in the param dtype)
                return self._local(shard.astype(replica.dtype), have, path)
            axes = tuple(a for a in want[split[0]] if a not in have[split[0]])
            # Varying over the stage axis too: a pipeline's branches must not psum over it.
            stage_axis = self.plan.stage_axis
            own = self.plan.grad_axes + ((stage_axis,) if stage_axis else ())
            vary = tuple(a for a in own if a not in _axes_in(have))
            whole = _split(have, stage_axis) or ((),) * replica.ndim
            return ShardWithReplica(shard, replica, split[0] - replica.ndim, axes, vary, whole,
                                       self.plan.batch_axes, path, self._reduce_dtype)

        return self._per_leaf(pair, shards, jax.tree.leaves(params), self.param_layouts, self.opt_layouts,
                              self._param_paths)

    def _model_builder(self, params, mine):
        """diff, mine -> the model this device computes with: `params` as its blocks (ZeRO-2:
        `diff`'s shards paired with the replicas of `params`) and the other Variables `mine`."""

        def model_of(diff, mine=mine):
            if self.rules.zero == 2:
                blocks = self._with_replicas(diff, params)
            else:
                blocks = self._per_leaf(self._local, diff, self.param_layouts, self._param_paths,
                                        self.plan.summed_in_backward)
            # Copies: Flax writes only to Variables made in the trace that writes (BatchNorm's).
            model = nnx.merge(self.graphdef, blocks, mine, copy=True)
            sync_batch_norms(model, self.batch_axes)
            return model

        return model_of

    def _one_value(self, loss):
        # Equal on every device of a non-batch axis, but typed varying (it came from
        # gathered activations): average to make it one value, and its gradient once. Over
        # the context axes a loss may differ (a mean over this device's chunks, unless the loss
        # averaged over them itself, as nn.cross_entropy does): the average is the whole mean.
        spread = tuple(sorted(vma.varying_axes(loss) - set(self.batch_axes) - {self.plan.stage_axis}))
        return lax.pmean(loss, spread) if spread else loss

    def _value(self, out):
        """(loss, metrics) of what `loss_fn` returned, each one value over the non-batch axes
        (metrics None without `has_aux`)."""
        loss, metrics = split_loss(out, self.plan.has_aux)
        return self._one_value(loss), jax.tree.map(self._one_value, metrics)

    @contextlib.contextmanager
    def _splitting_sequences(self):
        """While tracing the loss: under context parallelism, check that the model split its
        sequences over the context axes (`nn.context_parallel.split_input`: jshard.nn's Embed and cross_entropy).
        A model that never does computes the same on each device of those axes: refused, as a
        mesh axis no rule uses is."""
        splits = current_step().context_splits  # the inputs split while the body traces (`nn.step_context`)
        try:
            yield
        except Exception as e:  # (a model that splits nothing may fail first, e.g. its own scan's carry types)
            if self.plan.context_axes and not splits:
                raise self._no_context_split() from e
            raise
        if self.plan.context_axes and not splits:
            raise self._no_context_split()

    def _no_context_split(self) -> ShardingError:
        return ShardingError(
            f"build_step: rules {self.rules.name!r} split each sequence over {'+'.join(self.plan.context_axes)} (context "
            "parallelism), but the model's forward split no input over it: no jshard.nn.Embed or "
            "jshard.nn.cross_entropy reads a (batch, seq) input. Fix: build the model's inputs and loss from "
            "jshard.nn, or use a preset without cp.")

    def _loss_and_grads(self, params, others, batch, master=None):
        """Steps 1-3: the mean loss over the global batch, its gradient in the `opt` layout
        (in the precision's reduction dtype), and the model's other Variables as the forward
        wrote them. With `grad_accum` = k > 1, step 2 runs on k micro-batches of this device's
        rows in a `lax.scan`, their local gradients added up in the reduction dtype, and step 3
        once, on the sum."""
        diff, grad_layouts = self._differentiable(params, master)
        mine = self.others.for_batch_shard(others, self.batch_axes)
        micro_step, steps = self._micro_step(params, diff, others), self.plan.grad_accum
        with self._splitting_sequences():
            if steps == 1:
                (loss, metrics), grads, mine = micro_step(mine, batch)
            else:
                for leaf in jax.tree.leaves(batch):  # a batch placed without `shard_batch` is checked here
                    self.plan.check_batch(leaf.shape[0] * self.data_shards)
                zeros = [vma.vary(jnp.zeros(d.shape, self._reduce_dtype or d.dtype), vma.varying_axes(d))
                         for d in jax.tree.leaves(diff)]
                values, grads, mine = accumulate(micro_step, jax.tree.unflatten(jax.tree.structure(diff), zeros),
                                                 mine, batch, steps)
                loss, metrics = over_micro_batches(values)
        written = self.others.written(others, mine)

        def reduce(g, have, want, summed):
            pending = [a for a in self.plan.grad_axes if a not in _axes_in(have) and a not in summed]
            if self._reduce_dtype is not None:
                g = g.astype(self._reduce_dtype)
            return relayout_local(g, have, want, pending) / (self.data_shards * steps)

        grads = self._per_leaf(reduce, grads, grad_layouts, self.opt_layouts, self.plan.summed_in_backward)
        value = (loss, metrics) if self.plan.has_aux else loss
        return over_batch_shards(value, self.batch_axes), grads, written

    def _micro_step(self, params, diff, others):
        """Step 2 as `(mine, batch) -> ((loss, metrics), grads, mine)`: on this device's rows of
        one (micro-)batch, the loss, the gradient of `diff` before any reduction over the batch
        axes (ZeRO-2/3's reduce-scatters over the ZeRO axes happen inside it, layer by layer),
        and the model's other Variables `mine` as the forward wrote them."""

        def micro_step(mine, batch):
            model_of = self._model_builder(params, mine)
            if self.schedule:  # the pipeline runs its own backward, micro-batch by micro-batch
                loss, grads = pipelining.value_and_grad(self.schedule, self.loss_fn, model_of, diff, batch,
                                                      self.plan.stage_axis, self._one_value,
                                                      tuple(p.stacked for p in self.plan.params), self._reduce_dtype,
                                                      self.stage_remat, self.plan.stage_layers,
                                                      self.plan.collectives_ordered)
                return (loss, None), grads, mine

            def loss_of(diff, mine):
                model = model_of(diff, mine)
                loss, metrics = self._value(self.loss_fn(model, batch))
                return loss, (nnx.state(model, nnx.Not(nnx.Param)), metrics)

            # ZeRO-3 gathers each weight again in backward. A layer stack does so layer by
            # layer (`scan_layers`); a model without one gets it here. Weights outside a stack
            # (embeddings, head, final norm) are gathered once and kept: their first backward
            # use is where forward ends, and XLA merges a second gather into the first on
            # some versions and not on others, so keeping them makes the count one on all.
            if gathers_weights() and not self.plan.has_stack:
                loss_of = jax.checkpoint(loss_of, policy=remat_policy)
            (loss, (new, metrics)), grads = jax.value_and_grad(loss_of, has_aux=True)(diff, mine)
            # Refused here if a Variable was written differently on each device (not as a scan's carry
            # type mismatch); else `mine`'s tree and types, as accumulation's scan carries it.
            self.others.written(others, new)
            new = [vma.vary(n, vma.varying_axes(m)) for n, m in zip(jax.tree.leaves(new), jax.tree.leaves(mine))]
            return (loss, metrics), grads, jax.tree.unflatten(jax.tree.structure(mine), new)

        return micro_step

    def _body(self, state: TrainState, batch):
        with self._step_context(self.whole_reads):
            loss, grads, model_state = self._loss_and_grads(state.params, state.model_state, batch, state.master)
            if state.master is not None:
                shards = state.master
            else:
                shards = self._per_leaf(relayout_local, state.params, self.param_layouts, self.opt_layouts)
            grads = jax.tree.map(lambda g, w: g.astype(w.dtype), grads, shards)  # the update in the shard's dtype
            updates, opt_state = self.tx.update(grads, state.opt_state, shards)
            shards = optax.apply_updates(shards, updates)
            held = jax.tree.map(lambda w, p: w.astype(p.dtype), shards, state.params)  # cast before the gather
            gather = functools.partial(relayout_local, invariant=True)
            params = self._per_leaf(gather, held, self.opt_layouts, self.param_layouts)
            return TrainState(params, opt_state, model_state, shards if state.master is not None else None), loss

    def _loss_body(self, params, others, batch, master=None):
        """Evaluation: step 2's forward alone, on the same blocks; no gradient, no state written."""
        with self._step_context(self.whole_reads):
            diff, _ = self._differentiable(params, master)
            model_of = self._model_builder(params, self.others.for_batch_shard(others, self.batch_axes))
            with self._splitting_sequences():
                if self.schedule:
                    value = pipelining.forward_loss(self.schedule, self.loss_fn, model_of, diff, batch,
                                                  self.plan.stage_axis, self._one_value, self.plan.stage_layers,
                                                  self.plan.collectives_ordered)
                else:
                    loss, metrics = self._value(self.loss_fn(model_of(diff), batch))
                    value = (loss, metrics) if self.plan.has_aux else loss
            return over_batch_shards(value, self.batch_axes)

    def _grads_body(self, params, others, batch, master=None):
        with self._step_context(self.whole_reads):
            return self._loss_and_grads(params, others, batch, master)[:2]

    # -- what the step does with each param ------------------------------------------------

    def describe(self, batch=None) -> Report:
        """Where each param lives and what looks wrong: `jshard.describe`'s report, plus each
        param a plain layer reads whole (gathered before use: no tensor parallelism for it).
        Those are known once the step is traced: pass a batch if it has not run yet."""
        warnings = ()
        if batch is not None:
            program = jax.make_jaxpr(self._grads_sharded)(self.state.params, self.state.model_state, batch, self.state.master)
            if self.data_shards > 1 and _constant_keys(program.jaxpr):
                warnings = ("the loss makes a random key from a constant (nnx.Rngs(dropout=1), jax.random.key(0)): "
                            f"each of the {self.data_shards} batch shards draws the same numbers (dropout masks), "
                            "so the run is not one device's. Fix: give the model its own stream at construction "
                            "(nnx.Dropout(rate, rngs=rngs)), which the step folds per batch shard",)
        report, rows = self.plan.report(), []
        for p in report.rows:
            gathered = [a for a in self.whole_reads.get(p.path, ()) if a not in self.batch_axes]
            if gathered:
                p = dataclasses.replace(p, flags=p.flags + (
                    f"read whole by a plain layer (not jshard.nn): gathered over {'+'.join(gathered)} "
                    "before use, so its compute is not split (no tensor parallelism); build the layer "
                    "from jshard.nn to split it",))
            rows.append(p)
        return dataclasses.replace(report, rows=tuple(rows), warnings=warnings)


def _constant_keys(jaxpr) -> bool:
    """Whether `jaxpr` (or one inside it) seeds a random key from a literal: the same key on
    every device, whatever the batch shard."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "random_seed" and all(isinstance(v, core.Literal) for v in eqn.invars):
            return True
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's
                if isinstance(inner, core.Jaxpr) and _constant_keys(inner):
                    return True
    return False


def build_step(model, tx, loss_fn, layout: Layout | str | Mesh | AbstractMesh, mesh: Mesh | AbstractMesh | None = None,
               *, collectives: str = "explicit", abstract: bool = False, has_aux: bool = False, **deprecated):
    """A sharded train step for `model` laid out as `layout`; `.state` holds its start.

        step = build_step(model, optax.adamw(3e-4), gpt_loss, "zero3+tp fsdp=4,tensor=2 accum=2 precision=mixed")

    `layout` (`jshard.Layout`, or its line) holds everything about the layout: the strategy
    (a preset's name or a `Rules`), the mesh sizes, the pipeline's schedule, micro-batches,
    virtual chunks and stage remat, the precision and its gradient reduction, and gradient
    accumulation. `mesh`: where given (an `AbstractMesh`, or devices this machine does not have,
    where `abstract`), the step runs on it and the layout's sizes, where it names any, must be
    its; else `jshard.make_mesh` of the layout's sizes over this process's devices (an
    `AbstractMesh` of them where `abstract`). The form before `Layout`,
    `build_step(model, tx, loss_fn, mesh, rules, microbatches=..., precision=..., ...)`, still
    works for this release with a DeprecationWarning.

    `collectives` picks who places the collectives:

    - "explicit" (the default): a `ShardedStep`, `jax.jit(jax.shard_map(...))` with every
      collective derived from the rules (counted, textbook bytes). Rules that split
      `layers` over a stage axis pipeline the step over `Layout.microbatches` micro-batches with
      `Layout.schedule` (gpipe, the default; 1f1b; interleaved, with `Layout.virtual` model chunks
      per device, default 2; zb-h1); `loss_fn` must then be a `jshard.models.StagedLoss`.
      `Layout.stage_remat` says what a stage keeps from F to its backward: "none" (the default)
      keeps each segment's residuals, "full" only the stage input, recomputing the forward.
    - "compiler": a `CompiledStep` (`compiled.py`), plain `jax.jit` with the same layouts
      and XLA's partitioner inserting the collectives. Any model with named params, any
      Flax layer; no pipeline, so no micro-batches, schedule or virtual chunks.

    `Layout.precision` (`jshard.precision`: 'fp32', 'bf16', 'mixed' or a `Precision`) sets the
    dtype the step holds params in, reduces gradients in, and whether an fp32 master copy
    sits in the optimizer's layout ('mixed'); None keeps the params as the model holds them. Its
    compute dtype is what the layers compute in where they set none (`jshard.nn.compute_dtype`: a
    jshard model whose config leaves `dtype` unset, the default); None: float32.

    `has_aux`: `loss_fn` returns `(loss, metrics)`, metrics a pytree of scalars (accuracy, say);
    the step returns `state, (loss, metrics)` (and `loss` / `value_and_grad` the pair), each
    metric averaged over the batch shards as the loss is. Not under a pipeline.

    `Layout.grad_accum` = k: gradient accumulation inside the step. It takes a batch of k times the rows
    (k divides each batch shard's rows) and cuts each device's rows into k micro-batches, which
    a `lax.scan` runs one after the other (activations of one micro-batch alive at a time); their
    gradients add up in the precision's reduction dtype (fp32 under 'mixed'; else the params'),
    then one reduction and one optimizer update per step; the loss (and each metric) is the mean
    over the micro-batches, a `summed` metric their sum. What is reduced when:

    - the data-parallel reduction (the all-reduce of DP, ZeRO-1's reduce-scatter, the sum over
      the batch and context axes a param is not split over) runs once per step, on the sum;
    - what runs inside backward runs per micro-batch: ZeRO-2's and ZeRO-3's (FSDP's)
      reduce-scatters of each layer's gradient onto its optimizer shard, so the accumulator
      is as sharded as the optimizer state (as DeepSpeed does), ZeRO-3's weight gathers, and
      tensor, sequence, context and expert parallelism's activation collectives;
    - under a pipeline each micro-batch runs the whole schedule (its `microbatches` and its
      bubble): a step takes k × microbatches micro-batches per batch shard. Fewer bubbles for the
      same batch: raise `Layout.microbatches` instead (1f1b's memory does not grow with it).

    The explicit step's micro-batch i is rows i·m .. (i+1)·m - 1 of each batch shard (m = its
    rows / k); the compiler-placed step scans the same micro-batches, where XLA places the
    reductions (inside the loop: a loop's carry holds no unreduced partial sums). A model whose
    forward depends on which rows share a batch (BatchNorm's statistics, a mixture of experts'
    capacity) computes per micro-batch, as k separate steps' forwards would.

    `abstract`: no array is made or placed; `.state` holds `jax.ShapeDtypeStruct`s, and
    `.lower(step.state, batch)` gives the program on any mesh: an `AbstractMesh`, or devices
    this machine does not have (`jax.experimental.topologies`). `model` may then come from
    `nnx.eval_shape`.

    `Layout.remat` is the model's own (a jshard decoder's `config.remat`; the step checks they
    agree) and `Layout.micro_batch_size` the batch's: the step takes the batch it is given.

    Every input is checked first, once (`plan.make_plan`; the step's `.plan`). Both steps have
    the same surface (`.state`, `step(state, batch)`, `shard_batch`, `model`, `value_and_grad`,
    `lower`, ...), so `jshard.app.training` and user code take either.
    """
    layout, mesh = step_layout("build_step", layout, mesh, deprecated)
    plan = make_plan(model, layout, step_mesh(layout, mesh, abstract), loss_fn=loss_fn, collectives=collectives,
                     has_aux=has_aux)
    return step_from_plan(plan, model, tx, loss_fn, abstract)


def step_from_plan(plan: Plan, model, tx, loss_fn, abstract: bool = False):
    """`build_step`'s step from a plan already made (`make_plan`, on this model or its shapes)."""
    step = CompiledStep if plan.collectives == "compiler" else ShardedStep
    return step(model, tx, loss_fn, plan, abstract)
