"""The gpu_compile tier: jshard's steps compiled by XLA's GPU compiler for 8 and 16 H100s on
this CPU machine (`jshard.aot`), against the planner. Skipped, with the reason, where the CUDA
plugin is not installed (`make venv GPU_COMPILE=1`; CI's newest-JAX run has it).

Per case (a covering set: dp, ZeRO-3, tp, tp + sp, a 1F1B pipeline, cp, ep, a two-host mesh):
collective bytes equal to the planner's for the GPU (`jshard plan --validate --target` on that
row), then what only the GPU program shows: bf16 collectives under `mixed`, ZeRO-3's gathers
asynchronous with a matmul scheduled beside them inside the layer scan, cuDNN's attention.
The programs at real shapes (Llama 3.1 8B, GPT layers 2048 wide) are `test_gpu_compile_8b.py`'s:
the tier's other half, so that pytest-xdist's two workers share it.
"""

import dataclasses
import functools

import optax
import pytest
from flax import nnx

import jshard
from gpu_compiler import GPU_COMPILE, NEEDS_CUDNN
from jshard import aot
from jshard.mesh import SCATTER_OVERLAP_OPTIONS
from jshard.models import decoder, gpt_loss
from jshard.parallel import make_plan
from jshard.planner.estimate import PlanInput, estimate
from jshard.planner.hardware import HARDWARE
from jshard.planner.validate import (MEMORY_TOLERANCE, VALIDATION_MODELS, example_mesh, validate_one,
                                  validation_models)

pytestmark = GPU_COMPILE


@functools.cache
def validated(case: tuple, model: str, target: str, platform: str) -> dict:
    """`validate_one` of `case` on `validation_models(platform)[model]` for `target`'s GPUs,
    compiled once a module: a row held to both its bytes and its memory compiles once (every
    argument positional and given, so that one row has one cache key)."""
    t = aot.target(target)
    return validate_one(*case, model=validation_models(platform)[model], devices=aot.target_devices(t),
                        hardware=t.hardware)


# (strategy, micro-batches, schedule, remat, mesh, precision, stage remat, rows), model, target. ZeRO-3's
# Llama under mixed is `test_zero3_mixed_bytes_are_the_planners`, from the `zero3_mixed` program.
CASES = [
    (("dp", None, None, "none", "example", "mixed"), "gpt", "h100x8"),
    pytest.param(("dp+fsdp+tp+sp", None, None, "none", "example", "bf16"), "gpt", "h100x8", marks=pytest.mark.xfail(
        strict=True, reason="XLA:GPU reassociates the position table's gradient under sp (its tensor all-reduce, "
                            "16 KiB bf16, becomes 32 KiB more fsdp reduce-scatter in f32); the planner does not model it yet")),
    (("dp+tp", None, None, "full", "example", "mixed"), "llama", "h100x8"),  # q's and kv's input gradients: one all-reduce
    (("dp+tp+sp", None, None, "none"), "gpt", "h100x8"),  # the final norm's gradient: one all-reduce over data+tensor
    (("dp+pp", 4, "1f1b", "none"), "gpt", "h100x8"),
    (("cp", None, None, "none", "example", "fp32", None, 8), "gpt", "h100x8"),  # the ring's combined permutes
    (("dp+cp+tp", None, None, "none", "example", "fp32", None, 8), "llama", "h100x8"),
    (("dp+ep", None, None, "none"), "moe", "h100x8"),
    (("dp+fsdp", None, None, "none", "example", "mixed"), "llama", "h100x16"),  # data crosses the two hosts
]


@pytest.mark.parametrize("case, model, target", CASES,
                         ids=[f"{c[0]}-{m}-{t}" for c, m, t in (getattr(c, "values", c) for c in CASES)])
def test_collective_bytes_are_the_planners(case, model, target):
    row = validated(case, model, target, "cpu")
    assert row["comm_exact"], f"{row['strategy']}: planned {row['comm_predicted']}, compiled {row['comm_compiled']}"


# Rows each held to XLA:GPU by its own GPU memory term; without it they read 10% to 16% low.
GPU_MEMORY_ROWS = [
    (("dp", None, None, "full"), "gpt"),  # the gradient reduction's peak (`memory.reduction_bytes`)
    (("dp", None, None, "none", "example", "mixed"), "gpt"),  # the same: bf16 activations beside an f32 reduction
    (("zero2", None, None, "none", "example", "mixed"), "llama"),  # the same, reduce-scattered onto shards
    (("dp+pp", 4, "1f1b", "none", "example", "fp32", "full"), "llama"),  # a recomputing stage (`stage_recompute`)
]


