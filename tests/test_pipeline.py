"""GPipe inside the explicit step: against the unpipelined single-device reference, alone and
with FSDP, TP and SP on the other axes; its activation traffic counted from HLO; bad input."""

import numpy as np
import optax
import pytest
from flax import nnx

import jshard
from jshard import hlo
from jshard.models import GPT, DeepMLP, GPTConfig, MLPConfig, gpt_loss, mlp_loss
from jshard.parallel import build_step
from test_strategies import OPTIMIZER, SEED, TOLERANCE, assert_trees_close, relative_error

MLP_CONFIG = MLPConfig(dim=32, layers=8)
GPT_CONFIG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, mlp=64, layers=4)


def assert_matches_one_device(make, loss_fn, batch, preset, sizes, microbatches, steps=0):
    """Loss and gradients of the pipelined step equal one device's; then `steps` AdamW steps."""
    step = build_step(make(), OPTIMIZER, loss_fn, jshard.make_mesh(**sizes), jshard.preset(preset), microbatches)
    loss, grads = step.value_and_grad(step.state, step.shard_batch(batch))
    reference = make()
    expected_loss, expected_grads = nnx.value_and_grad(loss_fn)(reference, batch)
    assert relative_error(loss, expected_loss) <= TOLERANCE, f"loss (seed {SEED})"
    assert_trees_close(grads, expected_grads, "gradient")
    if steps:
        optimizer = nnx.Optimizer(reference, OPTIMIZER, wrt=nnx.Param)
        state = step.state
        for _ in range(steps):
            state, _ = step(state, step.shard_batch(batch))
            optimizer.update(reference, nnx.grad(loss_fn)(reference, batch))
        assert_trees_close(nnx.state(step.model(state)), nnx.state(reference), f"param after {steps} steps")


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("per_stage", [1, 2, 4])
def test_gpipe_mlp(stages, per_stage):
    microbatches = per_stage * stages  # m in {p, 2p, 4p}
    batch = np.random.default_rng(SEED).standard_normal((8 * microbatches, MLP_CONFIG.dim), dtype=np.float32)
    assert_matches_one_device(lambda: DeepMLP(MLP_CONFIG, rngs=nnx.Rngs(SEED)), mlp_loss, batch, "dp+pp",
                              dict(data=8 // stages, stage=stages), microbatches, steps=2 if per_stage == 1 else 0)


@pytest.mark.parametrize(
    "preset, sizes, microbatches",
    [
        ("dp+pp", dict(data=2, stage=4), 4),
        ("fsdp+tp+pp", dict(fsdp=2, tensor=2, stage=2), 2),  # ZeRO-3 × TP × PP on one 2×2×2 mesh
        ("dp+tp+sp+pp", dict(data=2, tensor=2, stage=2), 4),
        ("zero2+pp", dict(fsdp=4, stage=2), 2),
    ],
)
def test_gpipe_gpt_with_other_strategies(preset, sizes, microbatches):
    batch = np.random.default_rng(SEED).integers(0, GPT_CONFIG.vocab, (16, 17))
    assert_matches_one_device(lambda: GPT(GPT_CONFIG, rngs=nnx.Rngs(SEED)), gpt_loss, batch, preset, sizes, microbatches)


@pytest.mark.parametrize("stages, microbatches", [(2, 2), (4, 8)])
def test_gpipe_activation_traffic(stages, microbatches):
    """Each tick but the last sends one micro-batch's activation forward; backward mirrors it."""
    step = build_step(DeepMLP(MLP_CONFIG, rngs=nnx.Rngs(0)), OPTIMIZER, mlp_loss,
                      jshard.make_mesh(data=8 // stages, stage=stages), jshard.preset("dp+pp"), microbatches)
    batch = np.ones((8 * microbatches, MLP_CONFIG.dim), np.float32)
    compiled = step.lower(step.state, step.shard_batch(batch)).compile()
    sent = sum(c.bytes * c.count for c in hlo.collectives(compiled.as_text()) if c.kind == "collective-permute")
    activation = batch.shape[0] // (8 // stages) // microbatches * MLP_CONFIG.dim * 4
    assert sent == 2 * (microbatches + stages - 2) * activation


def make_mlp():
    return DeepMLP(MLP_CONFIG, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "preset, sizes, loss_fn, microbatches, fragment",
    [
        ("dp+pp", dict(data=2, stage=4), mlp_loss, None, "needs microbatches=M >= 1"),
        ("dp+pp", dict(data=2, stage=4), lambda m, b: mlp_loss(m, b), 4, "StagedLoss"),
        ("dp", dict(data=8), mlp_loss, 4, "no pipeline to feed"),
        ("pp", dict(stage=8), mlp_loss, 4, r"dim 0 \('layers', size 8\)|does not divide"),
    ],
)
def test_bad_pipeline_input(preset, sizes, loss_fn, microbatches, fragment):
    model = DeepMLP(MLPConfig(dim=32, layers=6 if preset == "pp" else 8), rngs=nnx.Rngs(0))
    with pytest.raises(jshard.ShardingError, match=fragment):
        build_step(model, OPTIMIZER, loss_fn, jshard.make_mesh(**sizes), jshard.preset(preset), microbatches)


def test_batch_not_divisible_by_microbatches():
    step = build_step(make_mlp(), OPTIMIZER, mlp_loss, jshard.make_mesh(data=2, stage=4), jshard.preset("dp+pp"), 4)
    with pytest.raises(jshard.ShardingError, match="batch of 12 .* 8 shards over data × micro-batches"):
        step.shard_batch(np.ones((12, MLP_CONFIG.dim), np.float32))
