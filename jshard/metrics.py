"""What a training run measures itself against: model FLOPs per token, the devices' peak,
and the per-step metrics file.

Model FLOPs count the matmuls of forward and backward (2 + 4 FLOPs per weight and token)
plus attention's score and value products, as in the PaLM paper's appendix B:

    6 · N + 12 · layers · seq · embed   per token

with N the matmul weights (attention, MLP, and the head, which is the token embedding
when tied); the causal mask's skipped half is counted, layer norms are not. MFU is these
FLOPs per second over the peak of all devices: rematerialisation and pipeline bubbles
lower it, as they should.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from jshard.mesh import TRITON_GEMM_OPTION


PROFILE_STEPS = 3  # steps traced by `train --profile` and `bench step --profile`, after compiling

# Dense bf16 tensor-core peaks per device (vendor datasheets, SXM parts), FLOP/s.
# fp32 matmuls run as TF32 on these, at half the bf16 rate; FP8 at twice it where the part has
# FP8 tensor cores (Hopper on; not the A100).
GPU_BF16_PEAKS = {"B200": 2250e12, "H200": 989e12, "H100": 989e12, "A100": 312e12}
NO_FP8 = ("A100",)
CPU_MATMUL = 1024  # the square matmul that measures a CPU host's peak


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token of a decoder `config` (GPT or Llama: its `matmul_weights`) on
    sequences of `seq_len` tokens."""
    return 6 * config.matmul_weights + 12 * config.layers * seq_len * config.embed


@dataclasses.dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s of all the run's devices together
    source: str  # where the number comes from, for the user


def device_peak(devices, dtype, per_device_tflops: float | None = None) -> Peak | None:
    """The peak FLOP/s of `devices` for matmuls in `dtype`; None where unknown.

    GPUs: the datasheet table, or `per_device_tflops`. CPU: fake devices share the host's
    cores, so the peak is the host's, measured with one matmul (XLA runs it on all cores).
    """
    kind, n = devices[0].device_kind, len(devices)
    if per_device_tflops:
        return Peak(per_device_tflops * 1e12 * n, f"--peak-tflops: {per_device_tflops:g} TFLOP/s × {n} devices")
    if devices[0].platform == "cpu":
        flops, cached = cpu_peak(devices[0], dtype)
        return Peak(flops, f"{'the highest ' if cached else ''}measured: a {CPU_MATMUL}² {jnp.dtype(dtype).name} matmul "
                           f"on this host (all its cores; the {n} CPU devices share them), kept in "
                           f"{peak_cache().replace(os.path.expanduser('~'), '~', 1)}")
    for name, bf16 in GPU_BF16_PEAKS.items():
        if name in kind:
            if jnp.dtype(dtype).itemsize == 1 and name in NO_FP8:
                return None
            per_device, label = {2: (bf16, "bf16"), 1: (2 * bf16, "FP8")}.get(
                jnp.dtype(dtype).itemsize, (bf16 / 2, "TF32 (fp32 matmuls)"))
            return Peak(per_device * n, f"{name} {label} datasheet: {per_device / 1e12:.0f} TFLOP/s × {n} devices")
    return None


def peak_cache() -> str:
    """Where a CPU host's measured peak is kept: `$XDG_CACHE_HOME/jshard/cpu-peak.json`."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jshard", "cpu-peak.json")


def peak_key(dtype) -> str:
    """What a kept CPU peak is of: the host, its cores, the dtype, JAX's version and XLA's flags."""
    return " | ".join((platform.node(), f"{os.cpu_count()} cores", jnp.dtype(dtype).name, f"jax {jax.__version__}",
                       os.environ.get("XLA_FLAGS", "")))


def cpu_peak(device, dtype) -> tuple[float, bool]:
    """This host's matmul FLOP/s in `dtype`: the highest measured here (`peak_key`), and whether
    an earlier run measured it.

    Measured at every start, and the highest measure kept (`peak_cache`): on a shared machine
    the load moves a measure twofold from one run to the next, and only ever down (a peak is a
    ceiling), so two runs of one command differ in MFU by their step times alone once one of
    them measured an unloaded host, and a first measure taken under load is not kept for good.
    Where the cache cannot be written, each run's own measure."""
    path, key = peak_cache(), peak_key(dtype)
    try:
        with open(path) as f:
            kept = json.load(f)
    except (OSError, ValueError):
        kept = {}
    flops = measured_matmul_flops(device, dtype)
    if isinstance(kept, dict) and isinstance(kept.get(key), (int, float)) and kept[key] >= flops:
        return float(kept[key]), True
    kept = (kept if isinstance(kept, dict) else {}) | {key: flops}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.{os.getpid()}", "w") as f:
            json.dump(kept, f, indent=1)
        os.replace(f"{path}.{os.getpid()}", path)  # whole, even with two processes writing
    except OSError:
        pass
    return flops, False


