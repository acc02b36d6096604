"""`jshard bench kernels`: what one device's kernels cost by shape, the constants the planner's
step-time model reads (`docs/planning.md`).

  gemm    y = x @ w, x (M, K), w (K, N), over `GRID` in bf16 and in FP8 (e4m3 operands with
          per-tensor scales, dequantized into the product as `nn.fp8` writes it, XLA's Triton
          GEMMs off as in an FP8 step): seconds per GEMM, TFLOP/s, share of the datasheet, and
          arithmetic intensity (FLOPs per byte of operands and result). One program holds `k`
          independent products of distinct operands (none shared, so XLA cannot merge them into
          one), timed as one call and divided by `k`: the host dispatches once per `k` GEMMs, so
          a small GEMM is timed as a step's program runs it, back to back on the device.
  launch  a chain of `CHAIN` dependent tiny matmuls in one program: the least one kernel costs.
  loop    the same chain as a `fori_loop`: what each iteration of a device loop adds (the
          layers' scan, a pipeline's ticks).
  hbm     a large copy on the device: GB/s read + written.
  attention  causal attention's forward and backward over one row of `ATTENTION_SEQS` tokens,
          Llama 3.1 8B's heads (32 sharing 8 KV heads of 128), bf16: cuDNN's kernel and jshard's
          flash kernel (`nn.flash`, which the ring's and cp-gather's blocks run) on a GPU; XLA's
          and the flash kernel in Pallas's interpreter on a CPU (`--dry`, a tiny shape). Seconds,
          TFLOP/s of the causal half (3 × 4·s²/2·h·d: forward and a backward of twice its work,
          the planner's `physics.attention_seconds`), and each kernel's time over the first's.

The shapes run in a fixed shuffled order until `deadline_s`, so a run cut short still spans the
grid; the result names the shapes it did not reach. On a CPU (`--dry`), tiny shapes: the same path.
"""

from __future__ import annotations

import itertools
import math
import random
import time

import jax
import jax.numpy as jnp

from jshard.mesh import TRITON_GEMM_OPTION
from jshard.metrics import best_seconds, device_peak
from jshard.nn.flash import causal_flash_attention
from jshard.nn.fp8 import FORWARD, dequantize

GRID = dict(m=(512, 2048, 8192, 32768), n=(128, 256, 512, 1024, 2048, 4096, 8192, 16384),
            k=(256, 1024, 4096, 16384))
DRY_GRID = dict(m=(16, 64), n=(16, 64), k=(32,))
DTYPES = ("bf16", "fp8")
WORK_S = 2e-3  # device seconds of GEMMs per timed call, at `ASSUMED_FLOPS`: dispatch is noise beside it
ASSUMED_FLOPS = {"gpu": 6e14, "cpu": 1e10}
MAX_PRODUCTS, MAX_BYTES = 128, 8 * 2**30  # per program: its compile time, its memory
CHAIN, TINY = 256, 64
COPY_BYTES = {"gpu": 2**31, "cpu": 2**26}
REPEATS = 5
ATTENTION_SEQS = {"gpu": (8192, 32768), "cpu": (256,)}
ATTENTION_HEADS = {"gpu": (32, 8, 128), "cpu": (4, 2, 16)}  # heads, KV heads, head dim
ATTENTION_KERNELS = {"gpu": ("cudnn", "pallas"), "cpu": ("xla", "pallas")}


def products(m: int, n: int, k: int, platform: str) -> int:
    """How many independent GEMMs of one shape a timed program holds (`WORK_S`, within limits)."""
    per = (m * k + k * n) * 2 + m * n * 2
    return max(2, min(MAX_PRODUCTS, MAX_BYTES // per, math.ceil(WORK_S * ASSUMED_FLOPS[platform] / (2 * m * n * k))))


def _program(dtype: str, count: int, platform: str):
    """count GEMMs of distinct operand pairs as one jitted call."""
    if dtype == "bf16":
        return jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws)])

    def fp8(xs, ws, sx, sw):
        return [dequantize(x, sx, jnp.bfloat16) @ dequantize(w, sw, jnp.bfloat16) for x, w in zip(xs, ws)]

    return jax.jit(fp8, compiler_options={TRITON_GEMM_OPTION: False} if platform == "gpu" else None)


