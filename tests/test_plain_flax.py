"""Models of plain Flax layers (`nnx.Linear`, `nnx.Conv`, `nnx.BatchNorm`, `nnx.Dropout`,
`nnx.MultiHeadAttention`, ... as the Flax docs write them) in jshard's explicit step: every
preset gives one device's numbers, batch statistics synced, dropout drawn per batch shard,
both carried through checkpoints; never a silently wrong number.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jshard
from flax_models import (CNN, MLP, MODELS, StackedTransformer, Transformer, classification_loss, image_batches, mse_loss,
                         next_token_loss, regression_batches, stacked_loss, token_batches)
from jshard.app.checkpoint import Checkpoints
from jshard.parallel import build_step
from meshes import EXPERT_STRATEGIES, STRATEGIES
from parity import (SGD_MOMENTUM, TOLERANCE, assert_trains_like_one_device, assert_trees_close, relative_error, train,
                    train_on_one_device)
from seed import SEED

# The presets. dp+tp+sp is left out: nothing of a plain model's is named seq, so it compiles
# dp+tp's program (the last test here trains a plain model under sp; its rules' seq fallback: test_rules).
PRESETS = [
    ("dp", dict(data=8)), ("zero1", dict(fsdp=8)), ("zero2", dict(fsdp=8)), ("zero3", dict(fsdp=8)),
    ("dp+tp", dict(data=2, tensor=4)), ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2)),
]


# SGD, not Adam: Adam scales a near-zero gradient (a norm's bias) to a full step, so float
# noise in it would decide the sign of a param's update; SGD keeps param errors as small as
# the gradients'.
OPTIMIZER = SGD_MOMENTUM


# (model, preset, mesh sizes, micro-batches): the CNN and the transformer under every preset,
# the MLP under a data, a ZeRO-3 and a tensor-parallel layout; the stacked transformer where
# its stack matters: ZeRO-3's per-layer gathers, and pipelines. MiniGPT is left out under zero1
# and zero2: the transformer's and the CNN's take that path, and its named biases are minigpt-zero3's.
CASES = [(name, preset, sizes, None) for name in ("mlp", "cnn", "transformer", "minigpt") for preset, sizes in PRESETS
         if (name != "mlp" or preset in ("dp", "zero3", "dp+fsdp+tp"))
         and not (name == "minigpt" and preset in ("zero1", "zero2"))] + [
    ("user scan", preset, sizes, None) for preset, sizes in PRESETS if preset in ("zero2", "zero3", "dp+fsdp+tp")] + [
    ("stacked transformer", "zero3", dict(fsdp=8), None),
    ("stacked transformer", "dp+pp", dict(data=2, stage=4), 2),
    ("stacked transformer", "fsdp+tp+pp", dict(fsdp=2, tensor=2, stage=2), 2),
]


class ShapeReadingMLP(MLP):
    def __call__(self, x):
        # What plain code sees of a split param's shape: the whole param's.
        assert self.up.kernel.shape == (16, 64) and self.down.kernel.ndim == 2, self.up.kernel.shape
        return super().__call__(x)


@pytest.mark.parametrize("name, preset, sizes, microbatches", CASES, ids=[f"{n}-{p}" for n, p, _, _ in CASES])
def test_plain_flax_model_matches_one_device(name, preset, sizes, microbatches):
    """Losses, params and batch statistics after 3 steps, as on one device (dropout off:
    the per-shard draws are tested below). The MLP reads its params' shapes as it runs: a
    split param's is the whole param's."""
    make, loss_fn, batches = (ShapeReadingMLP, mse_loss, regression_batches) if name == "mlp" else MODELS[name]
    extra = dict(dropout=0.0) if name in ("mlp", "cnn") else {}
    run = train_on_one_device(make(nnx.Rngs(SEED), **extra), OPTIMIZER, loss_fn, batches(SEED, 3))
    step = build_step(make(nnx.Rngs(SEED), **extra), OPTIMIZER, loss_fn,
                      jshard.Layout.of(preset, sizes, microbatches=microbatches))
    assert_trains_like_one_device(step, run, f"{name} {preset}")


@pytest.mark.parametrize("name", ["unnamed cnn", "unnamed transformer", "unnamed minigpt"])
@pytest.mark.parametrize("preset", ["zero1", "zero2", "zero3"])
def test_zero_splits_params_without_names_by_itself(name, preset):
    """ZeRO needs no names (as PyTorch FSDP): each unnamed param split on its largest dim that
    divides, and the run is one device's."""
    make, loss_fn, batches = MODELS[name]
    run = train_on_one_device(make(nnx.Rngs(SEED)), OPTIMIZER, loss_fn, batches(SEED, 3))
    step = build_step(make(nnx.Rngs(SEED)), OPTIMIZER, loss_fn, jshard.Layout.of(preset, dict(fsdp=8)))
    assert_trains_like_one_device(step, run, f"{name} {preset}")
    flags = {p.path: p.flags for p in step.describe(batches(SEED, 1)[0]).rows}
    kernel, dim = {"unnamed cnn": ("conv1/kernel", 3), "unnamed transformer": ("up/kernel", 1),
                   "unnamed minigpt": ("transformer_blocks/0/linear1/kernel", 1)}[name]
    where = "" if preset == "zero3" else "optimizer state: "
    assert f"{where}no logical names: split by itself over fsdp on dim {dim} (ZeRO)" in flags[kernel], flags[kernel]