def measured_matmul_flops(device, dtype, n: int = CPU_MATMUL, repeats: int = 10) -> float:
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    matmul = jax.jit(jnp.matmul)
    return 2 * n**3 / best_seconds(lambda: matmul(a, a).block_until_ready(), repeats)


def measured_fp8_matmul_flops(device, n: int, repeats: int = 10) -> float:
    """The best FLOP/s of an n² e4m3 × e4m3 matmul with per-tensor scales, as `nn.fp8` writes its
    products (operands already in FP8: the GEMM alone), with XLA's Triton GEMMs off as in an FP8
    step's program (`Plan.xla_options`): on a Hopper GPU one cuBLASLt FP8 GEMM."""
    a = jax.device_put(jnp.ones((n, n), jnp.float8_e4m3fn), device)
    scale = jax.device_put(jnp.float32(1.0), device)

    def matmul(a, s):
        x = a.astype(jnp.bfloat16) * s.astype(jnp.bfloat16)
        return x @ x

    matmul = jax.jit(matmul, compiler_options={TRITON_GEMM_OPTION: False} if device.platform == "gpu" else None)
    return 2 * n**3 / best_seconds(lambda: matmul(a, scale).block_until_ready(), repeats)


# -- timing: `run_once` waits for its results; its first call (compiling) is not timed ------


def _seconds(run_once, repeats: int) -> list[float]:
    run_once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run_once()
        times.append(time.perf_counter() - start)
    return times


def best_seconds(run_once, repeats: int) -> float:
    """The fastest of `repeats` calls: a ceiling (what the hardware can do at best)."""
    return min(_seconds(run_once, repeats))


def median_seconds(run_once, repeats: int) -> float:
    """The median of `repeats` calls: a typical step."""
    return statistics.median(_seconds(run_once, repeats))


def median_step_seconds(step, batch, repeats: int, compiled=None) -> float:
    """The median time of a jshard `ShardedStep` on `batch`, from its own initial state
    (run through `compiled`, its `lower(...).compile()`, where given: no second compile)."""
    state, run = step.state, compiled or step

    def once():
        nonlocal state
        state, loss = run(state, batch)
        loss.block_until_ready()

    seconds = median_seconds(once, repeats)
    # The last update may still run: let it end before the caller runs another program (two
    # multi-device XLA:CPU programs at once can deadlock in their collectives' rendezvous).
    jax.block_until_ready(state)
    return seconds


def device_memory() -> dict[str, int]:
    """This process's first device's memory in use and its peak so far, in bytes, where the
    backend reports them (GPUs; XLA:CPU reports none: then nothing)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return {key: stats[name] for key, name in (("memory_bytes", "bytes_in_use"), ("peak_memory_bytes", "peak_bytes_in_use"))
            if name in stats}


class MetricsFile:
    """One JSON object per line: `step`, `loss`, `lr`, `step_s`, `tokens_per_s`, `mfu` (null
    without a peak), and where reported `memory_bytes` / `peak_memory_bytes` (`device_memory`);
    with a `tensorboard` folder, each number of them also as a TensorBoard scalar at its step."""

    def __init__(self, path: str | None, append: bool = False, tensorboard: str | None = None):
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # --metrics runs/demo.jsonl makes runs/
        self._file = open(path, "a" if append else "w") if path else None  # a resumed run continues it
        self._events = None
        if tensorboard:
            # tensorboardX: TensorBoard's event format written without TensorFlow (what PyTorch's
            # and many JAX trainers log with); a resumed run adds a file beside the first one's.
            from tensorboardX import SummaryWriter

            self._events = SummaryWriter(tensorboard, flush_secs=10)

    def write(self, **metrics) -> None:
        if self._file:
            self._file.write(json.dumps(metrics) + "\n")
            self._file.flush()
        if self._events:
            for name, value in metrics.items():  # scalars only (a MoE's per-expert lists stay in the file)
                if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._events.add_scalar(name, value, metrics["step"])

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._events:
            self._events.close()
