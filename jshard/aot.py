"""A step compiled for GPUs on a machine with none: XLA's GPU compiler, ahead of time.

The CUDA plugin (`jax-cuda13-plugin` and `jax-cuda13-pjrt`, no `nvidia-*` wheels) carries
XLA's GPU compiler. Given a target description (`jshard/targets/*.txtpb`: what XLA would read
off the device) it describes a topology of GPUs that are not here, and `compile()` of a step
lowered over a mesh of those devices runs the GPU pipeline: SPMD partitioning, fusion,
collective combining, bf16 collectives, cuDNN attention, the latency-hiding scheduler and
buffer assignment. What comes back is the program a GPU would run, with its memory, but no
timing: kernels are not autotuned without a device, and `cost_analysis()` is not offered.

JAX itself stays on the CPU (`jax_platforms="cpu"`; the plugin only compiles). The step is
built abstractly (`build_step(..., abstract=True)`): no array exists, on any device.

    target_devices(target)       the target's GPUs, compile-only
    compile_step(...)            a model's training step, compiled for a target: a `GpuProgram`
    GpuProgram                   memory per device, each collective (kind, mesh axes, dtype,
                                 bytes, asynchronous, overlapped by a matmul), attention's kernel
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
import math
import re
import time

import jax
import jax.numpy as jnp

from jshard import hlo
from jshard.layout import Layout
from jshard.mesh import make_mesh, mesh_shape
from jshard.parallel.tick_branches import TickBranches
from jshard.parallel.state import abstract_batch
from jshard.parallel.step import build_step
from jshard.placement import format_bytes as fmt

GPU_COMPILERS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


class CompileError(RuntimeError):
    """No GPU compiler here, or a target it does not know."""


@dataclasses.dataclass(frozen=True)
class Target:
    """GPUs to compile for: `hosts` machines of `per_host` devices of one kind."""

    name: str
    spec: str  # jshard/targets/<spec>.txtpb
    hardware: str  # the planner's profile (`planner.hardware.HARDWARE`)
    hosts: int
    per_host: int = 8

    @property
    def devices(self) -> int:
        return self.hosts * self.per_host

    def config(self) -> str:
        """The GpuTargetConfigProto text XLA's GPU compiler reads."""
        return (importlib.resources.files("jshard") / "targets" / f"{self.spec}.txtpb").read_text()

    @property
    def hbm_bytes(self) -> int:
        return int(re.search(r"device_memory_size:\s*(\d+)", self.config())[1])


# One GPU (`jshard bench gpu` compares its device's own compile with this one), a host of 8, two.
TARGETS = {t.name: t for t in (
    Target("h100x1", "h100_sxm", "h100", hosts=1, per_host=1), Target("h100x8", "h100_sxm", "h100", hosts=1),
    Target("h100x16", "h100_sxm", "h100", hosts=2),
    Target("h200x1", "h200_sxm", "h200", hosts=1, per_host=1), Target("h200x8", "h200_sxm", "h200", hosts=1),
    Target("h200x16", "h200_sxm", "h200", hosts=2),
)}


def target(name: str) -> Target:
    if name not in TARGETS:
        raise CompileError(f"target {name!r}: choose one of {', '.join(TARGETS)}")
    return TARGETS[name]


def gpu_compiler_missing() -> str | None:
    """Why XLA's GPU compiler cannot run here, or None where it can."""
    if any(importlib.util.find_spec(m) for m in GPU_COMPILERS):
        return None
    v = jax.__version__
    return (f"XLA's GPU compiler is the CUDA plugin, not installed here: pip install jax-cuda13-plugin=={v} "
            f"jax-cuda13-pjrt=={v} (about 400 MB, no GPU needed; `make venv GPU_COMPILE=1`)")


def use_cpu_for_jax() -> None:
    """JAX's own backend on the CPU, so the plugin serves only as a compiler (started as a
    backend with no GPU, it fails). Call before JAX starts; after, JAX must already be on the CPU."""
    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        pass
    if jax.config.jax_platforms != "cpu" and jax.default_backend() != "cpu":
        raise CompileError(f"JAX started on {jax.default_backend()}: compiling for a GPU target with no GPU "
                           "needs JAX_PLATFORMS=cpu (set it before starting Python)")


