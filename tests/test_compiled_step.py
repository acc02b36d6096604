"""The compiler-placed step (`build_step(..., collectives="compiler")`) against one device.

Parity (tests/parity.py) on every non-pipeline preset: a GPT's loss each step and params after
3 AdamW steps; the Flax docs' CNN (`flax_models.CNN`: Conv, BatchNorm, Dropout, Linear), 3
SGD-momentum steps with dropout on, including its BatchNorm running statistics and its RNG
stream's count. Then the refusals, and the state through an orbax checkpoint.
"""

import jax
import numpy as np
import pytest
from flax import nnx

import jshard
from jshard.app.checkpoint import Checkpoints
from jshard.models import GPT, GPTConfig, gpt_loss
from jshard.parallel import CompiledStep, TrainState, build_step
from flax_models import CNN, classification_loss, image_batches
from meshes import STRATEGIES
from parity import (OPTIMIZER, SGD_MOMENTUM, assert_gradients_close, assert_trains_like_one_device,
                    one_device_gradients, train_on_one_device)
from seed import SEED

# The CNN's BatchNorm biases get near-zero gradients, whose round-off Adam would scale up to
# whole updates (as in tests/test_plain_flax.py): SGD keeps param errors as small as the gradients'.
CNN_OPTIMIZER = SGD_MOMENTUM
STEPS = 3
# Collective matmuls are the explicit step's (refused here: test_collective_matmuls_are_refused).
COMPILER_STRATEGIES = [(p, s) for p, s in STRATEGIES if not jshard.preset(p).collective_matmul]
IDS = [p for p, _ in COMPILER_STRATEGIES]


def check_against_one_device(make, loss_fn, batches, preset, sizes, tx):
    """The compiler-placed step from `make()` trains as one device does: losses, then every
    Variable (params, BatchNorm statistics, RNG keys and counts). Returns the step and its state."""
    run = train_on_one_device(make(), tx, loss_fn, batches)
    step = build_step(make(), tx, loss_fn, jshard.Layout.of(preset, sizes), collectives="compiler")
    assert isinstance(step, CompiledStep)
    return step, assert_trains_like_one_device(step, run, preset)


# -- a GPT of jshard.nn layers ----------------------------------------------------------------

GPT_CONFIG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, mlp=64, layers=2)


def make_gpt():
    return GPT(GPT_CONFIG, rngs=nnx.Rngs(SEED))


def gpt_batches(count=STEPS):
    rng = np.random.default_rng(SEED)
    return [rng.integers(0, GPT_CONFIG.vocab, (8, GPT_CONFIG.seq_len + 1)) for _ in range(count)]


@pytest.mark.parametrize("preset, sizes", COMPILER_STRATEGIES, ids=IDS)
def test_gpt_matches_one_device(preset, sizes):
    check_against_one_device(make_gpt, gpt_loss, gpt_batches(), preset, sizes, OPTIMIZER)


# -- a CNN as the Flax NNX docs write it, with BatchNorm and Dropout ---------------------------


def make_cnn():
    return CNN(nnx.Rngs(SEED))  # the Flax docs' CNN (tests/flax_models.py), dropout on


def cnn_batches(count=STEPS):
    return image_batches(SEED, count)


cnn_loss = classification_loss


# The CNN's BatchNorm and dropout under a data, a ZeRO and a tensor-parallel layout (the GPT
# above runs every strategy). ReLU has a kink: with JSHARD_TEST_SEED=646738246 one bn2 output is
# 8e-8, and any other summation order (a sharded batch, or the same batch permuted on one device)
# flips its ReLU derivative, moving every gradient below it by 1-3e-2. That seed tests the kink,
# not the step; the fixed seed has no pre-ReLU value within 1e-6 of zero.
CNN_STRATEGIES = [(p, s) for p, s in STRATEGIES if p in ("dp", "zero1", "zero3", "dp+fsdp+tp")]


@pytest.mark.parametrize("preset, sizes", CNN_STRATEGIES, ids=[p for p, _ in CNN_STRATEGIES])
def test_cnn_with_batch_norm_and_dropout_matches_one_device(preset, sizes):
    """Under jit BatchNorm sees the global batch and dropout draws the global mask from the
    model's key: the same numbers as one device, running statistics and RNG count included."""
    step, state = check_against_one_device(make_cnn, cnn_loss, cnn_batches(), preset, sizes, CNN_OPTIMIZER)
    model = step.model(state)
    assert int(model.dropout.rngs.count.get_value()) == STEPS
    assert float(jax.numpy.abs(model.bn1.mean.get_value()).sum()) > 0  # the statistics did move


