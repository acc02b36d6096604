"""The hardware profiles the planner estimates for: a device's FLOP/s, HBM and its bandwidth, the
links inside and between nodes (`Hardware`, `HARDWARE`), which profile a JAX device is
(`hardware_of`), and which link a group of mesh axes falls on (`link`, `nodes`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jshard.mesh import STANDARD_AXES as AXES

GiB = 2**30


# A GPU step's memory-bound work between its GEMMs (`compute_terms`), as bytes of HBM traffic
# at the profile's bandwidth: what a step measured on one H100 takes beyond its GEMMs and
# attention (`physics`, the measured sweep), AdamW's pass and the launches, fitted over the
# runs of docs/results/bench-step-h100-jax0.11.2-2026-11-27.json, each checked with it left out
# (`jshard bench fit`, docs/planning.md):
ELEMENTWISE_LAYER_BYTES = 30  # per token, layer and element of embed + mlp: norms, activations,
#                                residuals, the layer scan's stacking of what backward keeps
ELEMENTWISE_LOGIT_BYTES = 14  # per token and vocabulary entry: the loss over the logits, in fp32
# The share of the datasheet's HBM bandwidth a streaming kernel (a copy, AdamW's pass, a fusion
# of elementwise ops) reaches: 2482.6 GB/s of the H100's 3350, measured by `jshard bench kernels`
# (docs/results/bench-kernels-h100-jax0.11.2-2026-11-27.json); GPUs with no measurement of their
# own are taken to reach the same share.
STREAM_SHARE = 0.741

@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per device (fp32 matmuls: half, as TF32)
    hbm_bytes: float
    hbm_bw: float  # bytes/s, the datasheet's
    intra_bw: float  # bytes/s per device, one direction, inside a node (NVLink)
    inter_bw: float  # bytes/s per device, one direction, between nodes (one NIC per GPU)
    gpus_per_node: int
    # Fraction of peak that a step's matmuls sustain. Measured on one H100 (`jshard bench gpu`,
    # docs/benchmarks.md): an 8192² bf16 matmul 681-806 TFLOP/s, a 1B model's matmul and
    # attention kernels 732 (its profile): 0.74-0.75 of the 989 datasheet.
    matmul_efficiency: float = 0.75
    # Where attention may run as cuDNN's fused flash kernel, which keeps no (seq × seq) scores
    # (`nn.attention_implementation`: GPUs, in bf16); XLA's materialises them for backward.
    platform: str = "gpu"
    # Dense FP8 FLOP/s per device (the `fp8` policy's projections); None: no FP8 tensor cores.
    # A CPU has none either, but computes FP8 products in bf16 (`nn.fp8`): its bf16 peak.
    fp8_peak_flops: float | None = None
    # A GPU step's memory-bound work between its GEMMs, as bytes of HBM traffic (below).
    elementwise_layer_bytes: float = ELEMENTWISE_LAYER_BYTES
    elementwise_logit_bytes: float = ELEMENTWISE_LOGIT_BYTES
    # The share of `hbm_bw` a streaming kernel reaches (`STREAM_SHARE`).
    stream_share: float = STREAM_SHARE
    # Fake CPU devices (`platform` "cpu") share one host, whose step costs beyond its FLOPs
    # (`timing.host_step_seconds`; fitted: `bench.fit.fit_host`): this share of the time remat's
    # recomputed FLOPs would take, `call_s` a device's part in a collective (a rendezvous of its
    # group's threads), `tick_s` a device's pipeline tick, and `activation_traffic` times what its
    # activations take to move at the copy bandwidth of their size beyond what they take in cache
    # (`spill_seconds`; `copy_bw`: (bytes a buffer, bytes/s), measured: `HOST_COPY`).
    recompute_share: float = 1.0
    call_s: float = 0.0
    tick_s: float = 0.0
    activation_traffic: float = 0.0
    copy_bw: tuple[tuple[float, float], ...] = ()

    @property
    def stream_bw(self) -> float:
        """Bytes/s a memory-bound kernel moves: what the step's streaming work is charged at."""
        return self.hbm_bw * self.stream_share

    def copy_seconds(self, nbytes: float, buffer: float) -> float:
        """`nbytes` moved in buffers of `buffer` bytes each: at the bandwidth `copy_bw` measured for
        that size (log-log between the sizes measured, the nearest one's beyond them), or
        streaming where nothing was measured."""
        if not self.copy_bw:
            return nbytes / self.stream_bw
        sizes, rates = np.log(self.copy_bw).T
        return nbytes / math.exp(np.interp(math.log(buffer), sizes, rates))

    def spill_seconds(self, nbytes: float) -> float:
        """What `nbytes` in one buffer take to move beyond what they would in cache: at the copy
        bandwidth for their size (`copy_bw`) less at the fastest measured; none up to the size
        measured fastest (smaller buffers are slower for their copy's call, not for the cache),
        nor where nothing was measured."""
        if not self.copy_bw:
            return 0.0
        fastest, rate = max(self.copy_bw, key=lambda size_rate: size_rate[1])
        return self.copy_seconds(nbytes, nbytes) - nbytes / rate if nbytes > fastest else 0.0


