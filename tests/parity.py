"""The one-device parity harness: what a sharded step is compared against, and how.

A step is right when its loss, gradients and state equal plain Flax NNX's and optax's on one
device to float round-off: `TOLERANCE` relative, per Variable (Frobenius norm). Every failure
names the seed (tests/seed.py), so that a fuzzed failure can be replayed.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jshard.placement import value_of
from seed import SEED

TOLERANCE = 1e-5  # fp32 against one device
BF16_TOLERANCE = 2e-2  # bf16 compute against fp32 on one device: 8 bits of mantissa

# Adam divides each gradient element by sqrt(v) + eps, so the float round-off of an
# element near zero (|g| ~ 1e-7: some key-projection and norm weights) is blown up into
# its update: with optax's eps=1e-8, params drift apart by ~1e-5 although every gradient
# agrees to ~1e-7 (checked directly by the gradient comparisons). eps=1e-4 bounds that
# gain; it is still AdamW.
OPTIMIZER = optax.adamw(1e-3, eps=1e-4)
# For models whose params get near-zero gradients that even eps=1e-4 would scale up (a
# BatchNorm's or LayerNorm's bias in plain Flax models): SGD keeps param errors as small as
# the gradients'.
SGD_MOMENTUM = optax.sgd(0.03, momentum=0.9)


def recording(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx`, keeping the gradient it is given in its state (`opt_state[0]`, laid out as the rest of
    the optimizer's state): a step's own gradient, the one its update applied, to be read after
    the step (`assert_trains_like_one_device(..., first_gradient=True)`). A test of both gradient and training then compiles the
    step alone, where `step.value_and_grad` is a second program of about the step's cost."""
    keep = optax.GradientTransformation(init=lambda params: jax.tree.map(jnp.zeros_like, params),
                                        update=lambda grads, state, params=None: (grads, grads))
    return optax.chain(keep, tx)


ZERO = 1e-6  # below this everywhere, a float leaf of the one-device run is zero but for rounding


