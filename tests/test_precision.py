"""Mixed precision (`jshard.precision`): bf16 params and gradients on the devices, an fp32
master and Adam's moments in the optimizer's (ZeRO) layout.

Against one device in fp32 (tests/parity.py): the losses of 3 AdamW steps and the master
after them agree to bf16's 2e-2, on each strategy and pipeline schedule where `mixed` takes a
path of its own. Counted: each collective's bytes in the dtype the program gives it, memory by
ZeRO stage, and the planner against ZeRO's Figure 1.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jshard
from jshard import hlo
from jshard import planner
from jshard.mesh import STANDARD_AXES
from jshard.models import DeepMLP, GPTConfig, MLPConfig, decoder, gpt_loss, mlp_loss
from jshard.parallel import abstract_batch, build_step
from jshard.parallel.schedules import SCHEDULES
from jshard.precision import PRECISIONS, Precision, precision
import decoders
from meshes import STRATEGIES
from parity import BF16_TOLERANCE, OPTIMIZER, OneDeviceRun, assert_trains_like_one_device, train_on_one_device
from seed import SEED
from traffic import collective_bytes

LAYERS = 4  # so that every schedule fits (interleaved: 2 stages × 2 chunks)


@functools.cache
def reference(model_name: str) -> OneDeviceRun:
    """One device, fp32: 3 AdamW steps."""
    rng = np.random.default_rng(SEED)
    batches = [rng.integers(0, decoders.CONFIGS[model_name].vocab, (16, 17)) for _ in range(3)]
    return train_on_one_device(decoders.make(model_name, SEED, layers=LAYERS), OPTIMIZER, gpt_loss, batches)


def dtypes(tree) -> set[str]:
    return {x.dtype.name for x in jax.tree.leaves(tree) if jnp.ndim(x)}


def master_params(step, state) -> nnx.State:
    """The fp32 master, whole and in model order."""
    return step.full_params(step.to_model_order(state))


def assert_mixed_trains_as_fp32(model_name, preset, sizes, **pipeline):
    model = decoders.make(model_name, SEED, layers=LAYERS, dtype=jnp.bfloat16)
    step = build_step(model, OPTIMIZER, gpt_loss, jshard.Layout.of(preset, sizes, precision="mixed", **pipeline))
    assert dtypes(step.state.params) == {"bfloat16"}
    assert dtypes(step.state.master) == dtypes(step.state.opt_state) == {"float32"}
    state = assert_trains_like_one_device(step, reference(model_name), "master", BF16_TOLERANCE, master_params)
    assert dtypes(state.params) == {"bfloat16"} and dtypes(state.master) == {"float32"}


# What `mixed` changes is per ZeRO stage (the master's layout) and per collective of the
# activations (TP, SP, CP in bf16). dp+fsdp and fsdp+tp are left out: dp+fsdp+tp runs ZeRO-3
# with both batch axes and TP; dp+cp too: cp runs the ring alone, dp+cp+tp beside a batch axis.
MIXED_STRATEGIES = [(p, sizes) for p, sizes in STRATEGIES if p not in ("dp+fsdp", "fsdp+tp", "dp+cp")]


@pytest.mark.parametrize("preset, sizes", MIXED_STRATEGIES, ids=[p for p, _ in MIXED_STRATEGIES])
def test_mixed_matches_fp32_on_one_device(preset, sizes):
    assert_mixed_trains_as_fp32("gpt", preset, sizes)


# gpipe is left out: it runs 1f1b's actions (F and BW on one chunk) in another order, and the
# fp32 accumulation of bf16 gradients is the same code under every schedule.
@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != "gpipe"])
def test_mixed_pipeline_matches_fp32_on_one_device(schedule):
    assert_mixed_trains_as_fp32("gpt", "dp+pp", dict(data=4, stage=2), microbatches=4, schedule=schedule)


def test_mixed_llama_under_every_axis_matches_fp32_on_one_device():
    assert_mixed_trains_as_fp32("llama", "dp+fsdp+tp+sp", dict(data=2, fsdp=2, tensor=2))


# -- bytes, in the program's dtypes ----------------------------------------------------------

MLP = MLPConfig(dim=64, layers=4, dtype=jnp.bfloat16)
MLP_BATCH = np.ones((16, MLP.dim), np.float32)


@functools.cache
def mlp_step(preset: str, sizes: tuple[tuple[str, int], ...], policy: Precision):
    """The MLP's step under `policy` (its compute dtype), one object per program: the tests here
    and test_fp8's that lower the same one share its compilation (JAX keeps a jitted function's
    lowering and executable). Only lowered, never called: built from shapes (`abstract`: the program
    of the step built on the devices, no params made)."""
    model = nnx.eval_shape(lambda: DeepMLP(dataclasses.replace(MLP, dtype=policy.compute), rngs=nnx.Rngs(0)))
    return build_step(model, OPTIMIZER, mlp_loss, jshard.Layout.of(preset, dict(sizes), precision=policy),
                      jshard.make_mesh(**dict(sizes)), abstract=True)


def program_traffic(preset, sizes, policy) -> dict[str, int]:
    step = mlp_step(preset, tuple(sizes.items()), precision(policy))
    return collective_bytes(step, MLP_BATCH, min_bytes=8)  # not the loss's scalar


@pytest.mark.parametrize("preset, sizes, reduce, expected", [
    # in units of Ψ/2, the params' bf16 bytes: gathers move bf16, reductions the reduction dtype
    ("dp", dict(data=8), "fp32", {"all-reduce": 2}),
    ("dp", dict(data=8), "bf16", {"all-reduce": 1}),
    ("zero1", dict(fsdp=8), "fp32", {"reduce-scatter": 2, "all-gather": 1}),
    ("zero2", dict(fsdp=8), "fp32", {"reduce-scatter": 2, "all-gather": 1}),
    ("zero2", dict(fsdp=8), "bf16", {"reduce-scatter": 1, "all-gather": 1}),
    ("zero3", dict(fsdp=8), "fp32", {"reduce-scatter": 1, "all-gather": 2}),  # its transpose: bf16
])
def test_mixed_moves_bf16_params_and_reduces_in_its_dtype(preset, sizes, reduce, expected):
    half_psi = sum(x.size for x in jax.tree.leaves(nnx.state(DeepMLP(MLP, rngs=nnx.Rngs(0))))) * 2
    assert program_traffic(preset, sizes, precision("mixed", reduce)) == {k: n * half_psi for k, n in expected.items()}


def test_zero3_under_mixed_moves_half_the_bytes_of_fp32():
    fp32, mixed = (sum(program_traffic("zero3", dict(fsdp=8), name).values()) for name in ("fp32", "mixed"))
    assert mixed / fp32 == 0.5


def test_zero3_under_bf16_compute_gathers_bf16_and_again_in_backward():
    """fp32 params, bf16 compute: each weight is cast before it is gathered, so the gathers
    move bf16, and backward gathers again (what it computes with is the gather's output)."""
    half_psi = sum(x.size for x in jax.tree.leaves(nnx.state(DeepMLP(MLP, rngs=nnx.Rngs(0))))) * 2
    assert program_traffic("zero3", dict(fsdp=8), "bf16") == {"all-gather": 2 * half_psi, "reduce-scatter": half_psi}


def test_collective_bytes_follow_the_programs_dtype_not_xla_cpus():
    """XLA:CPU widens a bf16 all-gather to f32; counted with the program, it is bf16 again."""
    step = mlp_step("zero3", (("fsdp", 8),), precision("mixed"))
    lowered = step.lower(step.state, step.shard_batch(MLP_BATCH))
    compiled = lowered.compile().as_text()
    gathers = [c for c in hlo.collectives(compiled, lowered.as_text()) if c.kind == "all-gather"]
    as_compiled = [c for c in hlo.collectives(compiled) if c.kind == "all-gather"]
    assert [2 * c.bytes for c in gathers] == [c.bytes for c in as_compiled] and gathers


# -- memory and the planner --------------------------------------------------------------------


def test_memory_falls_with_each_zero_stage_under_mixed():
    """DP > ZeRO-1 > ZeRO-2 > ZeRO-3 per device (compiled), bf16 params and compute on the GPT:
    ZeRO-2 scatters each layer's gradient in the backward scan, so no layer's full gradient
    outlives its layer. (The fp32 case is test_strategies' on the MLP. The MLP's mixed case is
    not a test on CPU: XLA:CPU widens the final bf16 all-gather of the params to an f32
    temporary, 4Ψ, the peak of ZeRO-1 and ZeRO-2 alike; the GPT's activations make the
    difference visible.)"""
    policy = PRECISIONS["mixed"]
    config = GPTConfig(vocab=256, seq_len=32, embed=128, heads=4, mlp=512, layers=4, dtype=policy.compute)
    model = nnx.eval_shape(lambda: decoder(config, nnx.Rngs(0)))  # only compiled: no params made

    def per_device(preset, sizes):
        # `abstract`: the program of the step built on the devices (test_abstract_step), compiled for them
        step = build_step(model, OPTIMIZER, gpt_loss, jshard.Layout.of(preset, sizes, precision=policy),
                          jshard.make_mesh(**sizes), abstract=True)
        m = step.lower(step.state, abstract_batch(step.plan, (16, 33), np.int32)).compile().memory_analysis()
        return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes

    sizes = [per_device("dp", dict(data=8))] + [per_device(f"zero{s}", dict(fsdp=8)) for s in (1, 2, 3)]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4, sizes


# ZeRO's Figure 1: 7.5 B params on 64 devices, mixed precision with Adam (16 bytes per param).
FIGURE_1_MODEL = GPTConfig(layers=36, embed=4096, heads=32, mlp=16384, vocab=51200, seq_len=1024,
                           dtype=jnp.bfloat16)
FIGURE_1_GB = {"dp": 120, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}


@pytest.mark.parametrize("strategy", FIGURE_1_GB)
def test_planner_reproduces_zero_figure_1(strategy):
    sizes = {a: 1 for a in STANDARD_AXES} | ({"data": 64} if strategy == "dp" else {"fsdp": 64})
    est = planner.estimate(planner.PlanInput(FIGURE_1_MODEL, jshard.Layout.of(strategy, sizes, precision="mixed")))
    assert abs(est["model_state_bytes"] / 1e9 / FIGURE_1_GB[strategy] - 1) <= 0.10, est["memory_bytes_per_device"]


def test_bad_precision_is_refused():
    with pytest.raises(ValueError, match="choose one of fp32, bf16, mixed"):
        precision("fp16")
    with pytest.raises(ValueError, match="choose one of fp32, bf16"):
        precision("mixed", "fp8")
    with pytest.raises(jshard.ShardingError, match="compiler-placed step"):
        build_step(DeepMLP(MLP, rngs=nnx.Rngs(0)), OPTIMIZER, mlp_loss,
                   jshard.Layout.of("dp", dict(data=8), precision="mixed"), collectives="compiler")