# Left out, as the tests above compile their programs and train them like one device: the unnamed
# models under ZeRO, the user scan under zero2, zero3 and dp+fsdp+tp; and the user scan's dp+tp+sp and
# dp+fsdp+tp+sp, which compile its dp+tp and dp+fsdp+tp programs (nothing named seq). Every refusal stays.
TRAINED_ABOVE = {(name, preset) for name in ("unnamed cnn", "unnamed transformer", "unnamed minigpt")
                 for preset in ("zero1", "zero2", "zero3")} | {
    ("user scan", preset) for preset in ("zero2", "zero3", "dp+fsdp+tp", "dp+tp+sp", "dp+fsdp+tp+sp")}
FIRST_CONTACT = [(name, preset, sizes) for name in ("unnamed cnn", "unnamed transformer", "unnamed minigpt", "user scan")
                 for preset, sizes in STRATEGIES + EXPERT_STRATEGIES if (name, preset) not in TRAINED_ABOVE]


@pytest.mark.parametrize("name, preset, sizes", FIRST_CONTACT, ids=[f"{n}-{p}" for n, p, _ in FIRST_CONTACT])
def test_a_plain_model_under_any_preset_trains_or_gets_one_sharding_error(name, preset, sizes):
    """First contact: a model as a user writes it either takes its first step or is refused by
    one jshard error with a Fix, never an exception from deep inside Flax or JAX."""
    make, loss_fn, batches = MODELS[name]
    try:
        step = build_step(make(nnx.Rngs(0)), OPTIMIZER, loss_fn, jshard.Layout.of(preset, sizes))
        state, loss = step(step.state, step.shard_batch(batches(0, 1)[0]))
    except jshard.ShardingError as e:
        assert "Fix:" in str(e), str(e)
    else:
        assert np.isfinite(float(loss))


