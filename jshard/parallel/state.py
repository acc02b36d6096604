"""What a step carries from one call to the next, and how a global batch reaches it.

Both steps (`step.py`, `compiled.py`) hold a `TrainState` and place a batch by their `Plan`:
split along dim 0 over the batch axes. Built abstractly, a step's state and batch are
`jax.ShapeDtypeStruct`s with their shardings, and it lowers on any mesh (`lower`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh

from jshard.nn.step_context import step_context
from jshard.parallel.step_plan import Plan
from jshard.parallel.tick_branches import TickBranches
from jshard.rules import ShardingError


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: nnx.State  # in the `param` layout, the precision's param dtype
    opt_state: Any  # optax state, in the `opt` layout
    model_state: nnx.State  # the model's other Variables, whole on every device (`model_state.py`)
    master: nnx.State | None = None  # the fp32 copy the optimizer updates, in the `opt` layout (`mixed`)


class PlannedStep:
    """What both steps share: the surface their users read of the plan, batch placement, and
    the start of their state (placed, or abstract)."""

    plan: Plan
    mesh = property(lambda self: self.plan.mesh)
    rules = property(lambda self: self.plan.rules)
    precision = property(lambda self: self.plan.precision)
    schedule = property(lambda self: self.plan.schedule)  # None: no pipeline
    microbatches = property(lambda self: self.plan.microbatches)
    stage_remat = property(lambda self: self.plan.stage_remat)
    batch_axes = property(lambda self: self.plan.batch_axes)
    data_shards = property(lambda self: self.plan.data_shards)
    batch_shards = property(lambda self: self.plan.batch_shards)

    @property
    def tick_branches(self) -> TickBranches | None:
        """The pipeline's tick table on its compiled program's conditionals (None: no pipeline)."""
        plan = self.plan
        return TickBranches.of(plan.schedule, plan.stage_remat, plan.stage_layers) if plan.schedule else None

    def _step_context(self, whole_reads: dict | None = None):
        """The step context its functions trace in (`nn.step_context`), as the plan says: its rules,
        compute dtype, platform, FP8, whether weights' layouts are pinned and the head's backward
        goes first; whole reads recorded into `whole_reads`."""
        plan = self.plan
        return step_context(plan.rules, whole_reads, plan.compute, plan.platform, plan.fp8, plan.pins_weight_layouts,
                            plan.head_backward_first)

    def shard_batch(self, batch):
        """Put a global batch on the mesh, split along dim 0 over the batch axes."""
        return shard_batch(self.plan, batch)

    def _start(self, params, others, abstract: bool) -> TrainState:
        """The state a step starts from: `init_state`'s, or (`abstract`) its ShapeDtypeStructs."""
        if abstract:
            return abstract_state(self._state_of, params, others, self._shardings)
        return self.init_state(params, others)


def shard_batch(plan: Plan, batch):
    """Put a global batch on the mesh, split along dim 0 over the batch axes."""
    for leaf in jax.tree.leaves(batch):
        if not np.ndim(leaf):
            raise ShardingError(f"a batch leaf is a scalar; the step splits every leaf along dim 0 over "
                                f"{'×'.join(plan.batch_axes) or 'no axis'}. Fix: give each leaf a batch dim.")
        plan.check_batch(np.shape(leaf)[0])
    return jax.device_put(batch, plan.batch_sharding)


def abstract_batch(plan: Plan, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    """A global batch leaf of `shape` as the step takes it, with no array: for `lower` on any mesh."""
    plan.check_batch(shape[0])
    return jax.ShapeDtypeStruct(shape, dtype, sharding=plan.batch_sharding)


def abstract_state(state_of, params, others, shardings) -> TrainState:
    """A step's state as `jax.ShapeDtypeStruct`s placed by `shardings`: what `state_of(params,
    others)` would give, with no array made (a model from `nnx.eval_shape`, a mesh of devices
    this machine does not have)."""
    shapes = jax.eval_shape(state_of, params, others)
    return jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                        shapes, shardings)


