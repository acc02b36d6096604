"""`jshard bench step`: jshard's train step against a plain Flax step and the device's limits.

One run, on the same devices:

    matmul_tflops      the device's own compute ceiling: the best of repeated square matmuls
                       in the compute dtype (8192² on a GPU, 1024² on a CPU host)
    copy_gbps          its memory ceiling: a large copy from one device to the next where
                       the mesh has two or more, else on one device (read + write counted)
    step_s             jshard's train step (`build_step`: jit of shard_map) with AdamW,
                       warmed up, then the median of `--repeats` synchronised steps, timed
                       in alternation with the plain step's (both see the same host load)
    plain_step_s       the same model written in plain Flax NNX + optax (`bench/plain.py`: no jshard
                       layer, rule or step), through `jax.jit`, timed the same way; it starts
                       from jshard's initial weights and the first losses are compared, so it
                       is the same model. On a mesh of more than one device it is plain data
                       parallelism (batch split, params replicated, XLA's partitioner)
    overhead_ratio     step_s / plain_step_s: on the default mesh of one device, what jshard
                       costs over a hand-written step
    programs           each step's program as compiled for this device: memory per device
                       (memory_analysis(): arguments, outputs, aliased, temporaries, total),
                       its kernels by kind (`hlo.kernel_counts`), attention's kernel, compile s
    tokens_per_s, tflops, mfu_*   jshard's step: model FLOPs (6·N + attention, `jshard.metrics`)
                       over the datasheet peak (GPUs jshard knows; null elsewhere) and over
                       the measured matmul peak

On a CPU the default model is `tiny` and there is no datasheet: MFU is against the measured
matmul peak only. On a GPU jshard adds its XLA flags (`jshard.mesh.GPU_XLA_FLAGS`) to XLA_FLAGS,
a flag the user sets keeping the user's value, and the defaults are a ~1B-parameter GPT at seq-len 2048 in bf16.
"""

from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jshard
from jshard import hlo
from jshard.aot import attention_kernel, memory_of
from jshard.layout import Layout
from jshard.mesh import mesh_shape, mesh_text
from jshard.metrics import (CPU_MATMUL, PROFILE_STEPS, best_seconds, device_peak, flops_per_token,
                            measured_fp8_matmul_flops, measured_matmul_flops)
from jshard.bench.plain import PlainDecoder, plain_from, plain_loss
from jshard.models import DecoderConfig, decoder, gpt_loss
from jshard.parallel import build_step
from jshard.precision import Precision

# Per platform: model, batch size, precision when not given.
DEFAULTS = {"cpu": ("tiny", 16, "fp32"), "gpu": ("gpt-1b", 8, "bf16")}
GPU_MATMUL = 8192  # large enough that one bf16 matmul runs at the tensor cores' sustained rate
COPY_BYTES = {"cpu": 64 * 2**20, "gpu": 2**30}
CEILING_REPEATS = 10
JSON_KEYS = ("device", "model_params", "tokens_per_s", "tflops", "mfu_datasheet", "mfu_measured_peak",
             "plain_step_s", "step_s", "overhead_ratio", "matmul_tflops", "fp8_matmul_tflops", "copy_gbps", "programs")


def plain_step(model: PlainDecoder, tx, devices):
    """A plain train step: `jax.jit` of split/merge (Flax's fast path: `nnx.jit` would walk
    the object graph in Python every call, which the baseline must not pay and jshard does
    not), donated state, batch split over `devices`, params and optimizer state replicated."""
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    # Auto: XLA's partitioner propagates the batch split (jax.make_mesh defaults to Explicit).
    mesh = jax.make_mesh((len(devices),), ("batch",), axis_types=(AxisType.Auto,), devices=devices)
    replicated, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("batch"))
    graph = nnx.graphdef((model, optimizer))
    state = jax.device_put(nnx.state((model, optimizer)), replicated)

    def step_fn(state, tokens):
        model, optimizer = nnx.merge(graph, state)
        loss, grads = nnx.value_and_grad(plain_loss)(model, tokens)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return jax.jit(step_fn, donate_argnums=0, out_shardings=(replicated, None)), state, rows


# -- measuring ------------------------------------------------------------------------------


def compiled_for_device(step_fn, *args):
    """`step_fn` (a jitted step) compiled ahead for `args`, and what the compiler made of it:
    the executable runs exactly what a call would, and says its memory and kernels."""
    start = time.perf_counter()
    compiled = step_fn.lower(*args).compile()
    text = compiled.as_text()
    return compiled, dict(memory=memory_of(compiled), kernels=hlo.kernel_counts(text),
                          attention=attention_kernel(text), compile_s=time.perf_counter() - start)