def test_tensor_parallelism_still_needs_names_and_says_which():
    with pytest.raises(jshard.ShardingError, match=r"param 'conv1/kernel' \(shape \(3, 3, 1, 8\)\) has no logical axis "
                                                   r"names, but rules 'dp\+zero3\+tp' shard params over tensor"):
        build_step(MODELS["unnamed cnn"][0](nnx.Rngs(0)), OPTIMIZER, classification_loss,
                   jshard.Layout.of("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2)))


def test_describe_lists_the_params_a_plain_layer_reads_whole():
    step = build_step(MLP(nnx.Rngs(0)), OPTIMIZER, mse_loss,
                      jshard.Layout.of("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2)))
    flags = {p.path: p.flags for p in step.describe(regression_batches(0, 1)[0]).rows}
    assert any("read whole by a plain layer" in f and "gathered over tensor" in f for f in flags["up/kernel"])
    assert "no logical names: split by itself over fsdp on dim 0 (ZeRO)" in flags["up/bias"]  # (not over tensor)
    # Under ZeRO-3 alone a whole read gathers what jshard.nn gathers too: nothing to flag.
    step = build_step(MLP(nnx.Rngs(0)), OPTIMIZER, mse_loss, jshard.Layout.of("zero3", dict(fsdp=8)))
    report = step.describe(regression_batches(0, 1)[0])
    assert step.whole_reads == {"up/kernel": ("fsdp",), "down/kernel": ("fsdp",), "up/bias": ("fsdp",),
                                "down/bias": ("fsdp",)}  # (the biases split by ZeRO with no names)
    assert not any("read whole" in f for p in report.rows for f in p.flags), str(report)


def loss_with_a_key_of_its_own(model, batch):
    """One Flax tutorial's dropout: a key made inside the loss, a constant of the program."""
    images, labels = batch
    logits = nnx.Dropout(0.5)(model(images), rngs=nnx.Rngs(dropout=1))
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1))


@pytest.mark.parametrize("loss_fn, sizes, warned", [
    (loss_with_a_key_of_its_own, dict(data=8), True),
    (loss_with_a_key_of_its_own, dict(fsdp=8), True),  # ZeRO's axes split the batch too
    (loss_with_a_key_of_its_own, dict(tensor=8), False),  # one batch shard: one device's run
    (classification_loss, dict(data=8), False),  # the model's own stream, folded per batch shard
])
def test_describe_warns_of_a_random_key_the_loss_makes_from_a_constant(loss_fn, sizes, warned):
    rules = jshard.preset("dp" if "data" in sizes else "zero3" if "fsdp" in sizes else "dp+tp")
    step = build_step(CNN(nnx.Rngs(0)), OPTIMIZER, loss_fn, jshard.Layout.of(rules, sizes))
    report = step.describe(image_batches(0, 1)[0])
    assert ("! the loss makes a random key from a constant" in str(report)) == warned, str(report)


class EveryReadMLP(MLP):
    """Reads its kernels every way Flax's Variable supports; each read must be the whole param."""

    def __call__(self, x):
        up, down = self.up.kernel, self.down.kernel
        assert len(up) == 16 and len(up.value) == 16 and up.size == 16 * 64 and len(down) == 64
        rows = jnp.stack(list(up))  # iteration: the rows of the whole kernel
        hidden = jax.nn.relu(x @ rows + self.up.bias[...])
        # Four more spellings of the same matrix, and operators on both sides of it.
        w = (down.value + jnp.asarray(down) + down.T.T + down.reshape(64, 16)) / 4
        w = (2.0 * w - down) * (len(down) / 64) + abs(-down) * 0 - (down - down)
        return hidden @ w + self.down.bias[...] + (up.sum() - up.value.sum())


@pytest.mark.parametrize("preset, sizes", [("zero2", dict(fsdp=8)), ("zero3", dict(fsdp=8)),
                                           ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2))])
def test_every_read_of_a_split_param_gets_the_whole_param(preset, sizes):
    run = train_on_one_device(EveryReadMLP(nnx.Rngs(SEED)), OPTIMIZER, mse_loss, regression_batches(SEED, 2))
    step = build_step(EveryReadMLP(nnx.Rngs(SEED)), OPTIMIZER, mse_loss, jshard.Layout.of(preset, sizes))
    assert_trains_like_one_device(step, run, preset)


def loss_and_accuracy(model, batch):
    """The classification loss, and the accuracy beside it: a loss that returns metrics."""
    images, labels = batch
    logits = model(images)
    loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1))
    right = jnp.argmax(logits, -1) == labels
    return loss, {"accuracy": jnp.mean(right), "mean_logit": logits.mean(), "correct": jshard.summed(jnp.sum(right))}


@pytest.mark.parametrize("preset, sizes, collectives", [
    ("dp", dict(data=8), "explicit"), ("zero3", dict(fsdp=8), "explicit"),
    ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2), "explicit"), ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2), "compiler")])
