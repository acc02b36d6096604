"""A training step through plain `jax.jit`, XLA's SPMD partitioner placing every collective.

`build_step(..., collectives="compiler")` builds it. The layouts are the explicit step's
(`step.py`), all from the rules: params in their `param` layout, optimizer state and the
update in the `opt` layout, the batch split along dim 0 over the batch axes, activations
constrained by the rules (the step traces its function under them, so `jshard.nn` layers
and `jshard.constrain` emit sharding constraints). What moves between the layouts is left
to the compiler:

    1. forward and backward of `loss_fn` on the global batch: ZeRO-3 weights gathered,
       tensor / sequence parallel activations relaid, as XLA decides;
    2. gradients constrained to the `opt` layout (a reduce-scatter over ZeRO axes, an
       all-reduce over the other batch axes: XLA's choice);
    3. optax update on the `opt` layout, params constrained back to the `param` layout.

The model needs logical names on its params and nothing else: any Flax NNX layer works,
since inside `jax.jit` every array is the global one. Non-Param Variables are the model's
own business, as on one device: BatchNorm sees the global batch, dropout draws global
masks, and the step carries what the forward wrote out of it (`ModelState`: RNG keys as
key data, so checkpoints hold them).

It does not pipeline (the stage axis is the explicit step's), and its collectives are
XLA's: not derived, not checked against the textbook, no ZeRO-2 per-layer reduce-scatter.
Under `grad_accum` it scans the explicit step's micro-batches; XLA reduces each one's gradient
inside the loop (a loop's carry holds no unreduced partial sums), where the explicit step
reduces the sum once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.lax import with_sharding_constraint
from jax.sharding import NamedSharding

from jshard.parallel.model_state import ModelState
from jshard.parallel.step_plan import Plan
from jshard.parallel.state import (PlannedStep, TrainState, accumulate, lower, over_micro_batches, split_loss,
                                   unmarked)
from jshard.placement import Report, adopt_array_shardings


def _abstract(mesh):
    """The AbstractMesh of a mesh, or the mesh itself when it is one."""
    return getattr(mesh, "abstract_mesh", mesh)


class CompiledStep(PlannedStep):
    """`state, loss = step(state, batch)`: one optimizer step of `loss_fn(model, batch)`,
    through `jax.jit` with XLA inserting the collectives.

    `loss_fn` receives the global batch and returns its mean loss. `.state` is the initial
    state, placed by the rules (`abstract`: as ShapeDtypeStructs); a step donates the state it
    is given. The surface is `ShardedStep`'s, so user code and `jshard.app.training` take either.
    """

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation,
                 loss_fn: Callable[[nnx.Module, Any], jax.Array], plan: Plan, abstract: bool = False):
        self.plan, self.tx, self.loss_fn = plan, tx, loss_fn
        adopt_array_shardings(model)  # (the optimizer's state is laid out as its params)
        self.graphdef, params, others = nnx.split(model, nnx.Param, ...)
        plan.check_params(params)
        self.others = ModelState(others)
        param_specs = plan.specs(params, "param")
        self.grad_specs = grad_specs = plan.specs(params, "opt")  # gradients leave in the opt layout
        opt_specs = plan.opt_state_specs(jax.eval_shape(tx.init, params))
        self.state_specs = TrainState(param_specs, opt_specs, self.others.specs)
        sharding = lambda spec: NamedSharding(plan.mesh, spec)
        self._shardings = jax.tree.map(sharding, self.state_specs)
        self._grad_shardings = jax.tree.map(sharding, grad_specs)
        replicated = sharding(jax.P())
        self._step = jax.jit(self._body, donate_argnums=0, out_shardings=(self._shardings, replicated))
        self._grads = jax.jit(self._grads_body, out_shardings=(replicated, self._grad_shardings))
        self._loss = jax.jit(self._loss_body, out_shardings=replicated)
        self.state = self._start(params, others, abstract)

    # -- state -------------------------------------------------------------------------

    def init_state(self, params: nnx.State, others: nnx.State) -> TrainState:
        """The state that starts training from a model's params and other Variables."""
        params = jax.device_put(params, self._shardings.params)
        opt_state = jax.jit(self.tx.init, out_shardings=self._shardings.opt_state)(params)
        return TrainState(params, opt_state, jax.device_put(self.others.stored(others), self._shardings.model_state))

    def _state_of(self, params: nnx.State, others: nnx.State) -> TrainState:
        """`init_state`'s values with no placement: its shapes and dtypes, for an abstract state."""
        return TrainState(params, self.tx.init(params), self.others.stored(others))

    def model(self, state: TrainState) -> nnx.Module:
        """The model with the params and other Variables of `state`."""
        return nnx.merge(self.graphdef, state.params, self.others.loaded(state.model_state))

    def to_model_order(self, state: TrainState) -> TrainState:
        """The identity: without a pipeline the state is in the model's order (`ShardedStep`'s)."""
        return state

    def from_model_order(self, state: TrainState) -> TrainState:
        """The identity, as `to_model_order`."""
        return state

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, jax.Array]:
        return self._step(state, batch)

    def value_and_grad(self, state: TrainState, batch) -> tuple[jax.Array, nnx.State]:
        """The loss and its gradient, as the step computes them (gradients in the `opt` layout)."""
        return self._grads(state.params, state.model_state, batch)

    def loss(self, state: TrainState, batch) -> jax.Array:
        """The mean loss of `batch`, forward only (evaluation); `state` is left as it is."""
        return self._loss(state.params, state.model_state, batch)

    def lower(self, state: TrainState, batch, platform: str | None = None):
        """The lowered step, for `.compile()`, HLO and memory analysis (`ShardedStep.lower`)."""
        return lower(self._step, self.mesh, platform, state, batch)

    def describe(self, batch=None) -> Report:
        """Where each param lives (`jshard.describe`). Every layer computes with whole params
        here, so nothing is flagged as read whole; `batch` is accepted for `ShardedStep`'s form."""
        return self.plan.report()

    # -- the traced function, on global arrays -------------------------------------------------

    def _placed(self, params, batch):
        """`params` and `batch` constrained to the rules' layouts, as every traced function takes them."""
        batch = jax.tree.map(lambda x: with_sharding_constraint(x, self.plan.batch_sharding), batch)
        return with_sharding_constraint(params, self._shardings.params), batch

    def _loss_and_grads(self, params, stored, batch):
        """The mean loss over the global batch, its gradient in the `opt` layout, and the
        model's other Variables as the forward wrote them (as a train state holds them). With
        `grad_accum` = k > 1, a `lax.scan` over k micro-batches (the explicit step's: each batch
        shard's rows cut in k), their gradients added up in the reduction dtype."""
        params, batch = self._placed(params, batch)

        def micro_step(stored, batch):
            batch = jax.tree.map(lambda x: with_sharding_constraint(x, self.plan.batch_sharding), batch)

            def loss_of(params):  # the model's Variables made here, at the level the forward writes them
                model = nnx.merge(self.graphdef, params, self.others.loaded(stored))
                loss, metrics = split_loss(self.loss_fn(model, batch), self.plan.has_aux)
                return loss, (nnx.state(model, nnx.Not(nnx.Param)), metrics)

            (loss, (written, metrics)), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
            written = jax.tree.unflatten(jax.tree.structure(stored), jax.tree.leaves(self.others.stored(written)))
            return (loss, metrics), with_sharding_constraint(grads, self._grad_shardings), written

        steps = self.plan.grad_accum
        if steps == 1:
            (loss, metrics), grads, stored = micro_step(stored, batch)
        else:
            reduce = self.precision.reduce if self.precision else None
            zeros = jax.tree.map(lambda p, s: with_sharding_constraint(jnp.zeros(p.shape, reduce or p.dtype), s),
                                 params, self._grad_shardings)
            values, grads, stored = accumulate(micro_step, zeros, stored, batch, steps, self.plan.data_shards)
            (loss, metrics), grads = over_micro_batches(values), jax.tree.map(lambda g: g / steps, grads)
        value = (loss, unmarked(metrics)) if self.plan.has_aux else loss
        return value, grads, stored

    @contextlib.contextmanager
    def _traced(self):
        """The step context (`nn.step_context`: the rules), and the mesh for `jshard.constrain`'s bare
        specs, while the step is traced (`jax.set_mesh` may not be entered inside `jax.jit`; the
        abstract mesh may)."""
        with self._step_context(), jax.sharding.use_abstract_mesh(_abstract(self.mesh)):
            yield

    def _body(self, state: TrainState, batch):
        with self._traced():
            loss, grads, model_state = self._loss_and_grads(state.params, state.model_state, batch)
            shards = with_sharding_constraint(state.params, self._grad_shardings)  # each param as its optimizer state is split
            updates, opt_state = self.tx.update(grads, state.opt_state, shards)
            shards = optax.apply_updates(shards, updates)
            params = with_sharding_constraint(shards, self._shardings.params)
            return TrainState(params, opt_state, model_state), loss

    def _grads_body(self, params, stored, batch):
        with self._traced():
            return self._loss_and_grads(params, stored, batch)[:2]

    def _loss_body(self, params, stored, batch):
        with self._traced():
            params, batch = self._placed(params, batch)
            loss, metrics = split_loss(self.loss_fn(nnx.merge(self.graphdef, params, self.others.loaded(stored)), batch),
                                       self.plan.has_aux)
            return (loss, unmarked(metrics)) if self.plan.has_aux else loss