@pytest.mark.parametrize("case, model", GPU_MEMORY_ROWS,
                         ids=["-".join(map(str, c[:4])) + f"-{m}" for c, m in GPU_MEMORY_ROWS])
def test_gpu_memory_terms(case, model):
    row = validated(case, model, "h100x8", "cpu")
    assert abs(row["memory_rel_err"]) <= MEMORY_TOLERANCE, row


# Rows that read 15% (zero3, fp32) and 26% (zero3, mixed) low on the CPU's validation models,
# where XLA:GPU's untuned split-K GEMM partials are a constant that sets the peak; on the GPU
# validation models (`validation_models("gpu")`, as `jshard plan --validate --target` runs them)
# the planner's terms set it. GPT zero3 fp32 read +10.8% when the GPU table kept 1.75 per element
# of attention's projections and 0.625 of the MLP's (and XLA's attention 0.9 more); zero2 under
# mixed −12.1..−14.3% at 8 layers, where XLA's heap packing alone is 14-17% over the live peak.
# A kept 1F1B pipeline (a tick's record copied, one layer's backward, the carry in place) reads
# −11.3% on the small models, whose split-K constants are a larger share of its smaller peak.
GPU_SCALE_ROWS = [
    (("dp+pp", 4, "1f1b", "none"), "gpt"),
    (("zero3", None, None, "none"), "gpt"),
    (("zero3", None, None, "none"), "llama"),
    (("zero2", None, None, "none", "example", "mixed"), "llama"),
]


def _scale_row_id(case, model) -> str:
    return "-".join(map(str, case[:4])) + f"-{case[5] if len(case) > 5 else 'fp32'}-{model}"


@pytest.mark.parametrize("case, model", GPU_SCALE_ROWS,
                         ids=[_scale_row_id(*p) for p in GPU_SCALE_ROWS])
def test_gpu_validation_rows_on_the_gpu_validation_models(case, model):
    row = validated(case, model, "h100x8", "gpu")
    assert row["comm_exact"] and abs(row["memory_rel_err"]) <= MEMORY_TOLERANCE, row


def test_fp8_scales_under_remat_are_the_planners():
    """Under full remat the layer's forward runs again and all-reduces each FP8 kernel's scale
    again: four times a layer on XLA:GPU (its pipeliner's early one in each loop), bytes exact.
    (Memory: 9.3% under with the fourth gathered layer counted, 11.6% without.)"""
    row = validated(("zero3", None, None, "full", "example", "fp8"), "llama", "h100x8", "gpu")
    assert row["comm_exact"], row


def zero3_llama(precision: str):
    """The validation Llama (head dim 16) under ZeRO-3 on 8 H100s, compiled under `precision`."""
    config = VALIDATION_MODELS["llama"]
    model = nnx.eval_shape(lambda: decoder(config, nnx.Rngs(0)))
    return aot.compile_step(model, optax.adamw(1e-3), gpt_loss,
                            jshard.Layout.of("zero3", example_mesh("zero3"), precision=precision),
                            aot.target("h100x8"), (16, config.seq_len + 1))


def planned_zero3_llama(precision: str) -> dict:
    """The planner's estimate for `zero3_llama(precision)`: 2 rows a device, on H100s."""
    return estimate(PlanInput(VALIDATION_MODELS["llama"],
                              jshard.Layout.of("zero3", dict(example_mesh("zero3")), precision=precision,
                                               micro_batch_size=2), HARDWARE["h100"]))


@pytest.fixture(scope="module")
def zero3_mixed():
    """bf16 params and compute."""
    return zero3_llama("mixed")


def test_zero3_mixed_bytes_are_the_planners(zero3_mixed):
    """`test_collective_bytes_are_the_planners`'s ZeRO-3 Llama row under mixed (the same step as
    `validate_one` builds for it), per kind and axes."""
    compared = aot.compared(zero3_mixed, planned_zero3_llama("mixed"))
    assert compared["bytes_exact"], compared["bytes"]