def test_gradients_come_out_in_the_opt_layout():
    """ZeRO-1: params whole on every device, their gradients split like the optimizer state."""
    batch = cnn_batches(1)[0]
    mesh, rules = jshard.make_mesh(data=2, fsdp=4), jshard.preset("dp+zero1")
    step = build_step(make_cnn(), OPTIMIZER, cnn_loss, jshard.Layout.of(rules, mesh), mesh, collectives="compiler")
    _, step_grads = assert_gradients_close(step, batch, *one_device_gradients(make_cnn(), cnn_loss, batch))
    kernel = step_grads["conv2"]["kernel"].get_value()  # named (None, None, mlp, embed)
    assert kernel.sharding.spec == jax.P(None, None, None, "fsdp")
    assert step.state.params["conv2"]["kernel"].get_value().sharding.is_fully_replicated


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset, sizes", [("dp+pp", dict(data=2, stage=4)),
                                           ("fsdp+tp+pp", dict(fsdp=2, tensor=2, stage=2))])
def test_pipeline_rules_are_refused(preset, sizes):
    with pytest.raises(jshard.ShardingError, match="compiler-placed step does not pipeline.*explicit step"):
        build_step(make_gpt(), OPTIMIZER, gpt_loss, jshard.Layout.of(preset, sizes), collectives="compiler")


def test_pipeline_arguments_are_refused():
    with pytest.raises(jshard.ShardingError, match="microbatches=4.*does not pipeline"):
        build_step(make_gpt(), OPTIMIZER, gpt_loss, jshard.Layout.of("dp", dict(data=8), microbatches=4),
                   collectives="compiler")


def test_collective_matmuls_are_refused():
    with pytest.raises(jshard.ShardingError, match="collective matmuls.*explicit step.*'sp' in place of 'sp-overlap'"):
        build_step(make_gpt(), OPTIMIZER, gpt_loss, jshard.Layout.of("dp+sp-overlap", dict(data=2, tensor=4)),
                   collectives="compiler")


def test_unknown_collectives_are_refused():
    with pytest.raises(jshard.ShardingError, match="collectives='bogus'.*'explicit'.*'compiler'"):
        build_step(make_gpt(), OPTIMIZER, gpt_loss, jshard.Layout.of("dp", dict(data=8)), collectives="bogus")


class Unnamed(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


def test_bad_rules_raise_the_explicit_steps_error():
    def refusal(collectives):
        with pytest.raises(jshard.ShardingError) as refused:
            build_step(Unnamed(nnx.Rngs(0)), OPTIMIZER, cnn_loss, jshard.Layout.of("tp", dict(tensor=8)),
                       collectives=collectives)
        return str(refused.value)

    message = refusal("compiler")
    assert "param 'linear/kernel' (shape (16, 16)) has no logical axis names" in message, message
    assert message == refusal("explicit")


def test_batch_that_does_not_split_is_refused():
    step = build_step(make_cnn(), OPTIMIZER, cnn_loss, jshard.Layout.of("dp", dict(data=8)), collectives="compiler")
    images, labels = cnn_batches(1)[0]
    with pytest.raises(jshard.ShardingError, match=r"batch size 12 does not split over 8 batch shards \(data\) = 8"):
        step.shard_batch((images[:12], labels[:12]))


# -- checkpoints -------------------------------------------------------------------------------


def test_state_round_trips_through_a_checkpoint_and_training_continues(tmp_path):
    """Params, AdamW state, BatchNorm statistics and the RNG stream (key data, count) are all
    saved; the restored state trains on exactly as the state that was saved."""
    batches = cnn_batches(3)
    step = build_step(make_cnn(), OPTIMIZER, cnn_loss, jshard.Layout.of("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2)),
                      collectives="compiler")
    state, _ = step(step.state, step.shard_batch(batches[0]))
    with Checkpoints(tmp_path) as checkpoints:
        checkpoints.save(1, step.to_model_order(state), {"step": 1})
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    with Checkpoints(tmp_path) as reopened:
        restored = step.from_model_order(reopened.restore(1, like))
    assert isinstance(restored, TrainState)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    for batch in batches[1:]:
        state, loss = step(state, step.shard_batch(batch))
        restored, restored_loss = step(restored, step.shard_batch(batch))
        assert float(restored_loss) == float(loss), f"seed {SEED}"
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"seed {SEED}")
    assert int(step.model(restored).dropout.rngs.count.get_value()) == 3