def _timed_pair(steps, repeats: int, profile: str | None = None) -> list[tuple[float, float]]:
    """Per (step_fn, state, tokens): (median seconds per step, first step's loss).

    Both steps are warmed up, then timed in alternation, one step of each per
    round: load from other processes drifts on a shared host, and alternating gives both the
    same drift, so their ratio stays honest. Every step waits for all its outputs. With
    `profile`, `PROFILE_STEPS` more of each are traced there afterwards, each step
    annotated with its name (`jshard step`, `plain step`) and number in the trace.
    """
    states = [state for _, state, _ in steps]
    first_losses, times = [], [[] for _ in steps]

    def once(i):
        step_fn, _, tokens = steps[i]
        start = time.perf_counter()
        states[i], loss = jax.block_until_ready(step_fn(states[i], tokens))
        return time.perf_counter() - start, loss

    for i in range(len(steps)):
        first_losses.append(float(once(i)[1]))  # warms up (the executables are compiled ahead)
    for _ in range(repeats):
        for i in range(len(steps)):
            times[i].append(once(i)[0])
    if profile:
        with jax.profiler.trace(profile, create_perfetto_trace=True):
            for i, name in enumerate(("jshard", "plain")):
                for n in range(PROFILE_STEPS):
                    with jax.profiler.StepTraceAnnotation(f"{name} step", step_num=n):
                        once(i)
    return [(statistics.median(t), loss) for t, loss in zip(times, first_losses)]