def test_mixed_moves_weights_and_gradients_in_bf16(zero3_mixed):
    """XLA:CPU would widen these to f32; the GPU program keeps ZeRO-3's gathers and
    reduce-scatters in bf16, and the lookup's rows (its all-to-all, `nn.Embed`; its ids gathered
    as int32; the loss's scalar all-reduce stays f32)."""
    moved = {(c["kind"], d) for c in zero3_mixed.collectives if c["bytes"] > 4 for d in c["bytes_by_dtype"]}
    assert moved == {("all-gather", "bf16"), ("reduce-scatter", "bf16"), ("all-to-all", "bf16"), ("all-gather", "s32")}


def test_zero3_gathers_overlap_matmuls_inside_the_layer_scan(zero3_mixed):
    """Under jshard's GPU flags (`mesh.GPU_XLA_FLAGS`: pipelined all-gathers) the scan over
    layers (its first trip peeled off) gathers the next layer's weights beside this one's matmuls."""
    layers = VALIDATION_MODELS["llama"].layers
    in_loop = [c for c in zero3_mixed.collectives if c["kind"] == "all-gather" and c["count"] >= layers - 1]
    assert in_loop and all(c["asynchronous"] for c in in_loop)
    assert any(c["overlapped"] for c in in_loop)
    assert zero3_mixed.overlap()["all-gather"] > 0


@pytest.fixture(scope="module")
def zero3_fp8():
    """`zero3_mixed` under `fp8`: the projections' products in FP8."""
    return zero3_llama("fp8")


def test_fp8_projections_are_cublas_fp8_gemms(zero3_fp8, zero3_mixed):
    """Each of a layer's five projections (q, kv, out, gate_up, down): forward and both
    gradients as cuBLASLt FP8 GEMMs (`__cublas$lt$matmul$f8`; XLA's Triton GEMMs and its dot
    merger are off for such programs, `Plan.xla_options`); only the head's three stay bf16."""
    kernels = zero3_fp8.kernels
    assert kernels["cublas_fp8"] >= 3 * 5 and kernels["cublas"] - kernels["cublas_fp8"] <= 3
    assert zero3_mixed.kernels["cublas_fp8"] == 0


def test_fp8_zero3_gathers_move_e4m3_bytes_as_planned(zero3_fp8, zero3_mixed):
    """ZeRO-3 gathers the projections in e4m3 (forward and backward's re-gather) and the rest in
    bf16; gradients reduce-scatter in bf16; the bytes are the planner's (`validate_one`)."""
    gathered = {}
    for c in zero3_fp8.collectives:
        if c["kind"] == "all-gather":
            for dtype, n in c["bytes_by_dtype"].items():
                gathered[dtype] = gathered.get(dtype, 0) + n
    assert gathered["f8e4m3fn"] > gathered.get("bf16", 0)
    assert sum(gathered.values()) < zero3_mixed.bytes_by_kind_and_axes()[("all-gather", "fsdp")]
    compared = aot.compared(zero3_fp8, planned_zero3_llama("fp8"))
    assert compared["bytes_exact"], compared["bytes"]


@NEEDS_CUDNN
def test_attention_is_cudnns_for_the_gpu_on_a_cpu_host(zero3_mixed):
    """`--attention auto` picks the kernel for the step's devices, not this host's backend."""
    assert zero3_mixed.attention == "cudnn" and "__cudnn$fmha" in zero3_mixed.hlo


