"""MaxText's training step beside jshard's, for the same model, mesh and flags, both compiled for
8 H100s by XLA's GPU compiler on this machine (no GPU), both read by `jshard.aot.program_of`.

    make maxtext-compare            # its own virtualenv (.venv-maxtext): MaxText 0.2.5, its
                                    # accelerator-free requirements, XLA's GPU compiler, jshard

Llama 3.1 8B, FSDP over 8 GPUs, one row of 8192 tokens per GPU, full remat, cuDNN's attention.
Each row is its own process (XLA reads XLA_FLAGS once, when its backends start):

    maxtext, xla      MaxText's `train_compile`, XLA's defaults
    maxtext, maxtext  the same with MaxText's H100 flags (its `1vm.sh` for A3 machines)
    jshard, jshard    `jshard compile`, jshard's own GPU flags (`jshard.mesh.GPU_XLA_FLAGS`)
    jshard, maxtext   the same with MaxText's flags in XLA_FLAGS (jshard's added where they set none)

MaxText's `train_compile.main` runs unchanged but for one function: its mesh is made over the
compile-only H100s of `jax.experimental.topologies` (`jshard/targets/h100_sxm.txtpb`, what
`jshard compile` uses), where its own A3 path asks JAX for local GPUs. Printed per row: memory
per device (total, temporaries), each collective kind's bytes per device, the share of them XLA
scheduled beside a matmul and the share of its time hidden along the schedule, and the step
timed along the schedule (`jshard.planner.schedule`). Not part of the test suite or CI (minutes
of compiling, another virtualenv); its last output is in docs/gpu-compile.md, its JSON in
docs/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = "h100x8"
MODEL = dict(maxtext="llama3.1-8b", jshard="llama-3.1-8b")
SEQ, FSDP = 8192, 8

# MaxText's XLA flags for H100 (A3) machines, from its `1vm.sh`, as MaxText 0.2.5 ships them.
MAXTEXT_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false "
    "--xla_gpu_enable_command_buffer='' --xla_gpu_enable_highest_priority_async_stream=true "
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728 --xla_gpu_all_gather_combine_threshold_bytes=134217728 "
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864 --xla_gpu_pipeline_all_gather=on "
    "--xla_gpu_pipeline_reduce_scatter=on --xla_gpu_pipeline_all_reduce=on "
    "--xla_gpu_enable_while_loop_double_buffering=true --xla_gpu_enable_all_gather_combine_by_dim=false "
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false --xla_disable_hlo_passes=rematerialization")
ROWS = (("maxtext", "xla"), ("maxtext", "maxtext"), ("jshard", "jshard"), ("jshard", "maxtext"))
FLAGS_NAMED = dict(xla="XLA's defaults", maxtext="MaxText's H100 flags", jshard="jshard's flags")
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
GiB = 2**30


def maxtext_args(out: str) -> list[str]:
    """`train_compile`'s arguments: its base config, then the same step as jshard's row."""
    import maxtext

    base = Path(maxtext.__file__).parent / "configs" / "base.yml"
    return ["train_compile", str(base), "run_name=side_by_side", f"base_output_directory={out}",
            f"model_name={MODEL['maxtext']}", "hardware=gpu", "compile_topology=a3", "compile_topology_num_slices=1",
            "per_device_batch_size=1", f"max_target_length={SEQ}", f"ici_fsdp_parallelism={FSDP}",
            "dcn_data_parallelism=1", "remat_policy=full", "attention=cudnn_flash_jax", "dtype=bfloat16",
            "weight_dtype=float32", "dataset_type=synthetic", "enable_checkpointing=false",
            "skip_jax_distributed_system=true", "enable_goodput_recording=false", "monitor_goodput=false",
            "enable_tensorboard=false"]


def compile_maxtext(out: str) -> dict:
    """MaxText's step compiled for the target; its program read as jshard reads its own."""
    os.environ["DECOUPLE_GCLOUD"] = "TRUE"  # MaxText without Google Cloud
    import jax

    jax.config.update("jax_platforms", "cpu")
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh
    from maxtext.trainers.pre_train import train_compile

    spec = (ROOT / "jshard" / "targets" / "h100_sxm.txtpb").read_text()

    def topology_mesh(config):  # the one substitution: compile-only H100s instead of local GPUs
        found = topologies.get_topology_desc(platform="cuda", target_config=spec, topology=f"1x1x{FSDP}").devices
        jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
        grid = train_compile.maxtext_utils.create_device_mesh(config, sorted(found, key=lambda d: d.id))
        kind = AxisType.Explicit if config.shard_mode == train_compile.ShardMode.EXPLICIT else AxisType.Auto
        return Mesh(grid, config.mesh_axes, axis_types=(kind,) * len(config.mesh_axes))

    caught = {}
    compile_once = train_compile.jit_and_compile

    def kept(*args, **kwargs):
        start = time.perf_counter()
        caught["compiled"] = compile_once(*args, **kwargs)
        caught["seconds"], caught["mesh"] = time.perf_counter() - start, args[3]
        return caught["compiled"]

    train_compile.get_topology_mesh, train_compile.jit_and_compile = topology_mesh, kept
    try:
        train_compile.main(maxtext_args(out))
    except Exception as e:  # after compiling it asks for cost_analysis(), which compile-only GPUs lack
        if "compiled" not in caught:
            raise SystemExit(f"MaxText's train_compile failed before compiling: {type(e).__name__}: {e}") from None
    from jshard import aot  # (after MaxText's step: jshard sets Flax's eager sharding off on import)

    from jshard.planner.hardware import HARDWARE
    from jshard.planner.schedule import timeline

    mesh = {name: size for name, size in caught["mesh"].shape.items() if size > 1}
    program = aot.program_of(caught["compiled"], mesh, aot.target(TARGET), caught["seconds"])
    return summary(program.as_json() | dict(timeline=timeline(program.hlo, mesh, HARDWARE["h100"]).as_json()))