def test_a_loss_that_returns_metrics_trains_and_returns_them(preset, sizes, collectives):
    """`has_aux=True`: the step returns (loss, metrics), each the one-device value on the global batch:
    averaged over the batch shards as the loss is, or added up where the loss marks it `jshard.summed`."""
    batches = image_batches(SEED, 3)
    one = CNN(nnx.Rngs(SEED), dropout=0.0)
    step = build_step(CNN(nnx.Rngs(SEED), dropout=0.0), OPTIMIZER, loss_and_accuracy, jshard.Layout.of(preset, sizes),
                      collectives=collectives, has_aux=True)
    state, reference = step.state, train_on_one_device(one, OPTIMIZER, classification_loss, batches)
    for batch, expected_loss in zip(batches, reference.losses):
        evaluated_loss, evaluated = step.loss(state, step.shard_batch(batch))
        state, (loss, metrics) = step(state, step.shard_batch(batch))
        assert relative_error(loss, expected_loss) < TOLERANCE and float(evaluated_loss) == pytest.approx(float(loss))
        assert set(metrics) == {"accuracy", "mean_logit", "correct"}
        assert {k: float(v) for k, v in metrics.items()} == pytest.approx({k: float(v) for k, v in evaluated.items()})
    # The metrics of the last batch, as one device computes them with the params before its step.
    before = CNN(nnx.Rngs(SEED), dropout=0.0)
    nnx.update(before, train_on_one_device(CNN(nnx.Rngs(SEED), dropout=0.0), OPTIMIZER, classification_loss,
                                           batches[:-1]).state)
    expected = loss_and_accuracy(before, batches[-1])[1]
    assert float(metrics["accuracy"]) == pytest.approx(float(expected["accuracy"]))
    assert float(metrics["correct"]) == float(expected["correct"].value) == float(expected["accuracy"]) * len(batches[-1][1])
    assert float(metrics["mean_logit"]) == pytest.approx(float(expected["mean_logit"]), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("loss_fn, has_aux, sizes, message", [
    (loss_and_accuracy, False, dict(data=8), "the loss returned a tuple, not one scalar. Fix: for \\(loss, metrics\\), "
                                             "build_step\\(..., has_aux=True\\)"),
    (lambda m, b: (classification_loss(m, b), m(b[0])), True, dict(data=8), "metric metrics has shape \\(2, 10\\)"),
    (classification_loss, True, dict(data=8), "the loss returned a ArrayImpl|Tracer|not \\(loss, metrics\\)"),
])
def test_a_loss_with_metrics_that_does_not_fit_gets_one_error(loss_fn, has_aux, sizes, message):
    step = build_step(CNN(nnx.Rngs(0), dropout=0.0), OPTIMIZER, loss_fn, jshard.Layout.of("dp", sizes), has_aux=has_aux)
    with pytest.raises(jshard.ShardingError, match=message):
        step(step.state, step.shard_batch(image_batches(0, 1)[0]))


@pytest.mark.parametrize("make, loss_fn, has_aux, message", [
    (StackedTransformer, lambda model, batch: stacked_loss(model, batch), False,
     "the loss '<lambda>' is a plain function: a pipeline needs a jshard.models.StagedLoss"),
    (StackedTransformer, stacked_loss, True, "build_step\\(has_aux=True\\): rules 'dp\\+pp' pipeline the layers"),
    (Transformer, stacked_loss, False, "no param of the model has a 'layers' dim to split: its blocks are separate "
                                       "modules \\(a list, nnx.Sequential\\). Fix: stack them"),
])
def test_a_pipeline_names_what_its_model_or_loss_lacks(make, loss_fn, has_aux, message):
    with pytest.raises(jshard.ShardingError, match=message):
        build_step(make(nnx.Rngs(0)), OPTIMIZER, loss_fn,
                   jshard.Layout.of("dp+pp", dict(data=4, stage=2), microbatches=4), has_aux=has_aux)


def fold_keys(model, shard: int):
    """`model` with each RNG key folded with `shard`: the stream batch shard `shard` draws from."""
    keys = nnx.state(model, nnx.RngKey)
    nnx.update(model, jax.tree.map(lambda k: jax.random.fold_in(k, shard), keys))
    return model


@pytest.mark.parametrize("preset, sizes", [("dp", dict(data=8)), ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2))])
def test_dropout_draws_from_the_stream_of_each_batch_shard(preset, sizes):
    """The step's loss and gradients with dropout equal plain Flax's on each batch shard with
    its own stream, fold_in(key, shard), averaged: each shard drops other positions."""
    batch = regression_batches(SEED, 1)[0]
    step = build_step(MLP(nnx.Rngs(SEED), dropout=0.5), OPTIMIZER, mse_loss, jshard.Layout.of(preset, sizes))
    loss, grads = step.value_and_grad(step.state, step.shard_batch(batch))
    shards = step.data_shards
    rows = len(batch[0]) // shards
    per_shard = [nnx.value_and_grad(mse_loss)(fold_keys(MLP(nnx.Rngs(SEED), dropout=0.5), i),
                                              (batch[0][i * rows:(i + 1) * rows], batch[1][i * rows:(i + 1) * rows]))
                 for i in range(shards)]
    want_loss = np.mean([float(l) for l, _ in per_shard])
    assert relative_error(loss, want_loss) <= TOLERANCE, f"{preset}: {float(loss)} vs {want_loss} (seed {SEED})"
    assert_trees_close(grads, jax.tree.map(lambda *g: np.mean(g, axis=0), *[g for _, g in per_shard]),
                       f"{preset}: gradient")
    # And the shards' draws differ: shard 0's stream alone gives another loss.
    assert abs(float(per_shard[0][0]) - float(per_shard[1][0])) > 0 and not np.isclose(
        float(loss), float(nnx.value_and_grad(mse_loss)(MLP(nnx.Rngs(SEED), dropout=0.5), batch)[0]))


