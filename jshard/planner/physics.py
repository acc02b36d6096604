"""What one device's work and one collective cost: the planner's step-time model, term by term
(`timing` adds them up; docs/planning.md gives each term's source).

    GEMMs        a roofline on each per-device shape: the longer of FLOPs at the FLOP/s this
                 device sustains at that shape and the bytes of its operands and result at HBM
                 bandwidth. The FLOP/s come from a measured sweep (`jshard bench kernels`, kept
                 in `measured/<hardware>.json`), interpolated in log M, N, K; a profile with no
                 sweep (a CPU host) runs every GEMM at its peak × `matmul_efficiency`.
    attention    cuDNN's fused kernel at `ATTENTION_EFFICIENCY` of the peak (model FLOPs)
    launches     no kernel shorter than the measured `kernel_s`; each iteration of a device
                 loop (the layers' scan, forward and backward; a pipeline's tick) `loop_iteration_s`
    collectives  latency + bytes on the wire / bandwidth of the link the group spans (NVLink in
                 a node, the network across nodes); an all-reduce by ring or, across nodes, by
                 tree where that is faster (NCCL picks the same way)

Shapes are per device: tensor parallelism splits each projection's output (column-parallel) or
input (row-parallel) width, the vocabulary of the head, and the heads of attention.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib

from jshard.models import DecoderConfig, LlamaConfig

MEASURED = pathlib.Path(__file__).parent / "measured"
# cuDNN's flash attention forward + backward on one H100 at seq 2048 (the Llama-3.2-1B step's
# profile, docs/benchmarks.md: 13.8 ms for 12·L·s·h model FLOPs a token over 8192 tokens).
ATTENTION_EFFICIENCY = 0.48
# A collective's fixed cost per step of its algorithm (a ring's hop, a tree's level): NVLink 4
# through NVSwitch and a 400 Gb/s NIC through one switch (datasheet order: under a microsecond of
# wire and switch, a few of software each side).
LINK_LATENCY = {"intra": 2e-6, "inter": 6e-6}


@dataclasses.dataclass(frozen=True)
class Measured:
    """One device kind's kernel costs (`jshard bench kernels`)."""

    source: str
    hbm_bytes_per_s: float
    kernel_s: float
    loop_iteration_s: float
    gemm: dict  # dtype name -> {(m, n, k): FLOP/s}

    @functools.cached_property
    def grid(self) -> dict[str, list[list[int]]]:
        """Per dtype, the sweep's M, N and K values, sorted (read once: a search asks thousands of times)."""
        return {d: [sorted({key[i] for key in table}) for i in range(3)] for d, table in self.gemm.items()}

    def gemm_flops(self, dtype: str, m: int, n: int, k: int) -> float:
        """FLOP/s at (m, n, k): trilinear in log2 over the sweep's grid (a corner it did not
        reach left out, the others weighted up); below the grid the time of its smallest
        shape (a kernel does not get faster as it shrinks), above it the largest's FLOP/s."""
        table, axes = self.gemm[dtype], self.grid[dtype]
        scale, corners = 1.0, []
        for value, grid in zip((m, n, k), axes):
            if value < grid[0]:
                scale *= value / grid[0]
                value = grid[0]
            value = min(value, grid[-1])
            hi = next(i for i, g in enumerate(grid) if g >= value)
            lo = max(hi - 1, 0) if grid[hi] > value else hi
            t = 0.0 if lo == hi else math.log2(value / grid[lo]) / math.log2(grid[hi] / grid[lo])
            corners.append(((grid[lo], 1 - t), (grid[hi], t)))
        total = weight = 0.0
        for (a, wa), (b, wb), (c, wc) in ((x, y, z) for x in corners[0] for y in corners[1] for z in corners[2]):
            w = wa * wb * wc
            if w and (a, b, c) in table:
                total, weight = total + w * math.log(table[(a, b, c)]), weight + w
        if not weight:  # every corner unmeasured: the nearest measured shape in log distance
            near = min(table, key=lambda key: sum(abs(math.log2(key[i] / v)) for i, v in enumerate((m, n, k))))
            return table[near] * scale
        return math.exp(total / weight) * scale


@functools.cache
def measured(hardware: str) -> Measured | None:
    """The kept sweep of `hardware` (a `Hardware.name`), None where there is none."""
    path = MEASURED / f"{hardware}.json"
    if not path.exists():
        return None
    kept = json.loads(path.read_text())
    gemm = {d: {(m, n, k): tflops * 1e12 for m, n, k, tflops in rows} for d, rows in kept["gemm_tflops"].items()}
    return Measured(kept["source"], kept["hbm_gbps"] * 1e9, kept["kernel_s"], kept["loop_iteration_s"], gemm)


# --- a decoder layer's GEMMs, per device ----------------------------------------------------


