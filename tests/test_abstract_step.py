"""A step built abstractly (`build_step(..., abstract=True)`): no array made, lowered on an
AbstractMesh for every preset and schedule, and the same program as the step built on devices."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jshard
from jshard.mesh import abstract_mesh
from jshard.models import gpt_loss
from jshard.parallel import abstract_batch, build_step
from jshard.parallel.schedules import SCHEDULES

import decoders
from meshes import PLACEMENTS

ROWS = 16
PIPELINE = dict(microbatches=4)


def model_for(sizes: dict, abstract: bool):
    """The tests' decoder for a mesh: the mixture of experts where experts are split, and
    enough layers for any pipeline (stage × virtual chunks)."""
    name = "moe" if "expert" in sizes else "gpt"
    make = lambda: decoders.make(name, 0, layers=8 if "stage" in sizes else 2)
    return nnx.eval_shape(make) if abstract else make()


def lowered_text(step, batch) -> str:
    """The lowered program without its mesh declarations (which name devices, or none)."""
    return re.sub(r"sdy\.mesh @\w+ = <[^\n]*\n", "", step.lower(step.state, batch).as_text())


def abstract_step(preset, sizes, mesh, **kwargs):
    step = build_step(model_for(sizes, abstract=True), optax.adamw(1e-3), gpt_loss, jshard.Layout.of(preset, mesh, **kwargs),
                      mesh, abstract=True)
    return step, abstract_batch(step.plan, (ROWS, decoders.CONFIGS["gpt"].seq_len + 1), jnp.int32)


CASES = [(preset, sizes, PIPELINE if "stage" in sizes else {}) for preset, sizes in PLACEMENTS]
CASES += [("dp+pp", dict(data=2, stage=4), dict(PIPELINE, schedule=s)) for s in SCHEDULES if s != "gpipe"]


@pytest.mark.parametrize("preset, sizes, kwargs", CASES, ids=[f"{p}-{k.get('schedule', '')}" for p, _, k in CASES])
def test_every_preset_and_schedule_lowers_on_an_abstract_mesh(preset, sizes, kwargs):
    step, batch = abstract_step(preset, sizes, abstract_mesh(**sizes), **kwargs)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(step.state))  # no array made
    assert "func.func public @main" in lowered_text(step, batch)


@pytest.mark.parametrize("preset, sizes, kwargs", [
    ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2), {}),
    ("dp+pp", dict(data=2, stage=4), dict(PIPELINE, schedule="1f1b")),
    ("zero2", dict(fsdp=8), dict(precision="mixed")),
])
@pytest.mark.fast
def test_the_abstract_step_is_the_step_built_on_devices(preset, sizes, kwargs):
    abstract, batch = abstract_step(preset, sizes, abstract_mesh(**sizes), **kwargs)
    mesh = jshard.make_mesh(**sizes)
    step = build_step(model_for(sizes, abstract=False), optax.adamw(1e-3), gpt_loss,
                      jshard.Layout.of(preset, mesh, **kwargs), mesh)
    tokens = step.shard_batch(jnp.zeros(batch.shape, batch.dtype))
    assert lowered_text(abstract, batch) == lowered_text(step, tokens)


def test_a_plan_of_other_shapes_is_refused():
    mesh = abstract_mesh(data=8)
    plan = jshard.parallel.make_plan(model_for({}, abstract=True), jshard.Layout.of("dp", mesh), mesh)
    other = nnx.eval_shape(lambda: decoders.make("gpt", 0, embed=64))
    with pytest.raises(jshard.ShardingError, match="the model's params are not the plan's"):
        jshard.parallel.step.step_from_plan(plan, other, optax.adamw(1e-3), gpt_loss, abstract=True)