def target_devices(t: Target) -> list:
    """`t`'s GPUs as compile-only devices, hosts outermost (ids 0.. in order)."""
    if reason := gpu_compiler_missing():
        raise CompileError(reason)
    use_cpu_for_jax()
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=t.config(), topology=f"1x{t.hosts}x{t.per_host}")
    return sorted(topology.devices, key=lambda d: d.id)


@dataclasses.dataclass
class GpuProgram:
    """What XLA's GPU compiler made of a step, per device: memory (bytes: arguments, outputs,
    aliased, temporaries, total = arguments + outputs - aliased + temporaries, the target's
    HBM), each collective of the program, attention's kernel, its kernels by kind
    (`hlo.kernel_counts`), and the optimized HLO."""

    target: str
    mesh: dict[str, int]
    compile_seconds: float
    memory: dict[str, int]
    collectives: list[dict]
    attention: str
    kernels: dict[str, int] = dataclasses.field(default_factory=dict)
    hlo: str = dataclasses.field(repr=False, default="")
    xla_options: dict = dataclasses.field(default_factory=dict)  # this program's own (`Plan.xla_options`)
    # A pipeline's tick table on the program's conditionals (`tick_branches.TickBranches`): what a
    # reading of it (bytes here, `planner.schedule.timeline`) takes to run on each tick.
    ticks: TickBranches | None = dataclasses.field(repr=False, default=None)

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.memory["hbm"]

    def bytes_by_kind_and_axes(self) -> dict[tuple[str, str], int]:
        """{(kind, "axis+axis"): bytes per device per step}, as the planner keys its traffic."""
        totals: dict[tuple[str, str], int] = {}
        for c in self.collectives:
            if c["bytes"]:
                key = (c["kind"], c["axes"])
                totals[key] = totals.get(key, 0) + c["bytes"]
        return totals

    def overlap(self, looped: bool = False) -> dict[str, float]:
        """{kind: the share of its bytes that a matmul is scheduled beside} (async ones only can be);
        `looped`: of the collectives run on every trip of a loop only (the scan over layers, a
        pipeline's ticks), where each layer's collective can hide behind another layer's compute."""
        moved: dict[str, list[int]] = {}
        for c in self.collectives:
            if c["bytes"] and (c["count"] > 1 or not looped):
                totals = moved.setdefault(c["kind"], [0, 0])
                totals[0] += c["bytes"] * c["overlapped"]
                totals[1] += c["bytes"]
        return {kind: hidden / total for kind, (hidden, total) in moved.items()}

    def as_json(self) -> dict:
        return dataclasses.asdict(dataclasses.replace(self, ticks=None)) | dict(
            hlo=None, fits=self.fits, overlap=self.overlap(), overlap_in_loops=self.overlap(looped=True))


def attention_kernel(hlo_text: str) -> str:
    """"cudnn" where the program calls cuDNN's fused attention, "pallas" where it calls jshard's
    flash kernel (`nn.flash`, a Triton call named jshard_flash_*), else "xla" (its own fusions)."""
    if re.search(r'custom_call_target="__cudnn\$fmha', hlo_text):
        return "cudnn"
    return "pallas" if re.search(r'name = \\?"jshard_flash_forward', hlo_text) else "xla"


def memory_of(compiled) -> dict[str, int]:
    """A compiled executable's memory per device (bytes), from its memory_analysis()."""
    ma = compiled.memory_analysis()
    memory = dict(arguments=ma.argument_size_in_bytes, outputs=ma.output_size_in_bytes, aliased=ma.alias_size_in_bytes,
                  temporaries=ma.temp_size_in_bytes)
    memory["total"] = memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temporaries"]
    return memory


