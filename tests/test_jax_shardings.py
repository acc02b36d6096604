"""Models written with JAX's own sharding annotations (PartitionSpecs over their authors' mesh axes
in param metadata and initializers, `out_sharding=` / `reshard` / `with_sharding_constraint` in
their forwards, `P()` norm scales, a constant held as `nnx.data`): renamed onto jshard's axes by
`rules.with_mesh_axes`, each model's own layout is the layout; each step matches one device, or
refuses in one line.

The zoo (tests/flax_models.py `ZOO`): a Llama (GQA, rotary, SwiGLU, untied head), a Qwen3 (q/k
norms, other axis names, a forward asking for its heads split over its tensor axis), a tied
decoder with an `nnx.data` constant; each under every ZeRO stage, tensor parallelism and their
mix, in the explicit and the compiler-placed step.
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

import jshard
from flax_models import (AUTHOR_AXES, ZOO, ConstrainedLM, author_mesh, explicit_sharding_lm, next_token_loss,
                         token_batches)
from jshard.app.checkpoint import Checkpoints
from jshard.parallel import build_step
from jshard.rules import ShardingError
from parity import OPTIMIZER, assert_trains_like_one_device, train_on_one_device
from seed import SEED


@functools.cache
def one_device_run(model: str):
    """A zoo model's reference, under its author's mesh on one device (its forward's requests need it)."""
    make, sharding, _ = ZOO[model]
    with jax.set_mesh(author_mesh(sharding)):
        return train_on_one_device(make(nnx.Rngs(SEED)), OPTIMIZER, next_token_loss, token_batches(SEED, 3))


LAYOUTS = {  # id: (preset, mesh, collectives)
    "dp": ("dp", dict(data=8), "explicit"),
    "zero1": ("zero1", dict(fsdp=8), "explicit"),
    "zero2": ("zero2", dict(fsdp=8), "explicit"),
    "zero3": ("zero3", dict(fsdp=8), "explicit"),
    "tp": ("tp", dict(tensor=8), "explicit"),
    "dp+fsdp+tp": ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2), "explicit"),
    "dp+fsdp+tp compiler": ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2), "compiler"),
}

_HEADS_WHOLE = (r"flax_models.py:\d+: out_sharding= of einsum asks for the layout P\('data', None, 'model', None\) "
                r"\(tensor={} on dim 2\), but jshard's explicit step holds this value whole on that dim .* "
                r"Fix: build_step\(..., collectives=\"compiler\"\)")
# What jshard refuses, in one line before anything compiles; every other case trains as one device does.
REFUSED = {
    # Qwen3's forward asks for its heads split over 'model' (tensor): the explicit step computes
    # them whole on each device; the compiler-placed step, where XLA lays them out, trains it.
    ("qwen3", "tp"): _HEADS_WHOLE.format(8),
    ("qwen3", "dp+fsdp+tp"): _HEADS_WHOLE.format(2),
    # The tied decoder's 4 KV heads (k and v in one param) do not split 8 ways.
    ("tied", "tp"): r"^param 'kv': dim 2 \(size 4\) of PartitionSpec P\(None, 'fsdp', 'tp', None\) does not divide "
                    r"by tensor=8\. Fix: make the size a multiple of 8 or change the mesh\.$",
}
# Per model: a param its author splits over both axes, and a norm scale (`P()`).
SPLIT_AND_SCALE = {"llama": ("layers/0/q", "norm"), "qwen3": ("layers/0/k", "layers/1/q_norm"), "tied": ("q", "scale")}
# The refusals come before any step compiles: the fast tier's.
CASES = [pytest.param(model, layout, id=f"{model}-{layout}", marks=[pytest.mark.fast] * ((model, layout) in REFUSED))
         for model in ZOO for layout in LAYOUTS]


@pytest.mark.parametrize("model, layout", CASES)
def test_the_zoo_trains_in_its_authors_layout_or_refuses_in_one_line(model, layout, tmp_path):
    """Losses and every Variable after 3 steps, as on one device; each param laid out as its
    author's spec says, renamed (`P()` replicated; fsdp on params from ZeRO-3, on Adam's moments
    from ZeRO-1); the tied decoder's `nnx.data` constant through a checkpoint under dp. Or, where
    `REFUSED` says, one ShardingError of one line with its fix, raised while building or tracing."""
    make, _, axes = ZOO[model]
    preset, sizes, collectives = LAYOUTS[layout]
    rules = jshard.preset(preset).with_mesh_axes(axes)
    build = functools.partial(build_step, make(nnx.Rngs(SEED)), OPTIMIZER, next_token_loss,
                              jshard.Layout.of(rules, sizes), collectives=collectives)
    if (model, layout) in REFUSED:
        with pytest.raises(ShardingError, match=REFUSED[model, layout]) as refused:
            step = build()
            step.lower(step.state, step.shard_batch(token_batches(SEED, 1)[0]))
        assert "\n" not in str(refused.value)
        return
    step = build()
    placed = {p.path: p for p in step.plan.params}
    fsdp, tensor = ("fsdp" if sizes.get("fsdp", 1) > 1 else None), ("tensor" if sizes.get("tensor", 1) > 1 else None)
    split, scale = (placed[path] for path in SPLIT_AND_SCALE[model])
    assert split.placement.spec == jax.P(fsdp if rules.zero == 3 else None, tensor, None), split
    assert split.opt_placement.spec == jax.P(fsdp, tensor, None) and scale.placement.spec == jax.P(), (split, scale)
    state = assert_trains_like_one_device(step, one_device_run(model), f"{model} {layout}")
    if model == "tied" and layout == "dp":
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        with Checkpoints(tmp_path) as checkpoints:
            checkpoints.save(3, state, {"step": 3})
            restored = checkpoints.restore(3, like)
        np.testing.assert_array_equal(step.model(restored).inv_freq, one_device_run(model).state["inv_freq"])


@pytest.mark.fast
def test_a_preset_that_leaves_the_models_tensor_axis_unused_is_one_line():
    with pytest.raises(ShardingError, match="mesh axis 'tensor' has size 2, but no rule of 'zero3'") as refused:
        build_step(explicit_sharding_lm(nnx.Rngs(SEED)), OPTIMIZER, next_token_loss,
                   jshard.Layout.of(jshard.preset("zero3").with_mesh_axes(AUTHOR_AXES), dict(fsdp=4, tensor=2)))
    assert "\n" not in str(refused.value)


@pytest.mark.fast
def test_a_model_axis_without_a_jshard_axis_is_one_line():
    with pytest.raises(ShardingError, match=r"name mesh axis 'tp' \(params .* and 3 more\).* "
                                            r"Fix: .*rules.with_mesh_axes\(\{'tp': 'tensor'\}\)") as refused:
        build_step(explicit_sharding_lm(nnx.Rngs(SEED)), OPTIMIZER, next_token_loss,
                   jshard.Layout.of("dp", dict(data=8)))
    assert "\n" not in str(refused.value)


def test_with_sharding_constraint_on_the_models_axes_lowers_in_the_compiler_placed_step():
    """An Auto-mesh model's constraint over its author's axes becomes one over jshard's (lowered, not
    compiled: JAX refuses it at trace time, if at all)."""
    step = build_step(explicit_sharding_lm(nnx.Rngs(SEED), model=ConstrainedLM), OPTIMIZER, next_token_loss,
                      jshard.Layout.of(jshard.preset("dp+fsdp+tp").with_mesh_axes(AUTHOR_AXES),
                                       dict(data=2, fsdp=2, tensor=2)), collectives="compiler")
    step.lower(step.state, step.shard_batch(token_batches(SEED, 1)[0]))
