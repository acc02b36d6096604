"""Params placed by each preset on 8 devices: the model computes what it does on one.

Placement only: the compiler inserts the collectives here. The explicit shard_map
strategies are tested against the same single-device reference in their own files.
"""

import re

import jax
import numpy as np
import pytest
from flax import nnx

import jshard
from jshard.models import GPT, DeepMLP, GPTConfig, MLPConfig
from plans import PLACEMENTS

GPT_CONFIG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, mlp=64, layers=4)
MLP_CONFIG = MLPConfig(dim=32, layers=4)



def run_sharded(factory, loss_and_output, inputs, preset, sizes):
    mesh, rules = jshard.make_mesh(**sizes), jshard.preset(preset)
    model = jshard.init(factory, mesh, rules)
    expected = jshard.shardings(model, mesh, rules)
    for (path, array), (_, sharding) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(expected)):
        assert array.get_value().sharding.is_equivalent_to(sharding.get_value(), array.get_value().ndim), path
    with jshard.activate(mesh, rules):
        return nnx.jit(loss_and_output)(model, inputs)


@pytest.mark.parametrize("preset, sizes", PLACEMENTS, ids=[p for p, _ in PLACEMENTS])
def test_gpt_forward_matches_one_device(preset, sizes):
    def factory():
        return GPT(GPT_CONFIG, rngs=nnx.Rngs(0))

    def logits(model, tokens):
        return model(tokens)

    tokens = np.random.default_rng().integers(0, GPT_CONFIG.vocab, (8, 16))
    reference = logits(factory(), tokens)
    sharded = run_sharded(factory, logits, tokens, preset, sizes)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(reference), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset, sizes", PLACEMENTS, ids=[p for p, _ in PLACEMENTS])
def test_mlp_forward_matches_one_device(preset, sizes):
    def factory():
        return DeepMLP(MLP_CONFIG, rngs=nnx.Rngs(0))

    def output(model, x):
        return model(x)

    x = np.random.default_rng().standard_normal((16, MLP_CONFIG.dim), dtype=np.float32)
    reference = output(factory(), x)
    sharded = run_sharded(factory, output, x, preset, sizes)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(reference), rtol=1e-5, atol=1e-6)


def test_untied_head_matches_one_device():
    config = GPTConfig(**{**GPT_CONFIG.__dict__, "tied_head": False})
    tokens = np.random.default_rng().integers(0, config.vocab, (8, 16))
    reference = GPT(config, rngs=nnx.Rngs(0))(tokens)
    sharded = run_sharded(lambda: GPT(config, rngs=nnx.Rngs(0)), lambda m, t: m(t), tokens, "dp+fsdp+tp+sp", dict(data=2, fsdp=2, tensor=2))
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(reference), rtol=1e-5, atol=1e-6)


def test_shard_moves_an_existing_model():
    mesh, rules = jshard.make_mesh(data=2, fsdp=2, tensor=2), jshard.preset("dp+fsdp+tp")
    model = GPT(GPT_CONFIG, rngs=nnx.Rngs(0))
    jshard.shard(model, mesh, rules)
    kernel = model.blocks.mlp.up.kernel.get_value()
    assert kernel.sharding.spec == jax.P(None, "fsdp", "tensor")
    assert kernel.addressable_shards[0].data.shape == (4, 16, 32)


class UserModel(nnx.Module):
    """A user's own module: it works once its params carry logical names."""

    def __init__(self, rngs: nnx.Rngs):
        self.w_in = nnx.Param(jax.random.normal(rngs.params(), (16, 64)) * 0.25, out_sharding=("embed", "mlp"))
        self.w_out = nnx.Param(jax.random.normal(rngs.params(), (64, 16)) * 0.125, out_sharding=("mlp", "embed"))

    def __call__(self, x):
        h = jshard.constrain(jax.nn.relu(x @ self.w_in), ("batch", "mlp"))
        return jshard.constrain(h @ self.w_out, ("batch", "embed"))


def test_user_module_matches_one_device():
    x = np.random.default_rng().standard_normal((8, 16), dtype=np.float32)
    reference = UserModel(nnx.Rngs(1))(x)
    sharded = run_sharded(lambda: UserModel(nnx.Rngs(1)), lambda m, x: m(x), x, "dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2))
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(reference), rtol=1e-5, atol=1e-6)


def test_demo_trains(capsys):
    from jshard.cli import main

    assert main(["demo", "--steps", "4", "--seq-len", "16", "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    difference = float(re.search(r"relative difference ([0-9.e+-]+)", out).group(1))
    assert difference < 1e-5
