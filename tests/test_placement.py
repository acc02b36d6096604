"""Params placed by each preset on 8 devices: the model computes what it does on one.

Placement only: the compiler inserts the collectives here. The explicit shard_map
strategies are tested against the same single-device reference in their own files.
"""

import jax
import numpy as np
import pytest
from flax import nnx

import jshard
from jshard.models import GPT, DeepMLP, GPTConfig, MLPConfig
from meshes import PLACEMENTS
from seed import SEED

GPT_CONFIG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, mlp=64, layers=4)
MLP_CONFIG = MLPConfig(dim=32, layers=4)



def run_sharded(factory, inputs, preset, sizes):
    """The model's output on `inputs`, with params placed by the preset (checked) and jit."""
    mesh, rules = jshard.make_mesh(**sizes), jshard.preset(preset)
    model = jshard.init(factory, mesh, rules)
    expected = jshard.shardings(model, mesh, rules)
    for (path, array), (_, sharding) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(expected)):
        assert array.get_value().sharding.is_equivalent_to(sharding.get_value(), array.get_value().ndim), path
    with jshard.activate(mesh, rules):
        return nnx.jit(lambda model, inputs: model(inputs))(model, inputs)


def assert_matches_one_device(factory, inputs, preset, sizes):
    reference = factory()(inputs)
    sharded = run_sharded(factory, inputs, preset, sizes)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(reference), rtol=1e-5, atol=1e-6)


MODELS = {
    "gpt": (lambda: GPT(GPT_CONFIG, rngs=nnx.Rngs(0)), lambda rng: rng.integers(0, GPT_CONFIG.vocab, (8, 16))),
    "mlp": (lambda: DeepMLP(MLP_CONFIG, rngs=nnx.Rngs(0)),
            lambda rng: rng.standard_normal((16, MLP_CONFIG.dim), dtype=np.float32)),
}


# Left out, each compiling a program (or taking the jshard path) of a case that stays: zero2 is
# zero1's forward (params whole under both, same mesh). Neither model has experts, so the ep
# presets only add `expert` to the batch axes: ep is dp's program with the axis renamed, dp+ep,
# fsdp+ep and dp+ep+tp take dp's, zero3's and dp+tp's paths. The MLP names no seq: its sp presets
# are dp+tp's and dp+fsdp+tp's programs, and its cp presets only replicate (dp's and dp+tp's
# paths). GPT's dp+tp+sp-overlap is its dp+tp+sp program: under jit there is no collective matmul.
SAME_AS_ANOTHER = {("gpt", p) for p in ("zero2", "ep", "dp+ep", "fsdp+ep", "dp+ep+tp", "dp+tp+sp-overlap")} | {
    ("mlp", p) for p in ("zero2", "ep", "dp+ep", "fsdp+ep", "dp+ep+tp", "dp+tp+sp", "dp+fsdp+tp+sp", "dp+tp+sp-overlap",
                         "cp", "dp+cp", "dp+cp+tp")}
FORWARD_CASES = [(model_name, preset, sizes) for preset, sizes in PLACEMENTS for model_name in MODELS
                 if (model_name, preset) not in SAME_AS_ANOTHER]


@pytest.mark.parametrize("model_name, preset, sizes", FORWARD_CASES, ids=[f"{p}-{m}" for m, p, _ in FORWARD_CASES])
def test_forward_matches_one_device(model_name, preset, sizes):
    factory, make_inputs = MODELS[model_name]
    assert_matches_one_device(factory, make_inputs(np.random.default_rng(SEED)), preset, sizes)


def test_untied_head_matches_one_device():
    config = GPTConfig(**{**GPT_CONFIG.__dict__, "tied_head": False})
    tokens = np.random.default_rng(SEED).integers(0, config.vocab, (8, 16))
    assert_matches_one_device(lambda: GPT(config, rngs=nnx.Rngs(0)), tokens, "dp+fsdp+tp+sp", dict(data=2, fsdp=2, tensor=2))


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
    x = np.random.default_rng(SEED).standard_normal((8, 16), dtype=np.float32)
    assert_matches_one_device(lambda: UserModel(nnx.Rngs(1)), x, "dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2))
