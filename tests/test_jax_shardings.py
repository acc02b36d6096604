"""A model written with JAX's own sharding annotations (PartitionSpecs over its author's mesh axes
in param metadata and initializers, `out_sharding=` / `reshard` / `with_sharding_constraint` in
its forward, a `P()` norm scale, a constant held as `nnx.data`): renamed onto jshard's axes by
`rules.with_mesh_axes`, its own layout is the layout; each step matches one device, or refuses
in one line.
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

import jshard
from flax_models import AUTHOR_AXES, ConstrainedLM, author_mesh, explicit_sharding_lm, next_token_loss, token_batches
from jshard.checkpoint import Checkpoints
from jshard.parallel import build_step
from jshard.rules import ShardingError
from parity import OPTIMIZER, assert_trains_like_one_device, train_on_one_device
from seed import SEED


@functools.cache
def one_device_run():
    """The reference, under the author's mesh on one device (its forward's requests need it)."""
    with jax.set_mesh(author_mesh()):
        return train_on_one_device(explicit_sharding_lm(nnx.Rngs(SEED)), OPTIMIZER, next_token_loss,
                                   token_batches(SEED, 3))


def rules(preset: str):
    return jshard.preset(preset).with_mesh_axes(AUTHOR_AXES)


# The explicit step under a data, a ZeRO-3 and a tensor-parallel layout, and the compiler-placed step.
CASES = [("dp", dict(data=8), "explicit"), ("zero3", dict(fsdp=8), "explicit"),
         ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2), "explicit"),
         ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2), "compiler")]


@pytest.mark.parametrize("preset, sizes, collectives", CASES, ids=[f"{p}-{c}" for p, _, c in CASES])
def test_a_model_with_jax_annotations_trains_in_its_own_layout(preset, sizes, collectives, tmp_path):
    """Losses and every Variable after 3 steps, as on one device; each param laid out as its
    author's spec says, renamed (`P()` replicated); the `nnx.data` constant carried through the
    steps and, under dp, through a checkpoint."""
    step = build_step(explicit_sharding_lm(nnx.Rngs(SEED)), OPTIMIZER, next_token_loss,
                      jshard.Layout.of(rules(preset), sizes), collectives=collectives)
    specs = {p.path: p.placement.spec for p in step.plan.params}
    fsdp = "fsdp" if sizes.get("fsdp", 1) > 1 else None
    tensor = "tensor" if sizes.get("tensor", 1) > 1 else None
    assert specs["q"] == jax.P(fsdp, tensor, None) and specs["scale"] == jax.P(), specs
    state = assert_trains_like_one_device(step, one_device_run(), f"{preset} {collectives}")
    if preset == "dp":
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        with Checkpoints(tmp_path) as checkpoints:
            checkpoints.save(3, state, {"step": 3})
            restored = checkpoints.restore(3, like)
        np.testing.assert_array_equal(step.model(restored).inv_freq, one_device_run().state["inv_freq"])


@pytest.mark.fast
@pytest.mark.parametrize("make, preset, sizes, message", [
    (functools.partial(explicit_sharding_lm, hidden=jax.P("fsdp", None, "tp")), "dp+fsdp+tp",
     dict(data=2, fsdp=2, tensor=2), "flax_models.py:.* out_sharding= of einsum asks for the layout "
     r"P\('fsdp', None, 'tp'\) \(tensor=2 on dim 2\).* Fix: build_step\(..., collectives=\"compiler\"\)"),
    (explicit_sharding_lm, "zero3", dict(fsdp=4, tensor=2), "mesh axis 'tensor' has size 2, but no rule of 'zero3'"),
], ids=["forward asks tp", "preset without tp"])
def test_what_the_explicit_step_cannot_honour_is_one_line(make, preset, sizes, message):
    """A forward request for another layout than the local one, named at its call site; a preset
    that leaves the model's tensor axis unused. Refused while tracing: nothing compiles."""
    with pytest.raises(ShardingError, match=message) as refused:
        step = build_step(make(nnx.Rngs(SEED)), OPTIMIZER, next_token_loss, jshard.Layout.of(rules(preset), sizes))
        step(step.state, step.shard_batch(token_batches(SEED, 1)[0]))
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
                      jshard.Layout.of(rules("dp+fsdp+tp"), dict(data=2, fsdp=2, tensor=2)), collectives="compiler")
    step.lower(step.state, step.shard_batch(token_batches(SEED, 1)[0]))
