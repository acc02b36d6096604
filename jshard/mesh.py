"""Device meshes from named axis sizes, on real devices or N fake CPU devices.

A jshard mesh always carries the six standard axes, outermost first:

    data   - pure data parallelism (replicated params)
    stage  - pipeline stages
    fsdp   - data parallelism with sharded params / grads / optimizer state (ZeRO)
    context - context parallelism: each sequence split over devices
    expert - expert parallelism: a mixture of experts' experts split over devices, which
             hold other rows of the batch everywhere else
    tensor - tensor (Megatron) and sequence parallelism

Axes not asked for have size 1, so every preset in `jshard.rules` applies to every mesh.
The order puts `tensor` innermost: on GPUs adjacent devices share the fastest links, and
tensor parallelism talks every layer; `expert` next to it, as its all-to-alls run every
MoE layer. Extra, user-named axes follow the standard ones.

In a multi-process run (`jshard.distributed`), `jax.devices()` is the global device list,
so the same call on every process builds one global mesh; devices are taken process by
process, so the outer axes (`data`, then `fsdp`) cross hosts and `tensor` stays inside one.
"""

from __future__ import annotations

import difflib
import glob
import importlib.util
import math
import os
import re
import subprocess
import sys
from collections.abc import Mapping

import jax
from jax.sharding import AxisType, Mesh

STANDARD_AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")


class MeshError(ValueError):
    """A mesh that cannot be built on the devices at hand."""


def use_fake_cpu_devices(n: int, *, unless_accelerated: bool = False) -> None:
    """Ask JAX for `n` CPU devices (and the CPU platform), before JAX starts its backends.

    This is how every sharding runs on a laptop: the devices are threads of one process.
    Call it before the first JAX computation; afterwards JAX refuses to change the count.
    `unless_accelerated=True`, for a script that runs as well on GPUs: only where JAX would run
    on the CPU anyway, and never an error (`use_fake_cpu_devices_unless_accelerated`).
    """
    if unless_accelerated:
        use_fake_cpu_devices_unless_accelerated(n)
        return
    if not isinstance(n, int) or n < 1:
        raise MeshError(f"use_fake_cpu_devices(n) needs a positive int, got {n!r}")
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # backends already initialised
        have = jax.device_count()
        if have == n and jax.default_backend() == "cpu":
            return
        raise MeshError(
            f"use_fake_cpu_devices({n}) was called after JAX had started with {have} "
            f"{jax.default_backend()} device(s). Call it before any JAX computation, or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} JAX_PLATFORMS=cpu "
            "in the environment before starting Python."
        ) from e
    # Child processes (and code reading XLA_FLAGS) see the same request.
    flag = f"--xla_force_host_platform_device_count={n}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [flag])


def fake_device_count(given: int | None, default: int) -> int:
    """A command's fake CPU device count: `--fake-devices` where given, else the count the
    environment's XLA_FLAGS asks for (--xla_force_host_platform_device_count=N), else `default`."""
    if given is not None:
        return given
    asked = [f.split("=", 1)[1] for f in os.environ.get("XLA_FLAGS", "").split()
             if f.startswith("--xla_force_host_platform_device_count=")]
    return int(asked[-1]) if asked and asked[-1].isdigit() and int(asked[-1]) > 0 else default


def use_fake_cpu_devices_unless_accelerated(n: int) -> None:
    """For commands: with no GPU/TPU to run on, ask for `n` fake CPU devices.

    JAX runs on the CPU when JAX_PLATFORMS=cpu, or when it is unset and no accelerator
    plugin is installed (asked without starting JAX's backends). If JAX has already started
    in this process (a caller's work, a test), its devices are used as they are; so are
    the JAX_NUM_CPU_DEVICES that `jshard launch` gives each process of a multi-process run.
    """
    if os.environ.get("JAX_NUM_CPU_DEVICES"):
        return
    if runs_on_cpu():
        try:
            use_fake_cpu_devices(n)
        except MeshError:
            pass


GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")

# XLA flags jshard sets for GPU runs, each for what the compiled H100 program showed
# (`jshard compile`, docs/gpu-compile.md). They only reorder work, so results do not change;
# on one GPU, with nothing to communicate, they cost nothing. The test suite checks that the
# installed XLA knows every one: XLA aborts at start-up on an unknown flag.
GPU_XLA_FLAGS = (
    # Schedule collectives and copies to run beside compute (without it each collective's
    # done follows its start).
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # Their stream first, so that a collective starts when issued, not after queued kernels.
    "--xla_gpu_enable_highest_priority_async_stream=true",
    # A loop (the scan over layers) starts the next trip's collective in this one: without
    # them XLA:GPU starts each ZeRO-3 gather in the layer that needs it, with only a norm
    # between its start and done.
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
)