# This repository's 2-core host copying a buffer a core, both cores at once (MiB a buffer, GB/s
# read + write): in its caches to ~4 MiB, its DRAM from ~24 MiB; a small buffer's copy pays for
# its call as well. `python benchmarks/host_copy_bandwidth.py`, docs/results/host-copy-bandwidth-
# 2cpu-2026-12-05.json.
HOST_COPY = ((0.125, 105.4), (0.25, 94.9), (0.5, 97.4), (1, 149.8), (2, 148.7), (3, 147.5),
             (4, 131.0), (6, 96.3), (8, 69.0), (12, 52.0), (16, 42.7), (24, 36.0), (32, 29.6),
             (64, 28.6), (128, 27.8), (256, 42.6))
# Datasheets (SXM parts; NVLink 4 = 450 GB/s each way, 400 Gb/s InfiniBand NIC per GPU).
# cpu: this repository's 2-core host (README: a measured 206 GFLOP/s), threads as "links", its
# memory bandwidth the copy of 64 MiB buffers (`HOST_COPY`).
# The CPU profile's host constants (`bench fit` of a `bench search --json` result)
CPU_HOST = dict(matmul_efficiency=1.0, recompute_share=0.128, call_s=1.22e-5, tick_s=7.89e-5, activation_traffic=13.1)
HARDWARE = {
    "h100": Hardware("h100", 989e12, 80 * GiB, 3.35e12, 450e9, 50e9, 8, fp8_peak_flops=1979e12),
    "h200": Hardware("h200", 989e12, 141e9, 4.8e12, 450e9, 50e9, 8, fp8_peak_flops=1979e12),
    "a100": Hardware("a100", 312e12, 80 * GiB, 2.04e12, 300e9, 25e9, 8),
    # CPU_HOST's five (`bench.fit.HOST_FIELDS`): fitted (`bench.fit.fit_host`) to 40 random
    # layouts of the small GPT on 8 fake devices of this 2-core host (jax 0.12.0.1, timed in
    # rounds), checked on the small Llama's and on `jshard bench search` (docs/planning.md).
    "cpu": Hardware("cpu", 0.206e12, 16 * GiB, dict(HOST_COPY)[64] * 1e9, 10e9, 10e9, 8, platform="cpu",
                    fp8_peak_flops=0.206e12, stream_share=1.0,
                    copy_bw=tuple((mib * 2**20, gbps * 1e9) for mib, gbps in HOST_COPY), **CPU_HOST),
}
# A device's kind, as JAX names it, to its profile (the parts the profiles describe).
KINDS = {"H100": "h100", "H200": "h200", "A100": "a100"}


def hardware_of(device) -> Hardware | None:
    """The profile of a JAX device: `cpu` for a CPU (fake devices: the host's), a GPU's by its
    kind; None where there is none."""
    if device.platform == "cpu":
        return HARDWARE["cpu"]
    return next((HARDWARE[name] for kind, name in KINDS.items() if kind in device.device_kind), None)


def link(axes: str, sizes: dict[str, int], hw: Hardware) -> tuple[float, str]:
    """Bandwidth of a mesh axis group: intra-node when its devices and every axis inside it
    (mesh order data, stage, fsdp, context, expert, tensor: tensor innermost) fit in one node."""
    first = min(AXES.index(a) for a in axes.split("+"))
    span = math.prod(sizes[a] for a in AXES[first:])
    return (hw.intra_bw, "intra") if span <= hw.gpus_per_node else (hw.inter_bw, "inter")


def nodes(axes: str, sizes: dict[str, int], hw: Hardware) -> int:
    """The nodes a group of `axes` spans: one inside a node, else its devices and those of the
    axes inside it (`link`) over `gpus_per_node`, at most one a member."""
    if link(axes, sizes, hw)[1] == "intra":
        return 1
    first = min(AXES.index(a) for a in axes.split("+"))
    span = math.prod(sizes[a] for a in AXES[first:])
    return min(math.prod(sizes[a] for a in axes.split("+")), math.ceil(span / hw.gpus_per_node))