def compile_jshard(out: str) -> dict:
    """`jshard compile` for the same step; its JSON's compiled program."""
    written = Path(out) / "jshard.json"
    command = [sys.executable, "-m", "jshard.cli", "compile", "--model", MODEL["jshard"], "--strategy", "fsdp",
               "--mesh", f"fsdp={FSDP}", "--seq-len", str(SEQ), "--micro-batch-size", "1", "--target", TARGET,
               "--precision", "bf16", "--remat", "full", "--json", str(written)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return summary(json.loads(written.read_text())["compiled"])


def summary(program: dict) -> dict:
    """Of a compiled program (`GpuProgram.as_json()` with its `timeline`): memory per device, per
    collective kind its bytes per device, the share of them scheduled beside a matmul and the
    share of its time hidden along the schedule (`planner.schedule`), and the step along it."""
    moved = {}
    for c in program["collectives"]:
        totals = moved.setdefault(c["kind"], [0, 0])
        totals[0] += c["bytes"]
        totals[1] += c["bytes"] * c["overlapped"]
    memory = program["memory"]
    timed = program["timeline"]
    return dict(total_gib=memory["total"] / GiB, temporaries_gib=memory["temporaries"] / GiB,
                attention=program["attention"], compile_s=program["compile_seconds"],
                step_along_schedule_s=timed["step_s"], waiting_s=timed["waiting_s"],
                collectives={kind: dict(gib=b / GiB, overlapped=hidden / b if b else 0.0,
                                        hidden=timed["hidden"].get(kind))
                             for kind, (b, hidden) in moved.items()})


def one(system: str, flags: str, out: str) -> dict:
    """A row, in a process of its own with its XLA_FLAGS."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # XLA's defaults; jshard adds its own
    if flags == "maxtext":
        env["XLA_FLAGS"] = MAXTEXT_FLAGS
    run = subprocess.run([sys.executable, __file__, "--row", system, flags, "--out", out], env=env,
                         capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{system} with {flags}'s flags failed:\n{run.stderr.strip().splitlines()[-1]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    kinds = [k for k in KINDS if any(k in r["collectives"] for r in rows)]
    head = ("| step, flags | total GiB | temporaries | " + " | ".join(f"{k} GiB (overlapped / hidden)" for k in kinds)
            + " | step along the schedule (waiting) |")
    lines = [head, "|" + "---|" * (4 + len(kinds))]
    for r in rows:
        cells = [f"{c['gib']:.2f} ({c['overlapped']:.0%} / {'-' if c['hidden'] is None else format(c['hidden'], '.0%')})"
                 if (c := r["collectives"].get(k)) else "-" for k in kinds]
        lines.append(f"| {r['system']}, {FLAGS_NAMED[r['flags']]} | {r['total_gib']:.2f} | {r['temporaries_gib']:.2f} | "
                     + " | ".join(cells) + f" | {r['step_along_schedule_s'] * 1e3:.1f} ms ({r['waiting_s'] * 1e3:.1f}) |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--row", nargs=2, metavar=("SYSTEM", "FLAGS"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "out" / "maxtext-side-by-side"), help="work folder")
    parser.add_argument("--json", help="write the rows and the versions to this file")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.row:
        system, flags = args.row
        print(json.dumps(compile_maxtext(args.out) if system == "maxtext" else compile_jshard(args.out)))
        return 0
    rows = []
    for system, flags in ROWS:
        rows.append(dict(system=system, flags=flags, **one(system, flags, args.out)))
        print(f"{system}, {FLAGS_NAMED[flags]}: compiled in {rows[-1]['compile_s']:.0f} s", flush=True)
    print(table(rows))
    if args.json:
        from importlib.metadata import version

        versions = {p: version(p) for p in ("maxtext", "jax", "jaxlib", "flax", "jax-cuda13-plugin")}
        Path(args.json).write_text(json.dumps(dict(target=TARGET, model=MODEL, seq=SEQ, fsdp=FSDP, versions=versions,
                                                   maxtext_flags=MAXTEXT_FLAGS, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