# Added where XLA's GPU compiler runs on a machine with no GPU (`jshard compile`, `plan --compile`,
# `bench gpu --dry`): with no device to time a candidate on, its autotuner still compiles the
# candidates and picks what it picks without them. Off, the compile takes about half the time for
# the same program: HLO, schedule, buffers and collectives equal but for kernels' tuning
# annotations (three programs, Llama 3.1 8B among them: docs/gpu-compile.md).
DEVICELESS_XLA_FLAGS = ("--xla_gpu_autotune_level=0",)

# Set per program, not for the process (`Plan.xla_options`): a ZeRO-3 step without tensor
# parallelism lets XLA:GPU keep this many collectives in flight (its default: 1). With one, a
# layer's separate gathers wait for each other and the last ones find no matmul left to run
# beside (Llama 3.1 8B, fsdp=8: 73% of the layer loop's gathered bytes overlapped; 92% with 4).
# Under tensor parallelism the extra gathers are placed beside the tensor all-reduces instead
# of matmuls (dp+fsdp+tp: 75% -> 31%), so there it stays 1. XLA_FLAGS that set it win.
COLLECTIVES_IN_FLIGHT_OPTION = "xla_gpu_experimental_parallel_collective_overlap_limit"
ZERO3_COLLECTIVES_IN_FLIGHT = 4
# Two where the layers are rematerialised (full or selective remat, bf16 compute, not FP8). Under
# full remat, with four XLA's scheduler left two layers' scatters after the backward loop, beside
# the optimizer alone; under selective it started a trip's five gathers together beside one
# matmul. Timed along each program's schedule (`planner.schedule`): full remat as fast or faster
# on every program compiled (Llama 3.1 8B and 3.2 1B, fsdp=8 and data=2,fsdp=4, bf16 and mixed:
# 0.0-1.4% a step, up to 1.46 GiB less); selective 1.4-9.0% faster on the 8B, within 2% slower
# on the 1B. Not under FP8 (no faster; fewer gathers beside matmuls), nor without remat (mixed
# results): docs/gpu-compile.md.
REMAT_COLLECTIVES_IN_FLIGHT = 2
# Set per program (`Plan.xla_options`) where ZeRO-3 reduce-scatters each layer's gradients with
# no tensor axis, under full remat (without it they cost the gathers): the layer loop
# double-buffered (two trips an iteration, so a trip's scatters and the next one's gathers each
# find the other trip's matmuls) and MaxText's H100 combine thresholds. Llama 3.1 8B, fsdp=8,
# full remat, compiled for 8 H100s: mixed, reduce-scatter 90% -> 97% of the bytes overlapped,
# 20.87 -> 20.72 GiB; double buffering alone: 70% (docs/gpu-compile.md).
SCATTER_OVERLAP_OPTIONS = {
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 64 * 2**20,
    "xla_gpu_all_gather_combine_threshold_bytes": 128 * 2**20,
    "xla_gpu_all_reduce_combine_threshold_bytes": 128 * 2**20,
}
# Set off per program under FP8 (`Plan.xla_options`): a Triton GEMM computes an FP8 product's
# dequantized operands in bf16, where cuBLASLt runs them in FP8.
TRITON_GEMM_OPTION = "xla_gpu_enable_triton_gemm"


def flag_name(flag: str) -> str:
    """'--xla_gpu_enable_latency_hiding_scheduler=true' -> 'xla_gpu_enable_latency_hiding_scheduler'."""
    return flag.lstrip("-").split("=", 1)[0]


def use_gpu_xla_flags(compiling_for_gpu: bool = False) -> list[str]:
    """For commands: add `GPU_XLA_FLAGS` to XLA_FLAGS when JAX will run on a GPU (or,
    `compiling_for_gpu`, XLA's GPU compiler compiles for one here: `jshard compile`; with no GPU
    present, `DEVICELESS_XLA_FLAGS` too), flag by flag: a flag the user's XLA_FLAGS already sets
    keeps the user's value, and the user's other flags (a dump folder, a device count, NCCL's) stay
    beside jshard's. XLA reads the flags once, when its backends start, so call this before any JAX
    computation. Returns the flags added.
    """
    on_gpu = _gpu_expected()
    if not (compiling_for_gpu or on_gpu):
        return []
    given = os.environ.get("XLA_FLAGS", "").split()
    mine = {flag_name(f) for f in given}
    wanted = GPU_XLA_FLAGS + (() if on_gpu else DEVICELESS_XLA_FLAGS)
    added = [f for f in wanted if flag_name(f) not in mine]
    if added:
        os.environ["XLA_FLAGS"] = " ".join(given + added)
    return added