def lower(jitted, mesh, platform: str | None, *args):
    """`jitted` lowered for `args`; on an AbstractMesh for `platform` (default: this host's backend)."""
    if isinstance(mesh, AbstractMesh):
        return jitted.trace(*args).lower(lowering_platforms=(platform or jax.default_backend(),))
    return jitted.lower(*args)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Summed:
    """A loss's metric that the step adds up over the batch shards (a count: correct predictions,
    tokens seen) where every other metric is averaged as the loss is: `jshard.summed(x)`."""

    value: jax.Array


def summed(value) -> Summed:
    """Mark one of a loss's metrics to be summed over the batch shards, not averaged:
    `return loss, {"correct": jshard.summed((logits.argmax(-1) == labels).sum())}`."""
    return Summed(value)


def _is_summed(x) -> bool:
    return isinstance(x, Summed)


def over_batch_shards(value, axes):
    """A step's loss (and metrics) over the batch `axes`: each shard's mean averaged, each
    `Summed` metric's shard sums added, then unmarked."""
    return jax.tree.map(lambda x: jax.lax.psum(x.value, axes) if _is_summed(x) else jax.lax.pmean(x, axes),
                        value, is_leaf=_is_summed)


def accumulate(micro_step, zeros, carry, batch, steps: int, shards: int = 1):
    """Gradient accumulation: `micro_step(carry, micro_batch) -> (value, grads, carry)` on each of
    `steps` micro-batches of `batch` in one `lax.scan`, the grads added into `zeros` (in their
    dtype: the accumulation's). Micro-batch k is rows k·m .. (k+1)·m - 1 of each of `shards`
    contiguous blocks of the rows (m = rows / shards / steps): a batch shard's own rows, so no
    row moves between devices. Returns the values stacked over the micro-batches
    (`over_micro_batches` reduces them), the grads' sum and the last carry."""

    def split(x):
        m = x.shape[0] // (shards * steps)
        return x.reshape(shards, steps, m, *x.shape[1:]).swapaxes(0, 1).reshape(steps, shards * m, *x.shape[1:])

    def body(sums_and_carry, micro):
        sums, carry = sums_and_carry
        value, grads, carry = micro_step(carry, micro)
        return (jax.tree.map(lambda s, g: s + g.astype(s.dtype), sums, grads), carry), value

    (grads, carry), values = jax.lax.scan(body, (zeros, carry), jax.tree.map(split, batch))
    return values, grads, carry


def over_micro_batches(values):
    """A loss (and metrics) stacked over equal micro-batches (`accumulate`): the mean of each, the
    sum of each `Summed` one."""
    return jax.tree.map(lambda x: Summed(x.value.sum(0)) if _is_summed(x) else x.mean(0), values, is_leaf=_is_summed)


def unmarked(value):
    """`value` with each `Summed` metric replaced by its number (the compiler-placed step's loss
    sees the global batch, so its sums are already whole)."""
    return jax.tree.map(lambda x: x.value if _is_summed(x) else x, value, is_leaf=_is_summed)


def split_loss(out, has_aux: bool):
    """(loss, metrics) of what a loss function returned: with `has_aux` a (loss, metrics) pair
    whose metrics are scalars (as float32, to be averaged, or `Summed`); without it the loss alone (metrics
    None). Anything else: one ShardingError that says what to change."""
    if not has_aux:
        if isinstance(out, (tuple, list, dict)):
            raise ShardingError(
                f"build_step: the loss returned a {type(out).__name__}, not one scalar. Fix: for (loss, metrics), "
                "build_step(..., has_aux=True); else return the loss alone.")
        return out, None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ShardingError(f"build_step(has_aux=True): the loss returned a {type(out).__name__}, not (loss, "
                            "metrics). Fix: return loss, {'accuracy': accuracy}, or drop has_aux.")
    loss, metrics = out
    for path, x in jax.tree_util.tree_leaves_with_path(metrics):
        if jnp.ndim(x) != 0:
            raise ShardingError(
                f"build_step(has_aux=True): metric {jax.tree_util.keystr(path) or 'metrics'} has shape "
                f"{jnp.shape(x)}, not a scalar. Fix: reduce it in the loss (its mean over the batch), as the loss is.")
    return loss, jax.tree.map(lambda x: jnp.asarray(x).astype(jnp.float32), metrics)
