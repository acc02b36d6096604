"""The step's plan (`jshard.parallel.make_plan`): every input checked once, in one place; what
the step reads of it; the precision's compute dtype applied by the step itself."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jshard
from jshard.mesh import abstract_mesh
from jshard.models import gpt_loss
from jshard.parallel import build_step, make_plan
from jshard.rules import Rules

import decoders

pytestmark = pytest.mark.fast  # the whole file: step plans, derived without compiling

BATCH = np.random.default_rng(0).integers(0, 64, (16, decoders.CONFIGS["gpt"].seq_len + 1))


def test_the_mesh_is_checked_once_per_step(monkeypatch):
    calls = []
    check = Rules.check_mesh
    monkeypatch.setattr(Rules, "check_mesh", lambda self, mesh: calls.append(mesh) or check(self, mesh))
    build_step(decoders.make("gpt", 0), optax.adamw(1e-3), gpt_loss,
               jshard.Layout.of("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2)))
    assert len(calls) == 1


@pytest.mark.parametrize("preset, sizes, expected", [
    ("dp+fsdp+tp+sp", dict(data=2, fsdp=2, tensor=2),
     dict(batch_axes=("data", "fsdp"), grad_axes=("data", "fsdp"), zero_axes=("fsdp",), tensor_axes=("tensor",),
          sequence_parallel=True, stage_axis=None, data_shards=4)),
    ("dp+cp", dict(data=2, context=4),
     dict(batch_axes=("data",), context_axes=("context",), grad_axes=("data", "context"), context_shards=4,
          sequence_parallel=False, data_shards=2)),
    ("dp+pp", dict(data=2, stage=4), dict(stage_axis="stage", batch_shards=2 * 4, microbatches=4)),
])
def test_the_plan_holds_every_axis_the_step_reads(preset, sizes, expected):
    plan = make_plan(decoders.make("gpt", 0, layers=4),
                     jshard.Layout.of(preset, sizes, microbatches=4 if "stage" in sizes else None))
    assert {name: getattr(plan, name) for name in expected} == expected


def test_the_plan_holds_a_pipelines_uneven_stages():
    """6 layers on 4 stages: the plan says each stage's layers (1, 2, 2, 1) and the rows each holds
    (padded to 2); its params keep the model's shapes, its bytes per device are the held rows'. The
    model outside the step (`jshard.init`, `describe`) holds the stack whole over stage: JAX splits a
    dim only evenly."""
    model, mesh, rules = decoders.make("gpt", 0, layers=6), abstract_mesh(data=2, stage=4), jshard.preset("dp+pp")
    plan = make_plan(model, jshard.Layout.of(rules, mesh, microbatches=4), mesh)
    assert plan.stage_layers == (1, 2, 2, 1) and plan.layer_slots == 2
    stacked = [p for p in plan.params if p.names[0] == "layers"]
    assert stacked and all(p.shape[0] == 6 and p.placement.bytes_per_device == p.bytes // 6 * 2 for p in stacked)
    whole = [r for r in jshard.describe(model, mesh, rules).rows if r.names and r.names[0] == "layers"]
    assert whole and all(r.spec[0] is None for r in whole)


@pytest.mark.parametrize("rows, seq_len, steps, message", [
    (12, None, 1, "batch size 12 does not split over 8 batch shards (data) = 8. Fix: make batch size a multiple of 8."),
    (8, None, 2, "batch size 8 does not split over 8 batch shards (data) × Layout.grad_accum 2 = 16. Fix: make batch size a "
                 "multiple of 16."),
    (None, 36, 1, "sequence length 36: context parallelism over context = 4 cuts each sequence into 8 equal chunks"),
    (None, 30, 1, "sequence length 30: sequence parallelism splits each sequence's tokens over tensor = 4. "
                  "Fix: a sequence length that is a multiple of 4."),
    (None, 12, 1, "sequence length 12: sequence parallelism splits each sequence's tokens on a device over tensor = 4. "
                  "Fix: a sequence length that is a multiple of 8."),  # beside cp=2: 12 / 2 = 6 tokens on a device
])
def test_check_batch_names_the_split_it_misses(rows, seq_len, steps, message):
    strategy, sizes = {None: ("dp", dict(data=8)), 36: ("dp+cp", dict(data=2, context=4)),
                       30: ("dp+tp+sp", dict(data=2, tensor=4)), 12: ("cp+tp+sp", dict(context=2, tensor=4))}[seq_len]
    plan = make_plan(decoders.make("gpt", 0), jshard.Layout.of(strategy, sizes, grad_accum=steps))
    with pytest.raises(jshard.ShardingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan.check_batch(rows, seq_len)


def test_a_step_given_a_sequence_its_tensor_shards_do_not_divide_says_so():
    """From Python the step has no --seq-len to check first: the split itself names the dim and
    the multiple, where JAX's reduce-scatter would raise from deep inside the model."""
    step = build_step(decoders.make("gpt", 0), optax.adamw(1e-3), gpt_loss,
                      jshard.Layout.of("dp+tp+sp", dict(data=2, tensor=4)))
    tokens = np.zeros((4, 15), np.int32)  # 14 tokens in (seq_len 16 fits them), 14 targets
    with pytest.raises(jshard.ShardingError, match=r"splits its dim 1 \(size 14\) over tensor = 4, which does not "
                                                   r"divide it. Fix: make that dim a multiple of 4"):
        step(step.state, step.shard_batch(tokens))


def first_loss(precision, **fields):
    step = build_step(decoders.make("gpt", 0, **fields), optax.adamw(1e-3), gpt_loss,
                      jshard.Layout.of("dp", dict(data=8), precision=precision))
    return float(step.loss(step.state, step.shard_batch(BATCH)))


def test_the_precision_sets_the_compute_dtype():
    """A model whose config leaves `dtype` unset computes as the step's precision says: under
    bf16 exactly as the same model pinned to bf16, and not as under fp32."""
    bf16 = first_loss("bf16")
    assert bf16 == first_loss("bf16", dtype=jnp.bfloat16)
    assert bf16 != first_loss("fp32")
    assert first_loss(None) == first_loss("fp32")  # no policy: float32


@pytest.mark.parametrize("grad_accum", [0, 2.0])
def test_grad_accum_counts_micro_batches(grad_accum):
    with pytest.raises(jshard.ShardingError, match=rf"^Layout.grad_accum={grad_accum!r}: it counts the micro-batches a "
                                                   r"step accumulates gradients over \(1: none\)\. Fix: an integer >= 1\.$"):
        make_plan(decoders.make("gpt", 0), jshard.Layout.of("dp", dict(data=8), grad_accum=grad_accum))


def test_a_batch_grad_accum_does_not_divide_is_refused_in_one_line():
    """By `shard_batch`, and by the step itself for a batch placed without it (when traced: no compile)."""
    step = build_step(decoders.make("gpt", 0), optax.adamw(1e-3), gpt_loss,
                      jshard.Layout.of("dp", dict(data=8), grad_accum=3))
    message = (r"^batch size 16 does not split over 8 batch shards \(data\) × Layout.grad_accum 3 = 24\. "
               r"Fix: make batch size a multiple of 24\.")  # (traced, JAX appends a note of its own below)
    with pytest.raises(jshard.ShardingError, match=message):
        step.shard_batch(BATCH)
    with pytest.raises(jshard.ShardingError, match=message):
        step(step.state, jax.device_put(BATCH, step.plan.batch_sharding))