def test_zero_steps_without_tensor_parallelism_get_their_own_xla_options(monkeypatch):
    """`Plan.xla_options`, per program: 4 collectives in flight (`mesh.ZERO3_COLLECTIVES_IN_FLIGHT`)
    for ZeRO-3 steps without a tensor axis, Triton GEMMs off for those in bf16 compute, and under
    full remat `mesh.SCATTER_OVERLAP_OPTIONS`; 2 in flight where the layers are rematerialised
    (`mesh.REMAT_COLLECTIVES_IN_FLIGHT`; not under FP8); XLA_FLAGS that set them win."""
    devices = aot.target_devices(aot.target("h100x8"))

    def options(strategy: str, precision: str = "bf16", remat: str = "full", **sizes):
        config = dataclasses.replace(VALIDATION_MODELS["llama"], remat=remat)
        layout = jshard.Layout.of(strategy, sizes, precision=precision)
        model = nnx.eval_shape(lambda: decoder(config, nnx.Rngs(0)))
        return make_plan(model, layout, jshard.make_mesh(devices, **sizes)).xla_options

    limit = "xla_gpu_experimental_parallel_collective_overlap_limit"
    in_flight = {limit: 4}
    # ZeRO-3's scatters beside cuBLAS matmuls, no tensor axis; under full remat the loop
    # double-buffered, and two collectives in flight
    no_triton = {"xla_gpu_enable_triton_gemm": False} | SCATTER_OVERLAP_OPTIONS
    assert options("zero3", fsdp=8) == {limit: 2} | no_triton
    assert options("dp+zero3", "mixed", data=2, fsdp=4) == {limit: 2} | no_triton
    assert options("zero3", "fp8", fsdp=8)[limit] == 4
    # without full remat the double buffering costs the gathers: Triton GEMMs off alone
    assert options("zero3", remat="none", fsdp=8) == in_flight | {"xla_gpu_enable_triton_gemm": False}
    assert options("zero3", remat="selective", fsdp=8) == {limit: 2, "xla_gpu_enable_triton_gemm": False}
    assert options("dp+zero3+tp", data=2, fsdp=2, tensor=2) == {} and options("dp", data=8) == {}
    assert options("zero2", fsdp=8) == {} and options("zero1", fsdp=8) == {}
    assert options("zero3", "fp32", fsdp=8) == in_flight  # fp32 compute keeps XLA's Triton GEMMs
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_experimental_parallel_collective_overlap_limit=2 "
                                    "--xla_gpu_enable_triton_gemm=true "
                                    "--xla_gpu_enable_while_loop_double_buffering=false")  # the user's flags win
    assert options("zero3", fsdp=8) == {k: v for k, v in SCATTER_OVERLAP_OPTIONS.items() if "double_buffering" not in k}


def test_hsdp_sums_over_data_in_the_backward_under_tensor_parallelism_or_across_hosts():
    """`Plan.summed_in_backward`: each stacked layer's weight has its gradient summed over `data`
    inside the backward under tensor parallelism, or where `data` crosses hosts (h100x16's two);
    on one host without a tensor axis, after the backward (XLA:GPU hides the scatters there);
    never the weights outside the stack, nor with accumulated micro-batches."""

    def summed(target: str, strategy: str, grad_accum: int = 1, **sizes) -> set:
        devices = aot.target_devices(aot.target(target))
        model = nnx.eval_shape(lambda: decoder(VALIDATION_MODELS["llama"], nnx.Rngs(0)))
        plan = make_plan(model, jshard.Layout.of(strategy, sizes, grad_accum=grad_accum), jshard.make_mesh(devices, **sizes))
        stacked = {p.placement.names[0] == "layers" for p in plan.params}
        assert stacked == {True, False}
        return {(p.placement.names[0] == "layers", axes) for p, axes in zip(plan.params, plan.summed_in_backward)}

    assert summed("h100x16", "dp+fsdp", data=2, fsdp=8) == {(True, ("data",)), (False, ())}
    assert summed("h100x8", "dp+fsdp+tp", data=2, fsdp=2, tensor=2) == {(True, ("data",)), (False, ())}
    assert summed("h100x8", "dp+fsdp", data=2, fsdp=4) == {(True, ()), (False, ())}
    assert summed("h100x16", "dp+fsdp", grad_accum=2, data=2, fsdp=8) == {(True, ()), (False, ())}
    assert summed("h100x16", "fsdp", fsdp=16) == {(True, ()), (False, ())}  # no axis left to sum over


def test_train_prints_the_programs_own_options_on_a_gpu():
    """`jshard train`'s devices line on a GPU names the flags in effect and the step's own options
    (`app.report.xla_text`), as `jshard compile` does; on a CPU, neither."""
    from jshard.app.report import xla_text

    devices = aot.target_devices(aot.target("h100x8"))
    model = nnx.eval_shape(lambda: decoder(dataclasses.replace(VALIDATION_MODELS["llama"], remat="full"), nnx.Rngs(0)))
    plan = make_plan(model, jshard.Layout.of("zero3", dict(fsdp=8), precision="bf16"), jshard.make_mesh(devices, fsdp=8))
    text = xla_text(plan, "gpu")
    assert text.startswith("; XLA_FLAGS ") and "; this program's own options " in text
    assert "--xla_gpu_experimental_parallel_collective_overlap_limit=2" in text and "--xla_gpu_enable_triton_gemm=false" in text
    assert xla_text(plan, "cpu") == ""