def projections(config: DecoderConfig, tensor: int) -> list[tuple[int, int]]:
    """(K, N) of each projection of one layer's forward, per device under `tensor`-way TP: a
    column-parallel linear's output split, a row-parallel one's input. A Llama: q, kv, out,
    gate_up, down; a GPT: qkv, out, up, down (its gate_up and qkv are one matrix each)."""
    h, f = config.embed, config.mlp // tensor
    if isinstance(config, LlamaConfig):
        q, kv = config.heads * config.head_dim // tensor, 2 * config.kv_heads * config.head_dim // tensor
        return [(h, q), (h, kv), (q, h), (h, 2 * f), (f, h)]
    return [(h, 3 * h // tensor), (h // tensor, h), (h, f), (f, h)]


def gemm_seconds(m: int, n: int, k: int, dtype: str, hw) -> float:
    """One GEMM (m × k) @ (k × n) on one device of `hw` (a `hardware.Hardware`):
    the roofline of its FLOPs and its bytes, and no shorter than one kernel."""
    fp8 = dtype == "fp8"
    kept = measured(hw.name)
    if kept and dtype in kept.gemm:
        rate = kept.gemm_flops(dtype, m, n, k)
    else:
        rate = (hw.fp8_peak_flops if fp8 else hw.peak_flops * (1 if dtype == "bf16" else 0.5)) * hw.matmul_efficiency
    itemsize = {"fp8": 1, "bf16": 2}.get(dtype, 4)
    nbytes = (m * k + k * n) * itemsize + m * n * (2 if fp8 else itemsize)
    return max(2 * m * n * k / rate, nbytes / hw.stream_bw, kept.kernel_s if kept else 0.0)


def training_gemms_seconds(shapes: list[tuple[int, int]], tokens: int, dtype: str, hw, forwards: float = 1.0) -> float:
    """The forward of each (K, N) projection over `tokens` rows `forwards` times (remat runs it
    again), and its backward's two GEMMs: the input's gradient (tokens × N @ N × K) and the
    weight's (K × tokens @ tokens × N)."""
    return sum(forwards * gemm_seconds(tokens, n, k, dtype, hw) + gemm_seconds(tokens, k, n, dtype, hw)
               + gemm_seconds(k, n, tokens, dtype, hw) for k, n in shapes)


def attention_seconds(config: DecoderConfig, tokens: int, seq: int, tensor: int, hw, forwards: float = 1.0) -> float:
    """Fused attention's forward (`forwards` times) and backward for `tokens` queries over `seq`
    keys, one layer, this device's heads: 4·s·h FLOPs a token forward, twice that backward."""
    width = config.heads * config.head_dim / tensor
    return (2 + forwards) * 4 * tokens * seq * width / (hw.peak_flops * ATTENTION_EFFICIENCY)


# Kernels a layer launches, forward and backward, and the device's idle time between two: the
# Llama-3.2-1B step's profile (docs/benchmarks.md: 1885 kernels a step, 16 layers, 3.45 ms idle).
KERNELS_PER_LAYER = 115
LAUNCH_GAP_S = 1.83e-6


def launch_seconds(layers: int, hw) -> float:
    """The gaps between the kernels of `layers` layers' forward and backward (a device with a
    measured sweep; none elsewhere)."""
    return layers * KERNELS_PER_LAYER * LAUNCH_GAP_S if measured(hw.name) else 0.0


def loop_seconds(iterations: int, hw) -> float:
    """What `iterations` of a device loop add beyond their kernels (a scan's layers, pipeline ticks)."""
    kept = measured(hw.name)
    return iterations * (kept.loop_iteration_s - kept.kernel_s) if kept else 0.0


# --- collectives ------------------------------------------------------------------------------


def collective_seconds(kind: str, nbytes: float, n: int, link: str, bandwidth: float, nodes: int = 1) -> float:
    """One collective of K = `nbytes` per device over a group of `n` devices on `link` ("intra"
    or "inter", at `bandwidth` bytes/s a device each way): its algorithm's steps × the link's
    latency + the bytes each device sends / bandwidth. Ring: n - 1 steps (an all-reduce 2(n - 1),
    sending 2(n - 1)/n of K); across `nodes` > 1 an all-reduce may instead run NCCL's tree
    (2·log2(nodes) levels across nodes after a ring inside them, sending about 2·K), whichever
    is faster; a permute is one step; an all-to-all n - 1 sends of K/n."""
    alpha = LINK_LATENCY[link]
    if n <= 1 or not nbytes:
        return 0.0
    if kind == "collective-permute":
        return alpha + nbytes / bandwidth
    if kind == "all-reduce":
        ring = 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bandwidth
        if nodes > 1:
            tree = 2 * math.ceil(math.log2(nodes)) * alpha + 2 * nbytes / bandwidth
            return min(ring, tree)
        return ring
    return (n - 1) * alpha + (n - 1) / n * nbytes / bandwidth
