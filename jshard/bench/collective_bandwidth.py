"""`jshard bench collectives`: algbw / busbw of each collective, nccl-tests conventions.

`docs/collectives.md` shows what it prints.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

import jshard
from jshard import collectives
from jshard.mesh import mesh_sizes

# Unidirectional NVLink bandwidth per GPU in GB/s, what busbw is compared to: A100 SXM has
# 12 NVLink-3 links, H100/H200 SXM 18 NVLink-4 links, B200 18 NVLink-5 links, at 25, 25
# and 50 GB/s per direction each (NVIDIA's 600, 900 and 1800 GB/s are both directions).
# Parts whose name says PCIe or NVL connect through bridges or PCIe: their peak is unknown here.
NVLINK_PEAK_GBPS = {"A100": 300, "H100": 450, "H200": 450, "B200": 900}


@dataclass(frozen=True)
class Collective:
    """How to time one collective: what it does to a rank's block, and how to count bytes."""

    call: Callable  # (rank's block, axes) -> rank's result
    input_is_chunk: bool  # each rank starts with S/N bytes (all_gather, gather), else S
    busbw_factor: Callable[[int], float]  # of N, the number of ranks


def _ring(n: int) -> float:
    return (n - 1) / n


COLLECTIVES = {
    "all_reduce": Collective(collectives.all_reduce, False, lambda n: 2 * _ring(n)),
    "reduce_scatter": Collective(collectives.reduce_scatter, False, _ring),
    "all_gather": Collective(collectives.all_gather, True, _ring),
    "all_to_all": Collective(lambda x, axes: collectives.all_to_all(x, axes, 0, 0), False, _ring),
    "broadcast": Collective(collectives.broadcast, False, lambda n: 1.0),
    "reduce": Collective(collectives.reduce, False, lambda n: 1.0),
    "scatter": Collective(collectives.scatter, False, _ring),
    "gather": Collective(collectives.gather, True, _ring),
    "send_recv": Collective(collectives.send_recv, False, lambda n: 1.0),
}


def sweep(min_bytes: int, max_bytes: int, factor: int) -> tuple[int, ...]:
    """min_bytes, min_bytes·factor, ... up to max_bytes, as nccl-tests' -b/-e/-f."""
    if factor < 2 or min_bytes > max_bytes:
        raise SystemExit(f"sweep {min_bytes}..{max_bytes} B by ×{factor}: need min ≤ max and a factor ≥ 2")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return tuple(sizes)


def run_collectives(mesh: str | None, axis: str | None, ops, sizes, dtype: str = "float32", warmup: int = 2,
                    repeats: int = 10) -> dict:
    """`jshard bench collectives` times every collective of `jshard.collectives` over one mesh
    axis for a sweep of sizes and reports bandwidth the way NVIDIA's nccl-tests do, so the
    numbers can be set beside theirs:

        size S   nccl-tests' S, in bytes: the whole buffer. all_reduce, broadcast, reduce,
                 send_recv: the buffer each rank holds. reduce_scatter, scatter: the full
                 input (each rank ends with S/N). all_gather, gather: the gathered output
                 (each rank starts with S/N). all_to_all: one rank's send buffer.
        time     median wall time of one call, after warm-up, until the result is ready.
        algbw    S / time, in GB/s (10^9 bytes per second, as nccl-tests).
        busbw    algbw × a factor that makes it comparable to one link's peak whatever N is:
                 2(N-1)/N all_reduce; (N-1)/N reduce_scatter, all_gather, all_to_all,
                 scatter, gather; 1 broadcast, reduce, send_recv.

    On fake CPU devices the "links" are memory copies between threads of one process, and
    the output says so. On GPUs it names the device and, for parts with a known NVLink peak
    (A100, H100, H200, B200 SXM), adds busbw as a fraction of that peak. Small sizes measure
    the latency of launching one compiled call more than bandwidth, as in nccl-tests.
    """
    axis_sizes = mesh_sizes(mesh, jshard.preset("dp"), jax.device_count())  # dp: one axis
    axes = tuple(a.strip() for a in axis.split(",")) if axis else tuple(axis_sizes)
    mesh_text = mesh
    try:
        mesh = jshard.make_mesh(devices=_devices_for(axis_sizes, jax.devices()), **axis_sizes)
    except jshard.MeshError as e:
        raise SystemExit(f"--mesh {mesh_text}: {e} From this command: --fake-devices N on CPU.") from None
    shape = jshard.mesh_shape(mesh)
    unknown = [a for a in axes if a not in shape]
    if unknown:
        raise SystemExit(f"--axis {','.join(axes)}: {', '.join(unknown)} not in the mesh {shape}")
    n = math.prod(shape[a] for a in axes)
    if n < 2:
        raise SystemExit(
            f"axis {','.join(axes)} has {n} device: a collective over it moves nothing. Give it ≥ 2 devices "
            f"(--mesh, or on CPU --fake-devices; JAX sees {jax.device_count()} {jax.default_backend()} device(s))."
        )

    device = mesh.devices.flat[0]
    peak = _link_peak(device, jax.process_count())
    print(_describe_setup(mesh, axes, n, device, peak, dtype, warmup, repeats))
    rows = []
    for op in ops:
        for size in sizes:
            row = _bench_one(op, size, mesh, axes, n, dtype, warmup, repeats)
            if peak:
                row["busbw_over_peak"] = row["busbw_GBps"] / peak
            rows.append(row)
            print(_format_row(row, peak))
    setup = {  # the set-up, for the --json file
        "platform": device.platform, "device_kind": device.device_kind, "devices": mesh.size,
        "mesh": shape, "axis": list(axes), "n": n, "dtype": dtype, "warmup": warmup,
        "repeats": repeats, "link_peak_GBps": peak,
    }
    return {"setup": setup, "rows": rows}