def program_of(compiled, mesh: dict[str, int], t: Target, seconds: float, ticks: TickBranches | None = None) -> GpuProgram:
    """A compiled executable's `GpuProgram`: its memory_analysis() and its optimized HLO read by
    `jshard.hlo` (bytes as compiled: XLA:GPU keeps bf16 collectives bf16; a pipeline's, with
    its `ticks`, as often as a mean device runs each). A program compiled on a GPU itself reads
    the same way (`jshard bench gpu` compares the two)."""
    text = compiled.as_text()
    hidden = hlo.overlapped(text)
    rows = []
    for c in hlo.collectives(text, branch_weights=ticks and ticks.weights):
        axes = hlo.group_axes(c.line, mesh)
        by_dtype: dict[str, int] = {}
        for dtype, nbytes in zip(c.dtypes, c.buffers):
            by_dtype[dtype] = by_dtype.get(dtype, 0) + round(nbytes * c.count) * (c.bytes > 0)
        rows.append(dict(kind=c.kind, axes="+".join(axes) if axes is not None else "?", bytes_by_dtype=by_dtype,
                         bytes=round(c.bytes * c.count), count=c.count, asynchronous=c.asynchronous,
                         overlapped=hidden.get(c.name, False), name=c.name))
    memory = memory_of(compiled) | dict(hbm=t.hbm_bytes)
    return GpuProgram(t.name, dict(mesh), seconds, memory, rows, attention_kernel(text), hlo.kernel_counts(text), text,
                      ticks=ticks)


def compile_step(model, tx, loss_fn, layout: Layout | str, t: Target, batch_shape: tuple[int, int]) -> GpuProgram:
    """`loss_fn`'s training step for `model` (an `nnx.eval_shape` of it will do) and optimizer
    `tx`, laid out as `layout` (`jshard.Layout`, or its line) over target `t`'s GPUs, compiled by
    XLA's GPU compiler here, with no GPU. `batch_shape`: the global batch of token ids (rows, seq + 1)."""
    layout = Layout.coerce(layout)
    if -1 in dict(layout.mesh).values() or math.prod(dict(layout.mesh).values()) != t.devices:
        raise CompileError(f"Layout.mesh {layout.mesh_text}: {t.name} has {t.devices} GPUs. Fix: sizes whose product "
                           f"is {t.devices}, or another target.")
    mesh = make_mesh(target_devices(t), **dict(layout.mesh))
    step = build_step(model, tx, loss_fn, layout, mesh, abstract=True)
    batch = abstract_batch(step.plan, batch_shape, jnp.int32)
    start = time.perf_counter()
    try:
        compiled = step.lower(step.state, batch).compile()
    except jax.errors.JaxRuntimeError as e:  # XLA's own failure: its first line, which names the check
        raise CompileError(f"XLA's GPU compiler failed on this step for {t.name}: {str(e).strip().splitlines()[0]}. "
                           "Fix: none in jshard's flags; report it with the command (a JAX/XLA issue)") from None
    program = program_of(compiled, mesh_shape(mesh), t, time.perf_counter() - start, step.tick_branches)
    return dataclasses.replace(program, xla_options=dict(step.plan.xla_options))


def compared(program: GpuProgram, est: dict) -> dict:
    """The compiled program beside the planner's estimate for the same input (`planner.estimate`):
    total memory, bytes per (kind, axes), attention's kernel."""
    planned_memory = est["memory_bytes_per_device"]
    planned_bytes = {(r["kind"], r["axes"]): r["bytes"] for r in est["collectives"]}
    compiled_bytes = program.bytes_by_kind_and_axes()
    keys = sorted(set(planned_bytes) | set(compiled_bytes))
    return dict(
        memory_planned=planned_memory["total"], memory_compiled=program.memory["total"],
        memory_rel_err=planned_memory["total"] / program.memory["total"] - 1,
        bytes=[dict(kind=k, axes=a, planned=planned_bytes.get((k, a), 0), compiled=compiled_bytes.get((k, a), 0))
               for k, a in keys],
        bytes_exact=planned_bytes == compiled_bytes,
        attention_planned=est["attention"], attention_compiled=program.attention,
    )