def copy_gbps(devices, nbytes: int) -> float:
    """Best GB/s of a `nbytes` copy: device 0 to device 1 where there are two (bytes sent),
    else on one device (read + write, as memory bandwidth is quoted)."""
    x = jax.device_put(jnp.zeros(nbytes // 4, jnp.float32), devices[0])
    if len(devices) > 1:
        copy, moved = (lambda: jax.device_put(x, devices[1])), nbytes
    else:
        copy_fn = jax.jit(jnp.copy)  # compiles to one XLA copy into a new buffer
        copy, moved = (lambda: copy_fn(x)), 2 * nbytes
    return moved / best_seconds(lambda: copy().block_until_ready(), CEILING_REPEATS) / 1e9


def measure(sizes: dict[str, int], strategy: str, name: str, config: DecoderConfig, seq: int, batch: int,
            precision: Precision, repeats: int = 10, profile: str | None = None, grad_accum: int = 1) -> dict:
    """Every figure of one run of model `config` (called `name`) on mesh `sizes` under `strategy`:
    the JSON keys, plus what the report prints. `grad_accum`: jshard's step accumulates that many
    micro-batches of the batch; the plain step takes it whole."""
    wanted = math.prod(sizes.values())
    devices = jax.devices() if -1 in sizes.values() else jax.devices()[:wanted]
    platform, kind = devices[0].platform, devices[0].device_kind
    mesh = jshard.make_mesh(devices=devices, **sizes)
    devices = list(mesh.devices.flat)

    matmul = measured_matmul_flops(devices[0], precision.compute, CPU_MATMUL if platform == "cpu" else GPU_MATMUL,
                                    CEILING_REPEATS)
    fp8_matmul = measured_fp8_matmul_flops(devices[0], CPU_MATMUL if platform == "cpu" else GPU_MATMUL,
                                           CEILING_REPEATS) if precision.fp8 else None
    copy = copy_gbps(devices, COPY_BYTES["cpu" if platform == "cpu" else "gpu"])
    # Fake CPU devices share the host's cores: the host's matmul is the peak of them all.
    measured_peak = matmul * (1 if platform == "cpu" else len(devices))
    datasheet = None if platform == "cpu" else device_peak(devices, precision.compute)

    tokens = np.random.default_rng(0).integers(0, config.vocab, (batch, seq + 1))
    tx = optax.adamw(1e-4)
    model = decoder(config, nnx.Rngs(0))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    plain = plain_from(model, precision.compute)  # before build_step takes the model's arrays

    step = build_step(model, tx, gpt_loss, Layout.of(strategy, mesh, precision=precision, grad_accum=grad_accum), mesh)
    plain_fn, plain_state, rows = plain_step(plain, tx, devices)
    del model, plain  # the steps hold their own state now
    step_tokens, plain_tokens = step.shard_batch(tokens), jax.device_put(tokens, rows)
    step_exe, step_program = compiled_for_device(step, step.state, step_tokens)
    plain_exe, plain_program = compiled_for_device(plain_fn, plain_state, plain_tokens)
    (step_s, loss), (plain_s, plain_first_loss) = _timed_pair(
        [(step_exe, step.state, step_tokens), (plain_exe, plain_state, plain_tokens)], repeats, profile)

    flops = flops_per_token(config, seq) * batch * seq / step_s
    return dict(
        device=f"{len(devices)} x {kind}", model_params=int(params), tokens_per_s=batch * seq / step_s,
        tflops=flops / 1e12, mfu_datasheet=flops / datasheet.flops if datasheet else None,
        mfu_measured_peak=flops / measured_peak, plain_step_s=plain_s, step_s=step_s,
        overhead_ratio=step_s / plain_s, matmul_tflops=matmul / 1e12, copy_gbps=copy,
        fp8_matmul_tflops=fp8_matmul and fp8_matmul / 1e12,
        programs=dict(jshard=step_program, plain=plain_program),
        # for the report only
        platform=platform, model=name, config=config, seq=seq, batch=batch, precision=precision,
        datasheet_source=datasheet.source if datasheet else None, loss=loss, plain_loss=plain_first_loss,
        plain_tokens_per_s=batch * seq / plain_s, plain_tflops=flops * step_s / plain_s / 1e12,
        plain_mfu_measured_peak=flops * step_s / plain_s / measured_peak, n_devices=len(devices),
        mesh=mesh_text(mesh_shape(mesh)), strategy=strategy, repeats=repeats, profile=profile,
        grad_accum=grad_accum,
    )


def _mfu(value) -> str:
    return "n/a" if value is None else f"{value:.2%}"


def report(r: dict, flags: str) -> str:
    c = r["config"]
    copy_what = "device 0 -> device 1" if r["n_devices"] > 1 else "on one device, read + write"
    matmul_n = CPU_MATMUL if r["platform"] == "cpu" else GPU_MATMUL
    lines = [
        f"# jshard bench step: {r['device']} ({r['platform']}), jax {jax.__version__}, XLA flags: {flags}",
        f"  model       {c.family} {r['model']}: {c.layers} layers, embed {c.embed}, {c.heads} heads, "
        f"mlp {c.mlp}, "
        f"vocab {c.vocab}, {r['model_params'] / 1e6:.3f} M params",
        f"  step        batch {r['batch']} x seq {r['seq']}"
        + (f" in {r['grad_accum']} accumulated micro-batches (plain: whole)" if r["grad_accum"] > 1 else "")
        + f", precision {r['precision'].describe()}, AdamW, {r['strategy']} on "
        f"{r['mesh']}; warm-up, then median of {r['repeats']}, alternating with plain",
        f"  ceilings    matmul {matmul_n}² {r['precision'].compute.name}: {r['matmul_tflops']:.3f} TFLOP/s per device; "
        f"copy ({copy_what}): {r['copy_gbps']:.1f} GB/s"
        + (f"; FP8 matmul {matmul_n}² (e4m3): {r['fp8_matmul_tflops']:.3f} TFLOP/s" if r["fp8_matmul_tflops"] else ""),
        f"  jshard      {r['step_s'] * 1e3:9.2f} ms  {r['tokens_per_s'] / 1e3:9.1f} k tok/s  {r['tflops']:8.4f} TFLOP/s  "
        f"MFU {_mfu(r['mfu_datasheet'])} of datasheet, {_mfu(r['mfu_measured_peak'])} of measured matmul",
        f"  plain Flax  {r['plain_step_s'] * 1e3:9.2f} ms  {r['plain_tokens_per_s'] / 1e3:9.1f} k tok/s  "
        f"{r['plain_tflops']:8.4f} TFLOP/s  MFU {_mfu(r['plain_mfu_measured_peak'])} of measured matmul",
        f"  overhead    jshard / plain step time = {r['overhead_ratio']:.3f}",
        f"  same model  first-step loss jshard {r['loss']:.6f}, plain {r['plain_loss']:.6f} (same initial weights)",
    ]
    if r["platform"] == "cpu":
        lines.append("  note        CPU: no datasheet peak; MFU is against the measured matmul peak only")
    else:
        lines.append(f"  datasheet   {r['datasheet_source'] or 'none known for this device: MFU against measured only'}")
    if r["profile"]:
        lines.append(f"  profile     {r['profile']}: jax.profiler trace of {PROFILE_STEPS} more steps of each")
    return "\n".join(lines)