_XLA_FLAGS_CHECKED = "JSHARD_XLA_FLAGS_CHECKED"  # XLA_FLAGS found good (`check_xla_flags`)
# What XLA prints where it rejects XLA_FLAGS, before it aborts the process (with, for a bad value,
# its usage of every flag: ~90 lines): a flag it does not know, a value it cannot read, a word
# without "--" (which it takes for a file of flags).
_XLA_FLAG_REJECTION = re.compile(r"\] ((?:Unknown flag|Couldn't interpret value|Could not open file).*)")


def check_xla_flags() -> None:
    """For commands, before JAX starts: raise `MeshError` (one line) where XLA would abort the
    process on the environment's XLA_FLAGS. XLA parses them when its first backend starts and
    aborts on a flag it does not know or a value it cannot read, so they are tried first in a
    child process on the CPU, as XLA parses GPU flags there too (about a second); not where
    every flag is jshard's own or the fake-device count, nor again where this process or its
    parent found the same flags good (`_XLA_FLAGS_CHECKED`, which child processes inherit: the
    processes of `jshard launch`)."""
    flags = os.environ.get("XLA_FLAGS", "")
    own = set(GPU_XLA_FLAGS + DEVICELESS_XLA_FLAGS)
    if (os.environ.get(_XLA_FLAGS_CHECKED) == flags
            or all(f in own or re.fullmatch(r"--xla_force_host_platform_device_count=\d+", f) for f in flags.split())):
        return
    try:
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], capture_output=True,
                               text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    except subprocess.TimeoutExpired:
        return
    if probe.returncode and (m := _XLA_FLAG_REJECTION.search(probe.stderr)):
        raise MeshError(f"XLA_FLAGS={flags!r}: XLA rejects it: {m[1].strip().rstrip('.')}. "
                        "Fix: correct or remove that flag (each is --name=value; jshard adds its own GPU flags beside yours).")
    if not probe.returncode:
        os.environ[_XLA_FLAGS_CHECKED] = flags


def xla_flags_line() -> str:
    """The XLA flags in effect, as commands print them: XLA_FLAGS, or 'none'."""
    return os.environ.get("XLA_FLAGS", "").strip() or "none"


def xla_options_line(options: dict) -> str:
    """A program's own XLA options (`Plan.xla_options`), written as flags, or 'none'."""
    return " ".join(f"--{name}={str(value).lower() if isinstance(value, bool) else value}"
                    for name, value in options.items()) or "none"


def runs_on_cpu() -> bool:
    """Whether JAX will start on the CPU, asked without starting its backends: JAX_PLATFORMS=cpu,
    or it is unset and no accelerator (a CUDA plugin with an NVIDIA device, a TPU) is there."""
    platforms = jax.config.jax_platforms
    return platforms == "cpu" or (not platforms and not _gpu_expected() and not _installed(("libtpu",)))


def _gpu_expected() -> bool:
    """Whether JAX will start on a GPU, asked without starting its backends: the first of
    JAX_PLATFORMS if set, else whether a CUDA plugin is installed (JAX prefers it) and an NVIDIA
    device is present: the plugin alone is also XLA's GPU compiler on a machine with no GPU
    (`jshard compile`), where JAX falls back to the CPU."""
    platforms = jax.config.jax_platforms
    if platforms:
        return platforms.split(",")[0].strip() in ("cuda", "gpu")
    return _installed(GPU_PLUGINS) and bool(glob.glob("/dev/nvidia[0-9]*"))


def _installed(modules) -> bool:
    return any(importlib.util.find_spec(m) for m in modules)


def parse_axis_sizes(text: str) -> dict[str, int]:
    """'data=2,fsdp=2,tensor=-1' -> {'data': 2, 'fsdp': 2, 'tensor': -1}, for command lines."""
    sizes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, size = item.partition("=")
        try:
            sizes[name.strip()] = int(size)
        except ValueError:
            raise MeshError(f"mesh {text!r}: {item!r} is not name=size (e.g. data=2,fsdp=2,tensor=2)") from None
        if name.strip() not in STANDARD_AXES:
            near = difflib.get_close_matches(name.strip(), STANDARD_AXES, n=1)
            raise MeshError(f"mesh {text!r}: unknown mesh axis {name.strip()!r}; known: {', '.join(STANDARD_AXES)}. "
                            f"Fix: {near[0] + '=' + size.strip() if near else 'one of those'}.")
    return sizes