@pytest.mark.parametrize("preset, sizes", [("dp", dict(data=8)), ("dp+fsdp", dict(data=2, fsdp=4))])
def test_cnn_with_batch_norm_and_dropout_trains_and_resumes_exactly(preset, sizes, tmp_path):
    """The docs' CNN learns under dp and fsdp; its batch statistics and dropout stream
    survive a checkpoint: saved after 2 steps, restored after 12 into the same step (one
    program), 2 more steps are the uninterrupted run's steps 3 and 4."""
    data = image_batches(SEED, 1) * 12  # one batch, again and again: the loss must fall
    step = build_step(CNN(nnx.Rngs(SEED)), optax.adam(1e-2), classification_loss, jshard.Layout.of(preset, sizes))
    state, losses = step.state, []
    for i, batch in enumerate(data):
        state, loss = step(state, step.shard_batch(batch))
        losses.append(float(loss))
        if i == 1:
            with Checkpoints(tmp_path) as checkpoints:  # written before the next step donates `state`
                checkpoints.save(2, state, {"step": 2})
    assert losses[-1] < 0.5 * losses[0], f"{preset}: {losses} (seed {SEED})"
    model = step.model(state)
    assert int(model.dropout.rngs.count[...]) == len(data)  # one draw per step, as on one device
    assert np.abs(np.asarray(model.bn1.mean[...])).sum() > 0  # the running statistics moved

    # Restored over the state of step 12 (its count and statistics are further on): only the
    # checkpoint's can give steps 3 and 4 again.
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    with Checkpoints(tmp_path) as checkpoints:
        step.state = checkpoints.restore(2, like)
    assert int(step.model(step.state).dropout.rngs.count[...]) == 2
    _, after = train(step, data[2:4])
    np.testing.assert_allclose(after, losses[2:4], rtol=1e-6)


class CountedMLP(MLP):
    """Counts its calls in a Variable of its own: written alike on every device."""

    def __init__(self, rngs: nnx.Rngs):
        super().__init__(rngs)
        self.calls = nnx.Variable(np.zeros((), np.int32))

    def __call__(self, x):
        self.calls[...] += 1
        return super().__call__(x)


def test_any_variable_the_model_writes_is_carried_through_steps():
    step = build_step(CountedMLP(nnx.Rngs(0)), OPTIMIZER, mse_loss,
                      jshard.Layout.of("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2)))
    state, _ = train(step, regression_batches(0, 3))
    assert int(step.model(state).calls[...]) == 3


class BatchMean(nnx.Module):
    """Keeps the mean of the last batch it saw: a Variable written from each device's rows."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(16, 16, rngs=rngs)
        self.seen = nnx.BatchStat(np.zeros(16, np.float32))

    def __call__(self, x):
        self.seen[...] = x.mean(0)
        return self.linear(x)


def test_state_written_from_one_shard_is_refused():
    step = build_step(BatchMean(nnx.Rngs(0)), OPTIMIZER, mse_loss, jshard.Layout.of("dp", dict(data=8)))
    with pytest.raises(jshard.ShardingError, match=r"model Variable 'seen' \(BatchStat\) came out of the step "
                                                   r"different on each device of data"):
        step(step.state, step.shard_batch(regression_batches(0, 1)[0]))


def test_state_under_a_pipeline_is_refused():
    with pytest.raises(jshard.ShardingError, match=r"holds Variables other than Params \(bn1/mean, bn1/var, "
                                                   r"bn2/mean.*pipeline its layers over stage"):
        build_step(CNN(nnx.Rngs(0)), OPTIMIZER, classification_loss,
                   jshard.Layout.of("dp+pp", dict(data=2, stage=4), microbatches=2))


def test_a_transformer_of_plain_layers_trains_under_every_axis():
    """Beyond parity: 10 steps of dp+fsdp+tp+sp on one repeated batch fit it."""
    step = build_step(Transformer(nnx.Rngs(SEED)), optax.adam(3e-3), next_token_loss,
                      jshard.Layout.of("dp+fsdp+tp+sp", dict(data=2, fsdp=2, tensor=2)))
    _, losses = train(step, token_batches(SEED, 1) * 10)
    assert losses[-1] < 0.7 * losses[0], f"{losses} (seed {SEED})"