def gemm(dtype: str, m: int, n: int, k: int, device, repeats: int = REPEATS) -> dict:
    """One shape's row: seconds per GEMM (best of `repeats` calls of `products` of them)."""
    count = products(m, n, k, device.platform)
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (k, n), jnp.bfloat16)
    if dtype == "fp8":
        x, w = x.astype(FORWARD), w.astype(FORWARD)
    # distinct buffers, one per product (the same values: the time does not depend on them)
    xs = [jax.device_put(jnp.array(x, copy=True), device) for _ in range(count)]
    ws = [jax.device_put(jnp.array(w, copy=True), device) for _ in range(count)]
    args = (xs, ws) if dtype == "bf16" else (xs, ws, jnp.float32(1.0), jnp.float32(1.0))
    run = _program(dtype, count, device.platform)
    started = time.perf_counter()
    compiled = run.lower(*args).compile()
    compile_s = time.perf_counter() - started
    seconds = best_seconds(lambda: jax.block_until_ready(compiled(*args)), repeats) / count
    flops, nbytes = 2 * m * n * k, (m * k + k * n) * (1 if dtype == "fp8" else 2) + m * n * 2
    del xs, ws
    return dict(dtype=dtype, m=m, n=n, k=k, products=count, seconds=seconds, tflops=flops / seconds / 1e12,
                intensity=flops / nbytes, compile_s=compile_s)


def attention(kernel: str, seq: int, device, repeats: int = REPEATS) -> dict:
    """Causal attention forward + backward of one row of `seq` tokens by `kernel` ("cudnn",
    "xla" or "pallas"): seconds and TFLOP/s of the causal half."""
    platform = "cpu" if device.platform == "cpu" else "gpu"
    heads, kv_heads, d = ATTENTION_HEADS[platform]
    keys = jax.random.split(jax.random.key(0), 4)
    q, d_out = (jax.device_put(jax.random.normal(k, (1, seq, heads, d), jnp.bfloat16), device) for k in keys[:2])
    k, v = (jax.device_put(jax.random.normal(x, (1, seq, kv_heads, d), jnp.bfloat16), device) for x in keys[2:])

    def forward(q, k, v):
        if kernel == "pallas":
            return causal_flash_attention(q, k, v)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=kernel)

    step = jax.jit(lambda q, k, v, d_out: jax.vjp(forward, q, k, v)[1](d_out))
    compiled = step.lower(q, k, v, d_out).compile()
    seconds = best_seconds(lambda: jax.block_until_ready(compiled(q, k, v, d_out)), repeats)
    flops = 3 * 4 * seq * seq / 2 * heads * d
    return dict(kernel=kernel, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=d, seconds=seconds,
                tflops=flops / seconds / 1e12)


def attention_rows(device) -> list[dict]:
    """`attention` of each of the platform's kernels at each of its lengths; each row's time over
    the first kernel's at its length (`over_first`). A kernel that fails to build or run (a first
    run of the Triton kernel on a GPU model) is a row with its error's first line, and the sweep
    goes on."""
    platform = "cpu" if device.platform == "cpu" else "gpu"
    rows = []
    for seq in ATTENTION_SEQS[platform]:
        first = None
        for kernel in ATTENTION_KERNELS[platform]:
            try:
                row = attention(kernel, seq, device)
            except Exception as e:  # noqa: BLE001 (a benchmark on unknown hardware keeps what it measured)
                rows.append(dict(kernel=kernel, seq=seq, error=f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"))
                continue
            first = first or row["seconds"]
            rows.append(row | dict(over_first=row["seconds"] / first))
    return rows


def launch_and_loop(device, repeats: int = REPEATS) -> dict:
    """Seconds per kernel of a dependent chain of tiny matmuls, unrolled and as a device loop."""
    x = jax.device_put(jnp.eye(TINY, dtype=jnp.float32), device)
    chain = jax.jit(lambda x: _chain(x, CHAIN))
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, CHAIN, lambda _, y: y @ x, x))
    unrolled_s = best_seconds(lambda: chain(x).block_until_ready(), repeats) / CHAIN
    looped_s = best_seconds(lambda: loop(x).block_until_ready(), repeats) / CHAIN
    return dict(kernel_s=unrolled_s, loop_iteration_s=looped_s, loop_overhead_s=looped_s - unrolled_s,
                chain=CHAIN, shape=[TINY, TINY])


def _chain(x, n: int):
    y = x
    for _ in range(n):
        y = y @ x
    return y