def format_mesh(sizes: Mapping[str, int]) -> str:
    """{'data': 2, 'stage': 1, 'tensor': 4} -> 'data=2,tensor=4', as --mesh takes it (axes of
    size 1 left out, as --mesh may leave them)."""
    return ",".join(f"{axis}={size}" for axis, size in sizes.items() if size != 1)


def mesh_text(sizes: Mapping[str, int]) -> str:
    """`format_mesh`'s text as commands print a mesh: 'data=2,tensor=4', or 'one device'."""
    return format_mesh(sizes) or "one device"


def default_mesh(rules, devices: int) -> dict[str, int]:
    """The mesh every command uses when given no --mesh: each axis the rules (a `jshard.Rules`)
    name, innermost first, gets 2 devices while 2 divides what is left; the outermost takes the rest.
    dp+fsdp+tp on 8 devices: data=2, fsdp=2, tensor=2; zero3: fsdp=8; any preset on 1: all 1."""
    axes = rules.mesh_axes or ("data",)
    sizes, rest = {}, devices
    for axis in reversed(axes[1:]):
        sizes[axis] = 2 if rest % 2 == 0 else 1
        rest //= sizes[axis]
    return {axes[0]: rest, **dict(reversed(sizes.items()))}


def mesh_sizes(text: str | None, rules, devices: int) -> dict[str, int]:
    """--mesh as {axis: size}, or when not given the strategy's default mesh over `devices`."""
    return parse_axis_sizes(text) if text else default_mesh(rules, devices)


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """{axis name: size} of a mesh, in mesh order."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def _resolve_sizes(sizes: dict[str, int], n_devices: int, platform: str) -> dict[str, int]:
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise MeshError(f"mesh axis {name!r} has size {size!r}; sizes are positive ints, or -1 for 'the rest'")
    fill = [name for name, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise MeshError(f"only one mesh axis may be -1 (fill the rest); got {', '.join(fill)}")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if n_devices % fixed:
            raise MeshError(
                f"mesh {_fmt(sizes)}: the fixed axes multiply to {fixed}, which does not divide the "
                f"{n_devices} {platform} device(s), so {fill[0]}=-1 cannot fill the rest. "
                f"Choose fixed sizes whose product divides {n_devices}."
            )
        sizes = {**sizes, fill[0]: n_devices // fixed}
    product = math.prod(sizes.values())
    if product != n_devices:
        raise MeshError(
            f"mesh {_fmt(sizes)} needs {product} devices, but JAX sees {n_devices} {platform} "
            f"device(s). Fix: choose sizes whose product is {n_devices} (one axis may be -1 to "
            f"fill the rest), or, on CPU, get {product} fake devices with "
            f"jshard.use_fake_cpu_devices({product}) before JAX starts, or "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={product}."
        )
    return sizes


def _fmt(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items() if v != 1) or "(all axes 1)"


def make_mesh(devices=None, axis_type: AxisType = AxisType.Auto, **axis_sizes: int) -> Mesh:
    """A mesh from named axis sizes, e.g. `make_mesh(data=2, fsdp=2, tensor=2)`.

    One axis may be -1: it takes the devices the others leave. Standard axes not named
    get size 1. `axis_type` defaults to Auto: outside `shard_map` the compiler propagates
    shardings, inside it jshard's collectives are explicit either way.
    """
    # Process by process: inner axes (tensor first) stay inside a host while they fit.
    devices = list(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)) if devices is None else devices)
    platform = devices[0].platform if devices else "?"
    sizes = {name: 1 for name in STANDARD_AXES}
    sizes.update(axis_sizes)
    sizes = _resolve_sizes(sizes, len(devices), platform)
    names = tuple(sizes)
    return jax.make_mesh(
        tuple(sizes.values()), names, axis_types=(axis_type,) * len(names), devices=devices
    )


def abstract_mesh(axis_type: AxisType = AxisType.Auto, **axis_sizes: int) -> jax.sharding.AbstractMesh:
    """A mesh of named sizes with no devices (`make_mesh`'s axes, in its order; standard axes not
    named get size 1): for plans, and steps lowered for machines this one is not."""
    sizes = {name: 1 for name in STANDARD_AXES} | axis_sizes
    return jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes), axis_types=(axis_type,) * len(sizes))