def report(program: GpuProgram, est: dict, devices: str, along=None) -> str:
    """What `jshard compile` prints: the compiled program per device beside the plan, and where
    given, `along` (a `planner.schedule.Timeline` of the program): each kind's time hidden and
    the step timed along the schedule."""
    vs = compared(program, est)
    mem = program.memory
    lines = [f"compiled by XLA:GPU for {devices} ({program.target}), on this host with no GPU, in "
             f"{program.compile_seconds:.1f} s",
             f"memory per device      {'plan':>12}{'compiled':>12}",
             f"  arguments            {'':>12}{fmt(mem['arguments'], 2):>12}  (params, optimizer state, batch)",
             f"  outputs              {'':>12}{fmt(mem['outputs'], 2):>12}  ({fmt(mem['aliased'], 2)} of them donated)",
             f"  temporaries          {'':>12}{fmt(mem['temporaries'], 2):>12}",
             f"  total                {fmt(vs['memory_planned'], 2):>12}{fmt(mem['total'], 2):>12}  "
             f"plan {vs['memory_rel_err'] * 100:+.1f}%; {'fits' if program.fits else 'DOES NOT FIT'} in "
             f"{fmt(mem['hbm'], 2)} of HBM"]
    lines.append("collectives per device per step  (async: split into start and done; overlapped: a matmul "
                 "scheduled between them" + ("; hidden: the share of its time the work scheduled there covers)"
                                              if along else ")"))
    rows = []
    for row in vs["bytes"]:
        ops = [c for c in program.collectives if (c["kind"], c["axes"]) == (row["kind"], row["axes"]) and c["bytes"]]
        by_dtype: dict[str, int] = {}
        for c in ops:
            for dtype, nbytes in c["bytes_by_dtype"].items():
                by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
        rows.append((row, ops, by_dtype, ",".join(sorted(by_dtype, key=lambda d: (d.startswith("f8"), d))) or "-"))
    width = max([7] + [len(dtypes) + 1 for *_, dtypes in rows])  # "bf16,f8e4m3fn": bf16 and FP8 weights combined
    hidden = along.hidden() if along else {}

    def hidden_cell(row) -> str:  # "-": a collective the timeline gave no time (a group of one)
        if not along:
            return ""
        key = (row["kind"], row["axes"])
        return f"{hidden[key]:>9.0%}" if key in hidden else f"{'-':>9}"

    lines.append(f"  {'kind':<19}{'axes':<14}{'dtype':<{width}}{'plan':>12}{'compiled':>12}{'async':>8}{'overlapped':>12}"
                 + (f"{'hidden':>9}" if along else ""))
    for row, ops, by_dtype, dtypes in rows:
        total = sum(c["bytes"] for c in ops) or 1
        share = lambda key: sum(c["bytes"] for c in ops if c[key]) / total  # noqa: E731
        mark = "" if row["planned"] == row["compiled"] else "  ≠"
        lines.append(f"  {row['kind']:<19}{row['axes']:<14}{dtypes:<{width}}{fmt(row['planned'], 2):>12}"
                     f"{fmt(row['compiled'], 2):>12}{share('asynchronous'):>8.0%}{share('overlapped'):>12.0%}"
                     + hidden_cell(row) + mark)
        if len(by_dtype) > 1:  # what each dtype of a combined collective moved
            lines.append(f"  {'':<33}compiled: " + ", ".join(
                f"{fmt(n, 2)} {d}" for d, n in sorted(by_dtype.items(), key=lambda kv: -kv[1])))
    lines.append("  bytes: " + ("equal to the plan's" if vs["bytes_exact"] else "NOT equal to the plan's (≠)"))
    if looped := program.overlap(looped=True):
        lines.append("  in loops (the scan over layers, a pipeline's ticks), overlapped: "
                     + ", ".join(f"{kind} {share:.0%}" for kind, share in sorted(looped.items())) + " of the bytes")
    if along:
        lines.append(f"step along the compiled schedule: {along.seconds * 1e3:.1f} ms, {along.compute * 1e3:.1f} of them "
                     f"kernels and loop trips, {(along.seconds - along.compute) * 1e3:.1f} waiting on collectives "
                     f"(`planner.schedule`); the plan's: {est['predicted_step_s'] * 1e3:.1f} ms")
    kernel = {"cudnn": "cuDNN's fused flash attention (__cudnn$fmha)", "xla": "XLA's own fusions (scores kept)",
              "pallas": "jshard's flash kernel (Pallas, Triton: jshard_flash_*)"}
    lines.append(f"attention: {kernel[program.attention]}; planned: {est['attention']}")
    return "\n".join(lines)