def hbm_gbps(device, repeats: int = REPEATS) -> float:
    """Best GB/s (read + write) of a copy of `COPY_BYTES` on the device."""
    nbytes = COPY_BYTES["cpu" if device.platform == "cpu" else "gpu"]
    x = jax.device_put(jnp.zeros(nbytes // 4, jnp.float32), device)
    copy = jax.jit(jnp.copy)
    return 2 * nbytes / best_seconds(lambda: copy(x).block_until_ready(), repeats) / 1e9


def shapes(grid: dict, dtypes=DTYPES, seed: int = 0) -> list[tuple[str, int, int, int]]:
    """Every (dtype, M, N, K) of `grid`, shuffled with `seed`: any prefix spans the grid."""
    every = [(d, m, n, k) for d, (m, n, k) in itertools.product(dtypes, itertools.product(grid["m"], grid["n"], grid["k"]))]
    random.Random(seed).shuffle(every)
    return every


def run(dry: bool = False, deadline_s: float = 300.0, dtypes=DTYPES, on_row=None) -> dict:
    """The whole benchmark on JAX's first device; `on_row(result)` after each GEMM (to keep a partial result)."""
    device = jax.devices()[0]
    peaks = {d: device_peak([device], jnp.bfloat16 if d == "bf16" else FORWARD) for d in dtypes}
    started = time.perf_counter()
    result = dict(jax=jax.__version__, device=f"{device.device_kind} ({device.platform})", dry=dry,
                  peak_tflops={d: p and p.flops / 1e12 for d, p in peaks.items()},
                  hbm_gbps=hbm_gbps(device), **launch_and_loop(device), attention=attention_rows(device),
                  gemms=[], not_reached=[])
    todo = shapes(DRY_GRID if dry else GRID, dtypes)
    for i, (dtype, m, n, k) in enumerate(todo):
        if time.perf_counter() - started > deadline_s:
            result["not_reached"] = [dict(dtype=d, m=a, n=b, k=c) for d, a, b, c in todo[i:]]
            break
        row = gemm(dtype, m, n, k, device)
        peak = result["peak_tflops"][dtype]
        row["efficiency"] = peak and row["tflops"] / peak
        result["gemms"].append(row)
        if on_row:
            on_row(result)
    result["seconds"] = time.perf_counter() - started
    return result


def report(result: dict) -> str:
    """The sweep as a table per dtype: TFLOP/s (share of the datasheet) by M×K rows and N columns."""
    lines = [f"# jshard bench kernels: {result['device']}, jax {result['jax']}; {result['seconds']:.0f} s, "
             f"{len(result['gemms'])} GEMMs timed, {len(result['not_reached'])} not reached",
             f"  hbm copy {result['hbm_gbps']:.0f} GB/s; a kernel at least {result['kernel_s'] * 1e6:.2f} us "
             f"({result['chain']} dependent {TINY}x{TINY} matmuls); a device loop's iteration "
             f"{result['loop_iteration_s'] * 1e6:.2f} us ({result['loop_overhead_s'] * 1e6:+.2f} us over its kernel)"]
    for a in result.get("attention", []):
        if "error" in a:
            lines.append(f"  attention {a['kernel']:>6} seq {a['seq']:>6}: failed: {a['error']}")
            continue
        lines.append(f"  attention {a['kernel']:>6} seq {a['seq']:>6} ({a['heads']}/{a['kv_heads']} heads of {a['head_dim']}), "
                     f"forward + backward: {a['seconds'] * 1e3:.3f} ms, {a['tflops']:.3g} TFLOP/s, "
                     f"{a['over_first']:.2f}x the first")
    for dtype in sorted({g["dtype"] for g in result["gemms"]}):
        rows = [g for g in result["gemms"] if g["dtype"] == dtype]
        ns = sorted({g["n"] for g in rows})
        peak = result["peak_tflops"][dtype]
        lines.append(f"  {dtype} GEMM TFLOP/s (datasheet {peak and f'{peak:g}' or '-'}), rows M x K, columns N:")
        lines.append("  " + f"{'M x K':>13}" + "".join(f"{n:>8}" for n in ns))
        for m, k in sorted({(g["m"], g["k"]) for g in rows}):
            at = {g["n"]: g["tflops"] for g in rows if (g["m"], g["k"]) == (m, k)}
            lines.append("  " + f"{f'{m}x{k}':>13}" + "".join(f"{at[n]:>8.3g}" if n in at else f"{'-':>8}" for n in ns))
    return "\n".join(lines)


def constants(result: dict, source: str) -> dict:
    """What the planner reads of a run (`jshard/planner/measured/<kind>.json`, `plan.physics`): each
    GEMM's TFLOP/s by dtype and shape, the copy's GB/s, a kernel's and a loop iteration's seconds."""
    gemms = {d: [[g["m"], g["n"], g["k"], round(g["tflops"], 3)] for g in sorted(result["gemms"], key=lambda g: (g["m"], g["n"], g["k"]))
                 if g["dtype"] == d] for d in sorted({g["dtype"] for g in result["gemms"]})}
    return dict(source=source, device=result["device"], jax=result["jax"], hbm_gbps=round(result["hbm_gbps"], 1),
                kernel_s=result["kernel_s"], loop_iteration_s=result["loop_iteration_s"], gemm_tflops=gemms)


if __name__ == "__main__":  # RESULT.json SOURCE OUT.json: a run's `constants`, for the planner
    import json
    import sys
    run_json, source, out = sys.argv[1:]
    with open(run_json) as f:
        kept = constants(json.load(f), source)
    rows = kept.pop("gemm_tflops")
    text = json.dumps(kept, indent=1)[:-2] + ',\n "gemm_tflops": {\n' + ",\n".join(
        f'  "{d}": [\n' + ",\n".join(f"   {json.dumps(r)}" for r in rs) + "\n  ]" for d, rs in rows.items()) + "\n }\n}\n"
    assert json.loads(text) == kept | {"gemm_tflops": rows}
    with open(out, "w") as g:
        g.write(text)