def relative_error(a, b) -> float:
    """|a - b| / |b| (Frobenius norms, in float64)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def assert_trees_close(actual: nnx.State, expected: nnx.State, what: str, tolerance: float = TOLERANCE):
    """The same Variables; float leaves to `tolerance` relative, integer leaves (RNG counts)
    and RNG keys exactly."""
    flat_expected = dict(nnx.to_flat_state(expected))
    flat_actual = nnx.to_flat_state(actual)
    assert {p for p, _ in flat_actual} == set(flat_expected), f"{what}: other Variables (seed {SEED})"
    for path, variable in flat_actual:
        got, want = value_of(variable), value_of(flat_expected[path])
        where = f"{what} {'/'.join(map(str, path))}"
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        if jax.dtypes.issubdtype(want.dtype, np.inexact) and np.abs(np.asarray(want, np.float64)).max(initial=0) < ZERO:
            # Zero but for rounding on one device (an attention key's bias: softmax ignores it, so its
            # gradient is zero): rounding noise on both sides, equal only in being that small.
            error = float(np.abs(np.asarray(got, np.float64)).max(initial=0))
            assert error < ZERO, f"{where}: {error:.2e} where one device keeps it within {ZERO} of zero (seed {SEED})"
        elif jax.dtypes.issubdtype(want.dtype, np.inexact):
            error = relative_error(got, want)
            assert error <= tolerance, f"{where}: relative error {error:.2e} (seed {SEED})"
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{where} (seed {SEED})")


def assert_losses_close(losses, expected, what: str = "", tolerance: float = TOLERANCE):
    """Step by step, each loss to `tolerance` relative."""
    assert len(losses) == len(expected), (losses, expected)
    where = f"{what}: " if what else ""
    for i, (got, want) in enumerate(zip(losses, expected)):
        error = relative_error(got, want)
        assert error <= tolerance, f"{where}loss of step {i}: {float(got)} vs {float(want)} (seed {SEED})"


# -- one device ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OneDeviceRun:
    """Plain Flax NNX and optax on one device, one optimizer step per batch."""

    batches: list
    losses: list[float]  # one per step
    grads: nnx.State  # the first step's: the first batch's at the initial params
    state: nnx.State  # the model's after the last step

    @property
    def loss(self) -> float:
        return self.losses[0]


@nnx.jit(static_argnames="loss_fn")
def _train_step(model, optimizer, batch, loss_fn):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss, grads


def train_on_one_device(model: nnx.Module, tx, loss_fn, batches) -> OneDeviceRun:
    """One optimizer step per batch on `model` (updated in place). One jitted step for every
    caller: a model and optimizer of the same structure, loss and batch shapes reuse its compile."""
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    losses, first_grads = [], None
    for batch in batches:
        loss, grads = _train_step(model, optimizer, batch, loss_fn)
        losses.append(float(loss))
        first_grads = grads if first_grads is None else first_grads
    return OneDeviceRun(list(batches), losses, first_grads, nnx.state(model))


@nnx.jit(static_argnames="loss_fn")
def _value_and_grad(model, batch, loss_fn):
    return nnx.value_and_grad(loss_fn)(model, batch)


def one_device_gradients(model: nnx.Module, loss_fn, batch) -> tuple[float, nnx.State]:
    """The loss and gradients of `loss_fn` on one device. `model` is left as it was (a clone
    computes them: a forward moves BatchNorm statistics and RNG counts). Jitted, as the
    training reference is: one program, where op by op each primitive of each shape was a
    compilation of its own (the suite's eager slices and scans)."""
    loss, grads = _value_and_grad(nnx.clone(model), batch, loss_fn)
    return float(loss), grads


# -- the sharded step ---------------------------------------------------------------------------


def train(step, batches, state=None) -> tuple:
    """One step per batch from `state` (by default the step's initial state): the final state and
    the losses."""
    state, losses = step.state if state is None else state, []
    for batch in batches:
        state, loss = step(state, step.shard_batch(batch))
        losses.append(float(loss))
    return state, losses


def assert_gradients_close(step, batch, expected_loss: float, expected_grads: nnx.State,
                           tolerance: float = TOLERANCE) -> tuple:
    """The step's loss and gradients on `batch` (from its initial state) are the expected
    ones, e.g. `one_device_gradients(...)`'s; they are returned for further checks."""
    loss, grads = step.value_and_grad(step.state, step.shard_batch(batch))
    error = relative_error(loss, expected_loss)
    assert error <= tolerance, f"loss {float(loss)} vs {float(expected_loss)}: relative error {error:.2e} (seed {SEED})"
    assert_trees_close(grads, expected_grads, "gradient", tolerance)
    return loss, grads


def model_state(step, state) -> nnx.State:
    """Every Variable of the model the step holds in `state`, in model order."""
    return nnx.state(step.model(state))


def assert_trains_like_one_device(step, run: OneDeviceRun, what: str = "", tolerance: float = TOLERANCE,
                                  state_of=model_state, first_gradient: bool = False):
    """The step, one step per batch of `run`: each loss, then `state_of(step, state)` (by
    default the model's every Variable) equal the run's. `first_gradient` (a step built with
    `recording(tx)`, the run with plain `tx`): the gradient its first update applied equals the
    run's too. Returns the step's last state."""
    where = f"{what}{': ' if what else ''}"
    state, losses = train(step, run.batches[:1])
    if first_gradient:
        grads = jax.device_get(step.to_model_order(state).opt_state[0])  # before the next step donates it
        assert_trees_close(grads, run.grads, f"{where}gradient", tolerance)
    state, more = train(step, run.batches[1:], state)
    assert_losses_close(losses + more, run.losses, what, tolerance)
    assert_trees_close(state_of(step, state), run.state, f"{where}after {len(run.batches)} steps", tolerance)
    return state
