"""Rule resolution, presets and every validation error, on abstract models (no device work)."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jshard
from jshard import Rules, ShardingError
from jshard.models import GPT, DeepMLP, GPTConfig, MLPConfig

pytestmark = pytest.mark.fast  # the whole file: the rules and their refusals

P = jax.P
MESH_222 = jshard.make_mesh(data=2, fsdp=2, tensor=2)
GPT_CONFIG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, mlp=64, layers=4)


def abstract_gpt(**overrides):
    config = GPTConfig(**{**GPT_CONFIG.__dict__, **overrides})
    return nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))


def spec_of(tree, mesh, rules, path, kind="param"):
    flat = dict(nnx.to_flat_state(jshard.specs(tree, mesh, rules, kind)))
    return flat[tuple(path.split("/"))].get_value()


# -- resolution -------------------------------------------------------------------------


def test_first_rule_wins_and_axis_tuple():
    rules = Rules(params=[("a", ("data", "fsdp")), ("a", "tensor"), ("b", "tensor")])
    assert rules.spec(("a", "b"), (8, 4), MESH_222) == P(("data", "fsdp"), "tensor")


def test_fallback_rule_when_axis_taken():
    rules = Rules(params=[("x", "tensor"), ("y", "tensor"), ("y", None)])
    assert rules.spec(("x", "y"), (4, 4), MESH_222) == P("tensor", None)


def test_axis_used_twice_is_an_error_not_a_replication():
    rules = Rules(params=[("x", "tensor"), ("y", "tensor")])
    with pytest.raises(ShardingError) as e:
        rules.spec(("x", "y"), (4, 4), MESH_222, where="param 'w'")
    msg = str(e.value)
    assert "param 'w'" in msg and "'tensor' already shards dim 0 ('x')" in msg
    assert "fallback rule ('y', None)" in msg


def test_same_name_twice_in_one_tensor():
    with pytest.raises(ShardingError, match="only one dim"):
        Rules(params=[("embed", "fsdp")]).spec(("embed", "embed"), (4, 4), MESH_222)


def test_not_divisible_names_dim_size_and_axis():
    with pytest.raises(ShardingError) as e:
        Rules(params=[("heads", "tensor")]).spec(("heads",), (3,), MESH_222, where="param 'q'")
    assert "param 'q': dim 0 ('heads', size 3) does not divide by tensor=2" in str(e.value)


def test_unknown_logical_name():
    with pytest.raises(ShardingError, match="logical name 'experts' .* has no rule.*rules.add"):
        Rules(params=[("embed", None)]).spec(("experts", "embed"), (4, 4), MESH_222)


def test_rank_mismatch():
    with pytest.raises(ShardingError, match="2 logical names .* rank 3"):
        Rules(params=[("a", None)]).spec(("a", "a"), (2, 2, 2), MESH_222)


def test_unknown_mesh_axis():
    with pytest.raises(ShardingError, match="'model' names a mesh axis the mesh does not have"):
        Rules(params=[("mlp", "model")], activations=[("batch", ("data", "fsdp", "tensor"))]).check_mesh(MESH_222)


def test_unused_mesh_axis_of_size_above_one():
    with pytest.raises(ShardingError, match="mesh axis 'tensor' has size 2, but no rule of 'dp\\+zero3'"):
        jshard.preset("dp+fsdp").check_mesh(MESH_222)


@pytest.mark.parametrize("bad", [[("a",)], [(1, "data")], [("a", ("data", "data"))]])
def test_malformed_rules(bad):
    with pytest.raises(ShardingError):
        Rules(params=bad)


def test_add_takes_priority():
    rules = jshard.preset("fsdp").add(params=[("embed", None)])
    assert rules.spec(("embed",), (4,), jshard.make_mesh(fsdp=8)) == P(None)


# -- ZeRO stages ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stage, sharded_kinds", [(0, set()), (1, {"opt"}), (2, {"opt", "grad"}), (3, {"opt", "grad", "param"})]
)
def test_zero_stage_picks_which_state_is_sharded(stage, sharded_kinds):
    rules = jshard.preset(f"dp+zero{stage}" if stage else "dp")
    for kind in ("param", "grad", "opt"):
        spec = rules.spec(("embed", "mlp"), (8, 8), MESH_222 if stage else jshard.make_mesh(data=8), kind)
        assert (spec == P("fsdp", None)) == (kind in sharded_kinds), (stage, kind, spec)


def test_zero_axes_are_batch_axes_that_shard_params():
    assert jshard.preset("dp+fsdp+tp").zero_axes == ("fsdp",)
    assert jshard.preset("dp+tp+pp").zero_axes == ()


# -- presets ----------------------------------------------------------------------------


def test_preset_names():
    assert jshard.preset("DP+FSDP+SP").name == "dp+zero3+tp+sp"
    assert jshard.preset("zero2").zero == 2
    with pytest.raises(ShardingError, match="unknown strategy 'zero4'"):
        jshard.preset("dp+zero4")
    with pytest.raises(ShardingError, match="more than one ZeRO stage"):
        jshard.preset("zero1+fsdp")


def test_sp_overlap_is_sp_with_collective_matmuls():
    """The same layouts as tp+sp (so the same plan, bytes and memory but for the collectives'
    kind); only `collective_matmul` differs, and the name says so."""
    overlap, sp = jshard.preset("dp+sp-overlap"), jshard.preset("dp+tp+sp")
    assert overlap.name == "dp+tp+sp-overlap" and jshard.preset("dp+tp+sp+sp-overlap").name == overlap.name
    assert overlap.collective_matmul and not sp.collective_matmul
    assert (overlap.params, overlap.activations) == (sp.params, sp.activations)
    assert "collective matmuls" in str(overlap)


# (preset, mesh, param path, expected spec) for GPT and MLP params
GPT_CASES = [
    ("dp", dict(data=8), "blocks/mlp/up/kernel", P(None, None, None)),
    ("zero1", dict(fsdp=8), "blocks/mlp/up/kernel", P(None, None, None)),
    ("zero3", dict(fsdp=8), "blocks/mlp/up/kernel", P(None, "fsdp", None)),
    ("zero3", dict(fsdp=8), "token_embed/embedding", P(None, "fsdp")),
    ("dp+tp", dict(data=2, tensor=4), "blocks/attn/qkv/kernel", P(None, None, None, "tensor", None)),
    ("dp+tp", dict(data=2, tensor=4), "blocks/attn/out/kernel", P(None, "tensor", None, None)),
    ("dp+tp", dict(data=2, tensor=4), "blocks/mlp/down/kernel", P(None, "tensor", None)),
    ("dp+tp", dict(data=2, tensor=4), "token_embed/embedding", P("tensor", None)),
    ("dp+tp", dict(data=2, tensor=4), "final_norm/scale", P(None)),
    ("dp+pp", dict(data=2, stage=4), "blocks/attn_norm/scale", P("stage", None)),
    ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2), "blocks/attn/qkv/kernel", P(None, "fsdp", None, "tensor", None)),
    ("fsdp+tp+pp", dict(fsdp=2, tensor=2, stage=2), "blocks/mlp/down/kernel", P("stage", "tensor", "fsdp")),
    ("dp+zero1+sp", dict(data=2, fsdp=2, tensor=2), "blocks/mlp/up/kernel", P(None, None, "tensor")),
]


@pytest.mark.parametrize("preset, sizes, path, expected", GPT_CASES)
def test_gpt_param_specs(preset, sizes, path, expected):
    assert spec_of(abstract_gpt(), jshard.make_mesh(**sizes), jshard.preset(preset), path) == expected


@pytest.mark.parametrize(
    "preset, sizes, expected",
    [
        ("dp", dict(data=8), P(None, None, None)),
        ("fsdp", dict(fsdp=8), P(None, "fsdp", None)),
        ("dp+tp", dict(data=2, tensor=4), P(None, None, "tensor")),
        ("dp+pp", dict(data=2, stage=4), P("stage", None, None)),
        ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2), P(None, "fsdp", "tensor")),
    ],
)
def test_mlp_param_specs(preset, sizes, expected):
    mlp = nnx.eval_shape(lambda: DeepMLP(MLPConfig(dim=32, layers=4), rngs=nnx.Rngs(0)))
    assert spec_of(mlp, jshard.make_mesh(**sizes), jshard.preset(preset), "layers/linear/kernel") == expected


def test_activation_specs_under_sequence_parallel():
    rules, mesh = jshard.preset("dp+fsdp+sp"), MESH_222
    assert rules.spec(("batch", "seq", "embed"), (8, 16, 32), mesh, "activation") == P(("data", "fsdp"), "tensor", None)
    # Inside attention `heads` holds `tensor`; seq falls back to replicated.
    assert rules.spec(("batch", "seq", "heads", "kv"), (8, 16, 4, 8), mesh, "activation") == P(("data", "fsdp"), None, "tensor", None)


def test_optimizer_state_follows_zero_stage():
    mesh, rules = jshard.make_mesh(fsdp=8), jshard.preset("zero1")
    model = nnx.eval_shape(lambda: DeepMLP(MLPConfig(dim=16, layers=2), rngs=nnx.Rngs(0)))
    optimizer = nnx.eval_shape(lambda: nnx.Optimizer(DeepMLP(MLPConfig(dim=16, layers=2), rngs=nnx.Rngs(0)), optax.adamw(1e-3), wrt=nnx.Param))
    assert spec_of(model, mesh, rules, "layers/linear/kernel") == P(None, None, None)
    opt_specs = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(jshard.specs(optimizer, mesh, rules, "opt"))}
    assert opt_specs["opt_state/0/mu/layers/linear/kernel"] == P(None, "fsdp", None)
    assert opt_specs["opt_state/0/nu/layers/linear/kernel"] == P(None, "fsdp", None)
    assert opt_specs["opt_state/0/count"] == P()


# -- user modules and unnamed params ----------------------------------------------------


class UserModel(nnx.Module):
    def __init__(self, rngs, named_bias=True):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (16, 32)), out_sharding=("embed", "mlp"))
        self.b = nnx.Param(jnp.zeros((32,)), **({"out_sharding": ("mlp",)} if named_bias else {}))

    def __call__(self, x):
        return jshard.constrain(x @ self.w + self.b, ("batch", "mlp"))


def test_an_unnamed_bias_is_split_by_zero_itself_or_replicated_and_flagged_unless_strict():
    model = nnx.eval_shape(lambda: UserModel(nnx.Rngs(0), named_bias=False))
    mesh = jshard.make_mesh(fsdp=8)
    assert spec_of(model, mesh, jshard.preset("fsdp"), "b") == P("fsdp")  # ZeRO needs no names
    (flagged,) = jshard.describe(model, mesh, jshard.preset("fsdp")).flagged
    assert flagged.path == "b" and flagged.flags == ("no logical names: split by itself over fsdp on dim 0 (ZeRO)",)
    tensor = jshard.make_mesh(tensor=8)  # tensor parallelism splits by names: an unnamed bias stays whole
    assert spec_of(model, tensor, jshard.preset("tp"), "b") == P()
    (flagged,) = jshard.describe(model, tensor, jshard.preset("tp")).flagged
    assert flagged.path == "b" and flagged.flags == (
        "no logical names: replicated (unnamed 1-D params are; strict rules refuse them)",)
    with pytest.raises(ShardingError) as e:
        jshard.specs(model, mesh, jshard.preset("fsdp", strict=True))
    msg = str(e.value)
    assert "param 'b' (shape (32,)) has no logical axis names" in msg and "out_sharding=('embed',)" in msg, msg
    # Under plain DP nothing is sharded: no names needed, nothing flagged, even when strict.
    assert spec_of(model, jshard.make_mesh(data=8), jshard.preset("dp", strict=True), "b") == P()
    assert not jshard.describe(model, jshard.make_mesh(data=8), jshard.preset("dp")).flagged


class UnnamedKernel(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros((16, 32)))


def test_an_unnamed_matrix_is_split_by_zero_itself_and_fails_where_names_split_it():
    # ZeRO: its largest dim that divides, as a named one would be split
    assert jshard.specs(nnx.eval_shape(UnnamedKernel), jshard.make_mesh(fsdp=8), jshard.preset("fsdp"))["w"].get_value() \
        == P(None, "fsdp")
    with pytest.raises(ShardingError) as e:  # tensor parallelism: by what the dims mean
        jshard.specs(nnx.eval_shape(UnnamedKernel), jshard.make_mesh(fsdp=4, tensor=2), jshard.preset("fsdp+tp"))
    msg = str(e.value)
    assert "param 'w' (shape (16, 32)) has no logical axis names, but rules 'zero3+tp' shard params over tensor" in msg
    assert "name its 2 dim(s), e.g. nnx.Param(value, out_sharding=('embed', 'mlp'))" in msg, msg


def test_all_problems_reported_at_once():
    bad = abstract_gpt(heads=3, embed=48)  # heads=3 does not divide tensor=2
    with pytest.raises(ShardingError) as e:
        jshard.specs(bad, MESH_222, jshard.preset("dp+fsdp+tp"))
    msg = str(e.value)
    assert "sharding problems; the others at param '" in msg and "\n" not in msg and msg.count("Fix:") == 1, msg
    for path in ("blocks/attn/qkv/kernel", "blocks/attn/out/kernel"):
        assert path in msg


def test_describe_report_bytes_and_flags():
    mesh, rules = jshard.make_mesh(fsdp=8), jshard.preset("fsdp")
    report = jshard.describe(nnx.eval_shape(lambda: UserModel(nnx.Rngs(0))), mesh, rules)
    rows = {p.path: p for p in report.rows}
    assert rows["w"].spec == P("fsdp", None) and rows["w"].bytes_per_device == 16 * 32 * 4 // 8
    assert rows["b"].spec == P(None) and rows["b"].bytes_per_device == 32 * 4
    assert [p.path for p in report.flagged] == ["b"]
    assert "replicated over fsdp, which ZeRO stage 3 means to shard" in rows["b"].flags[0]
    text = str(report)
    assert re.search(r"^w +\(embed, mlp\) +16×32 +P\(fsdp, -\) +256 B$", text, re.M)
    assert "! b: replicated over fsdp" in text
    assert report.total_bytes == (16 * 32 + 32) * 4


def test_describe_gpt_under_fsdp_flags_nothing():
    report = jshard.describe(abstract_gpt(), MESH_222, jshard.preset("dp+fsdp+tp"))
    assert report.flagged == ()
    assert report.bytes_per_device < report.total_bytes / 3.5


def test_describe_flags_a_fallback():
    # kv takes `tensor` first, so heads falls back to the preset's ("heads", None).
    rules = jshard.preset("tp").add(params=[("kv", "tensor")])
    report = jshard.describe(abstract_gpt(), jshard.make_mesh(tensor=8), rules)
    rows = {p.path: p for p in report.rows}
    assert rows["blocks/attn/qkv/kernel"].spec == P(None, None, None, None, "tensor")
    assert "dim 3 ('heads') fell back to replicated" in rows["blocks/attn/qkv/kernel"].flags[0]
    assert not rows["blocks/mlp/up/kernel"].flags


def test_constrain_is_identity_without_rules():
    x = jnp.ones((4, 32))
    assert jshard.constrain(x, ("batch", "mlp")) is x


def test_activation_error_names_the_activation():
    model = UserModel(nnx.Rngs(0))
    with jshard.activate(jshard.make_mesh(data=8), jshard.preset("dp")):
        with pytest.raises(ShardingError, match=r"activation \('batch', 'mlp'\): dim 0 \('batch', size 4\) does not divide by data=8"):
            jax.jit(lambda x: model(x))(jnp.ones((4, 16)))


def test_init_factory_with_outside_rngs_gets_a_clear_error():
    rngs = nnx.Rngs(0)
    with pytest.raises(ShardingError, match="create it inside"):
        jshard.init(lambda: UserModel(rngs), jshard.make_mesh(data=8), jshard.preset("dp"))
