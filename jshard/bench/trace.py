"""Where a profiled step's time went on the device: `jax.profiler`'s trace, summed.

`bench.step_time` traces `PROFILE_STEPS` steps of jshard's step, then as many of the plain one,
each waited for and annotated (`jshard step`, `plain step`). This reads the Perfetto trace
that writes (`*.trace.json.gz`): every device kernel is given to the step whose annotation
holds its start, and put in one kind by its name (KINDS, first match). Per step:

    wall_s       the annotation's length: the step as the host saw it, launch to result
    busy_s       the union of its kernels' intervals (streams that run at once count once)
    idle_s       wall - busy: the device waiting (launches, host work, synchronisation)
    kinds        {kind: summed kernel seconds}, and the top kernels by time

On a CPU there are no device kernels: `device_events` is 0 and nothing is summed.
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re

# (kind, pattern of the kernel's name), first match wins. cuBLAS's Hopper kernels are named
# nvjet_* or sm90_xmma_*; cuDNN's fused attention cudnn_* / *fmha* / *flash*.
KINDS = (
    ("collective", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"fmha|flash|cudnn|attention", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|wgmma|triton_gemm|dot", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)
OTHER = "fusion"  # XLA's own fused elementwise and reduction kernels
STEPS = ("jshard step", "plain step")
TOP = 8


def kind_of(kernel: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(kernel)), OTHER)


def _trace_file(trace_dir: str) -> pathlib.Path:
    files = sorted(pathlib.Path(trace_dir).rglob("*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"{trace_dir}: no *.trace.json.gz (was the profile written with create_perfetto_trace?)")
    return files[-1]


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarize(trace_dir: str) -> dict:
    """The summary of the trace under `trace_dir` (module docstring), per annotated step name."""
    events = json.loads(gzip.decompress(_trace_file(trace_dir).read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, name in names.items() if not name.startswith("/host:")}  # "/device:GPU:0", ...
    spans = [e for e in events if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in spans
                   if e.get("pid") not in device_pids and e["name"] in STEPS)
    kernels = [e for e in spans if e.get("pid") in device_pids]
    out = dict(trace=str(_trace_file(trace_dir)), device_events=len(kernels), steps={})
    for name in STEPS:
        windows = [(s, e) for s, e, n in steps if n == name]
        if not windows:
            continue
        mine = [k for k in kernels if any(s <= k["ts"] < e for s, e in windows)]
        by_kind, by_name = collections.Counter(), collections.Counter()
        for k in mine:
            by_kind[kind_of(k["name"])] += k["dur"]
            by_name[k["name"]] += k["dur"]
        n = len(windows)
        wall = sum(e - s for s, e in windows) / n
        # A kernel still running when its step's window closes counts up to the close.
        busy = sum(_busy([(k["ts"], min(k["ts"] + k["dur"], e)) for k in mine if s <= k["ts"] < e]) for s, e in windows) / n
        out["steps"][name] = dict(
            steps=n, wall_s=wall / 1e6, busy_s=busy / 1e6, idle_s=(wall - busy) / 1e6, kernels_per_step=len(mine) / n,
            kinds={kind: us / n / 1e6 for kind, us in by_kind.most_common()},
            top=[dict(name=k[:120], kind=kind_of(k), s=us / n / 1e6) for k, us in by_name.most_common(TOP)])
    return out


def report(summary: dict) -> str:
    if not summary["device_events"]:
        return "  profile     no device kernels in the trace (a CPU): nothing to sum"
    lines = []
    for name, s in summary["steps"].items():
        kinds = ", ".join(f"{k} {v / s['wall_s']:.0%}" for k, v in s["kinds"].items())
        lines.append(f"  profile     {name}: wall {s['wall_s'] * 1e3:.1f} ms, device busy {s['busy_s'] / s['wall_s']:.0%} "
                     f"({s['kernels_per_step']:.0f} kernels); of the wall: {kinds}")
    return "\n".join(lines)