def _devices_for(axis_sizes: dict[str, int], devices: list) -> list:
    """The first prod(sizes) devices, so a smaller mesh can be timed; all of them if -1 is used."""
    wanted = math.prod(axis_sizes.values())
    return devices[:wanted] if 0 < wanted <= len(devices) else devices


def _link_peak(device, process_count: int) -> float | None:
    """The NVLink peak of `device` in GB/s, if known and all ranks are on one host's NVLink."""
    kind = device.device_kind
    if device.platform != "gpu" or process_count > 1 or re.search(r"PCIe|\bNVL\b", kind, re.IGNORECASE):
        return None
    return next((peak for part, peak in NVLINK_PEAK_GBPS.items() if part in kind), None)


def _describe_setup(mesh, axes, n, device, peak, dtype: str, warmup: int, repeats: int) -> str:
    mesh_text = ",".join(f"{name}={size}" for name, size in jshard.mesh_shape(mesh).items() if size > 1)
    lines = [
        f"# jshard bench collectives: {mesh.size} × {device.device_kind} ({device.platform}), mesh {mesh_text}, "
        f"axis {','.join(axes)} (N={n}), {dtype}, median of {repeats} after {warmup} warm-up"
    ]
    if device.platform == "cpu":
        lines.append("# fake CPU devices: these times are memory copies between threads of one process, not links")
    elif peak:
        lines.append(f"# link peak {peak} GB/s per GPU per direction (NVLink); last column busbw / peak")
    else:
        lines.append("# no link peak known for this device, so no busbw / peak column")
    lines.append("# size S as nccl-tests: all_gather/gather the gathered output, reduce_scatter/scatter the full input")
    header = f"{'op':<15}{'size (B)':>12}{'count':>11}{'time (us)':>12}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}"
    lines.append(header + (f"{'busbw/peak':>12}" if peak else ""))
    return "\n".join(lines)


def _format_row(row: dict, peak) -> str:
    text = (
        f"{row['op']:<15}{row['bytes']:>12}{row['count']:>11}{row['time_us']:>12.1f}"
        f"{row['algbw_GBps']:>14.3f}{row['busbw_GBps']:>14.3f}"
    )
    return text + (f"{row['busbw_over_peak']:>12.2f}" if peak else "")


def _bench_one(op: str, size: int, mesh, axes, n: int, dtype: str, warmup: int, repeats: int) -> dict:
    """Time one collective on S ≈ `size` bytes: S is rounded down to whole elements per rank."""
    bench = COLLECTIVES[op]
    dtype = jnp.dtype(dtype)
    count = max(size // (n * dtype.itemsize), 1) * n  # elements in S, a multiple of N
    per_rank = count // n if bench.input_is_chunk else count

    every_device = jax.P(mesh.axis_names)  # one block per device, whatever the mesh
    x = jnp.ones((mesh.size * per_rank,), dtype, device=NamedSharding(mesh, every_device))
    step = jax.jit(
        jax.shard_map(lambda block: bench.call(block, axes), mesh=mesh, in_specs=every_device,
                      out_specs=every_device, check_vma=True)
    )
    for _ in range(warmup):
        step(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(x).block_until_ready()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    nbytes = count * dtype.itemsize
    algbw = nbytes / seconds / 1e9
    return {
        "op": op, "bytes": nbytes, "count": count, "time_us": seconds * 1e6,
        "algbw_GBps": algbw, "busbw_GBps": algbw * bench.busbw_factor(n),
    }
