"""`jshard bench collectives | strategies | pipeline | step | gpu | kernels | fit | search`: each benchmark's flags, and the call
of its `jshard.bench` module with what they say."""

from __future__ import annotations

import argparse
import inspect
import math
import re

import jax
import numpy as np

import jshard
from jshard.bench import collective_bandwidth, fit, gpu, kernels, ranking, schedule_costs, step_time, strategies
from jshard.cli import flags
from jshard.app.config import FlagError, model_config, write_json
from jshard.mesh import (fake_device_count, mesh_sizes, use_fake_cpu_devices_unless_accelerated, use_gpu_xla_flags,
                         xla_flags_line)
from jshard.metrics import PROFILE_STEPS
from jshard.planner.hardware import HARDWARE, hardware_of
from jshard.parallel.schedules import SCHEDULES


def add_parser(commands) -> None:
    parser = commands.add_parser("bench", help="benchmark collectives and training steps")
    benches = parser.add_subparsers(dest="bench", required=True)
    add_collectives(benches)
    add_strategies(benches)
    add_pipeline(benches)
    add_step(benches)
    add_gpu(benches)
    add_kernels(benches)
    add_fit(benches)
    add_search(benches)


# -- bench collectives ----------------------------------------------------------------------


def add_collectives(benches) -> None:
    parser = benches.add_parser(
        "collectives",
        help="algbw / busbw of each collective over a mesh axis (nccl-tests conventions)",
        description=inspect.cleandoc(collective_bandwidth.run_collectives.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    flags.add_mesh(parser, shown="every device on one axis")
    add("--axis", help="mesh axis to run over, or several joined by commas (one group); default: the axes --mesh names")
    add("--ops", type=_ops, default=tuple(collective_bandwidth.COLLECTIVES),
        help=f"comma-separated, from {','.join(collective_bandwidth.COLLECTIVES)} (default all)")
    add("--sizes", type=_sizes,
        help="comma-separated sizes S in bytes, suffixes K, M, G (powers of 1024); replaces the sweep")
    add("--min-bytes", type=_size, default="1K", help="sweep start (default 1K)")
    add("--max-bytes", type=_size, default="16M", help="sweep end, included (default 16M)")
    add("--factor", type=int, default=4, help="sweep step: each size is this times the last (default 4)")
    add("--dtype", default="float32", choices=("float32", "bfloat16"))
    add("--warmup", type=flags.positive_int, default=2, help="untimed calls before timing; the first compiles (default 2)")
    add("--repeats", type=flags.positive_int, default=10, help="timed calls; the median is reported (default 10)")
    flags.add_json(parser, "the rows, with the set-up,")
    flags.add_fake_devices(parser)
    parser.set_defaults(run=run_collectives)


def _size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", text, re.IGNORECASE)
    if not match or int(match[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes such as 4096, 64K, 1M or 1G")
    return int(match[1]) * 1024 ** " KMG".index(match[2].upper() or " ")


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(_size(part) for part in text.split(",") if part.strip())


def _ops(text: str) -> tuple[str, ...]:
    ops = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [op for op in ops if op not in collective_bandwidth.COLLECTIVES]
    if unknown or not ops:
        raise argparse.ArgumentTypeError(
            f"unknown op(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(collective_bandwidth.COLLECTIVES)}"
        )
    return ops


def run_collectives(args) -> int:
    use_fake_cpu_devices_unless_accelerated(fake_device_count(args.fake_devices, flags.FAKE_DEVICES))
    sizes = args.sizes or collective_bandwidth.sweep(args.min_bytes, args.max_bytes, args.factor)
    result = collective_bandwidth.run_collectives(args.mesh, args.axis, args.ops, sizes, args.dtype, args.warmup, args.repeats)
    write_json(args.json, result)
    return 0


# -- bench strategies -----------------------------------------------------------------------


def add_strategies(benches) -> None:
    parser = benches.add_parser("strategies", help="explicit steps vs textbook bytes, memory, one device and XLA's partitioner")
    add = parser.add_argument
    add("--strategies", help="';'-separated presets, each on its example mesh (plan.validate.EXAMPLE_MESHES, its "
                             "outermost axis taking the devices) or on preset@mesh, e.g. 'dp;zero3@fsdp=8' (default: "
                             "every strategy without a pipeline)")
    flags.add_bench(parser, "small with seq-len 64", batch_size=16)
    flags.add_precision(parser, "fp32")
    flags.add_grad_accum(parser)
    parser.set_defaults(run=run_strategies)


def run_strategies(args) -> int:
    use_fake_cpu_devices_unless_accelerated(fake_device_count(args.fake_devices, flags.FAKE_DEVICES))
    policy = flags.precision_of(args)
    config = flags.built_model(args, "small", {"seq_len": 64})
    rows = strategies.run_strategies(config, policy, args.batch_size, args.repeats, args.strategies, args.grad_accum)
    write_json(args.json, [{key: row[key] for key in strategies.COLUMNS} for row in rows])
    return 0


# -- bench pipeline -------------------------------------------------------------------------


def add_pipeline(benches) -> None:
    parser = benches.add_parser("pipeline", help="pipeline schedules: step time, memory and bubble side by side")
    add = parser.add_argument
    flags.add_mesh(parser, shown="dp+pp's default mesh: stage=2, data the rest")
    add("--schedules", default=",".join(SCHEDULES), help="comma-separated, from: " + ", ".join(SCHEDULES))
    flags.add_pipeline(parser, microbatches=8, schedule="none")
    parser.set_defaults(stage_remat="none")
    flags.add_bench(parser, "small with 8 layers and seq-len 64", batch_size=32)
    parser.set_defaults(run=run_pipeline)


def run_pipeline(args) -> int:
    use_fake_cpu_devices_unless_accelerated(fake_device_count(args.fake_devices, flags.FAKE_DEVICES))
    config = flags.built_model(args, "small", {"layers": 8, "seq_len": 64})  # 8 layers: 4 stages of 2 chunks
    rows = schedule_costs.run_schedules(config, args.mesh, list(filter(None, args.schedules.split(","))), args.microbatches,
                                  args.virtual, args.stage_remat, args.batch_size, args.repeats)
    write_json(args.json, rows)
    return 0


# -- bench step -----------------------------------------------------------------------------


def add_step(benches) -> None:
    parser = benches.add_parser("step", help="jshard's train step vs a plain Flax step, MFU vs the device's peaks")
    add = parser.add_argument
    flags.add_model(parser, None, "tiny on CPU, gpt-1b on GPU", seq_len_help="tokens per row (default: the model's seq_len)")
    add("--batch-size", type=flags.positive_int, help="rows per step (default: 16 on CPU, 8 on GPU)")
    flags.add_grad_accum(parser)  # (the plain step takes the batch whole)
    flags.add_precision(parser, None, "fp32 on CPU, bf16 on GPU")
    flags.add_strategy(parser, "dp")
    flags.add_mesh(parser, shown="the strategy's mesh on one device, so the ratio is pure overhead")
    add("--repeats", type=flags.positive_int, default=10,
        help="timed steps of each, after a warm-up step, alternating; medians reported (default: 10)")
    flags.add_json(parser)
    add("--profile", metavar="DIR", help=f"after timing, write a jax.profiler trace of {PROFILE_STEPS} steps of each to DIR")
    parser.set_defaults(run=run_step)


def _platform_defaults(args, platform: str):
    """(model name, config, seq, batch, precision) from the flags, `bench.step_time.DEFAULTS[platform]` where not given."""
    model, batch, precision = step_time.DEFAULTS["cpu" if platform == "cpu" else "gpu"]
    policy = flags.precision_of(args, precision)
    config = model_config(args.model or model, flags.model_overrides(args))
    seq = args.seq_len or config.seq_len
    batch = args.batch_size or batch
    if seq > config.seq_len:
        raise FlagError(f"--seq-len {seq}: model {args.model or model} takes 1..{config.seq_len} tokens per row")
    return args.model or model, config, seq, batch, policy


def mesh_of(args) -> dict[str, int]:
    return mesh_sizes(args.mesh, jshard.preset(args.strategy), 1)


def run_step(args) -> int:
    # Both before JAX starts: XLA reads its flags, and the CPU its device count, only then.
    added = use_gpu_xla_flags()
    sizes = mesh_of(args)
    if -1 not in sizes.values() and math.prod(sizes.values()) > 1:
        use_fake_cpu_devices_unless_accelerated(math.prod(sizes.values()))
    xla_flags = xla_flags_line() + (f" ({len(added)} of them jshard's)" if added else "")
    result = step_time.measure(sizes, args.strategy, *_platform_defaults(args, jax.devices()[0].platform), args.repeats,
                          args.profile, args.grad_accum)
    print(step_time.report(result, xla_flags))
    write_json(args.json, {key: result[key] for key in step_time.JSON_KEYS})
    return 0


# -- bench gpu ------------------------------------------------------------------------------


def add_gpu(benches) -> None:
    parser = benches.add_parser(
        "gpu", help="jshard on this GPU in one command: bench step per case, the deviceless compile and the plan beside it",
        description=inspect.cleandoc(gpu.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--out", default="out/gpu-check", help="folder for gpu-check.json, the compile logs and the profile "
                                                "(default: out/gpu-check)")
    add("--cases", type=_cases, help=f"comma-separated cases to run (default: all: {', '.join(map(gpu.case_name, gpu.CASES))})")
    add("--repeats", type=flags.positive_int, default=10, help="timed steps of each, alternating (default: 10)")
    add("--profile", default="first", metavar="CASE", help="the case also traced: a case's name, first (the default) "
                                                           "or none")
    add("--dry", action="store_true", help="the same path on this host's JAX with tiny models (a CPU: CI)")
    parser.set_defaults(run=run_gpu)


def _cases(text: str) -> tuple[str, ...]:
    known = {gpu.case_name(c) for c in gpu.CASES}
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(bad) or repr(text)}: not a case; choose from {', '.join(sorted(known))}")
    return names


def run_gpu(args) -> int:
    profile = None if args.profile == "none" else args.profile
    names = args.cases or [gpu.case_name(c) for c in gpu.CASES]
    if profile not in (None, "first") and (args.dry or profile not in names):
        raise FlagError(f"--profile {args.profile}: not a case of this run; choose first, none"
                        + ("" if args.dry else f" or one of {', '.join(names)}"))
    use_gpu_xla_flags()  # before JAX starts, as `bench step`: the flags a jshard run on this GPU has
    if args.dry:
        use_fake_cpu_devices_unless_accelerated(1)  # no GPU: JAX on the CPU, not trying a GPU plugin
    if not args.dry and jax.devices()[0].platform != "gpu":
        raise FlagError(f"JAX runs on {jax.devices()[0].platform}, not a GPU. "
                        "Fix: run it on a GPU machine, or add --dry for the same path with tiny models here.")
    result = gpu.run(args.out, dry=args.dry, cases=args.cases, repeats=args.repeats, profile=profile)
    return 1 if any("error" in r for r in result["cases"]) else 0


# -- bench kernels --------------------------------------------------------------------------


def add_kernels(benches) -> None:
    parser = benches.add_parser(
        "kernels", help="what this device's kernels cost by shape: GEMMs in bf16 and FP8, a launch, a loop, HBM, attention",
        description=inspect.cleandoc(kernels.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--deadline", type=flags.positive_int, default=300, metavar="S",
        help="stop starting GEMM shapes after S seconds; the result names those not reached (default: 300)")
    add("--dry", action="store_true", help="the same path on this host's JAX with tiny shapes (a CPU: CI)")
    flags.add_json(parser)
    parser.set_defaults(run=run_kernels)


def run_kernels(args) -> int:
    use_gpu_xla_flags()  # the flags a jshard step on this GPU compiles with
    if not args.dry and jax.devices()[0].platform != "gpu":
        raise FlagError(f"JAX runs on {jax.devices()[0].platform}, not a GPU. "
                        "Fix: run it on a GPU machine, or add --dry for the same path with tiny shapes here.")
    result = kernels.run(dry=args.dry, deadline_s=args.deadline,
                         on_row=lambda partial: write_json(args.json, partial | dict(seconds=None)))
    print(kernels.report(result))
    write_json(args.json, result)
    return 0


# -- bench fit ------------------------------------------------------------------------------


def add_fit(benches) -> None:
    parser = benches.add_parser("fit", help="the planner's fitted GPU constants from measured steps, each step left out; "
                                "or the CPU profile's host constants from a bench search",
                                description=inspect.cleandoc(fit.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", metavar="RUNS.json", help="measured steps: {\"runs\": [{\"plan_command\", \"result\": {\"step_s\"}}]}, "
                                                          "e.g. docs/results/bench-step-h100-jax0.11.2-2026-11-27.json; or a "
                                                          "`bench search --json` result: the CPU profile's host constants (bench.fit.HOST_FIELDS)")
    parser.add_argument("--check", nargs="+", metavar="SEARCH.json", default=[],
                        help="with a bench search result: rank these other bench search results with the constants "
                             "fitted (Spearman against measured, the pick over the measured best)")
    parser.set_defaults(run=run_fit)


def measured_plans(path: str) -> tuple[list[str], list, "np.ndarray"]:
    """(names, `PlanInput`s, measured step seconds) of a results file's runs, each plan from its
    `plan_command` as `jshard plan` reads it."""
    import json
    import shlex


    from jshard.cli import plan as plan_command

    try:
        with open(path) as f:
            runs = json.load(f)["runs"]
    except (OSError, ValueError, KeyError) as e:
        raise FlagError(f"{path}: not a results file with runs ({type(e).__name__}: {e}). Fix: give a bench step "
                        "results file, e.g. docs/results/bench-step-h100-jax0.11.2-2026-11-27.json") from None
    parser = argparse.ArgumentParser(prog="jshard")
    plan_command.add_parser(parser.add_subparsers())
    plans = [plan_command.plan_input(parser.parse_args(shlex.split(r["plan_command"])[1:])) for r in runs]
    names = [r["command"].removeprefix("jshard bench step ") for r in runs]
    return names, plans, np.array([r["result"]["step_s"] for r in runs])


def load_results(path: str, example: str) -> dict:
    import json

    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise FlagError(f"{path}: not a results file ({type(e).__name__}: {e}). Fix: give {example}") from None


def is_search(result) -> bool:
    """A `jshard bench search --json` result (its measured layouts' rows), not a bench step file."""
    return isinstance(result, dict) and "rows" in result


def run_fit(args) -> int:
    import dataclasses

    result = load_results(args.runs, "a bench step or bench search results file, e.g. "
                                 "docs/results/bench-step-h100-jax0.11.2-2026-11-27.json")
    searches = {path: load_results(path, "--check a bench search --json result") for path in args.check}
    if not is_search(result) and searches:
        raise FlagError(f"--check ranks bench search results with constants fitted to one; {args.runs} is not one. "
                        "Fix: give a bench search --json result first")
    for path, other in searches.items():
        if not (is_search(other) and other.get("profile") == result["profile"]):
            raise FlagError(f"--check {path}: not a bench search result of the {result['profile']} profile. "
                            f"Fix: give results of jshard bench search on the same devices")
    if is_search(result):  # the CPU profile's host constants
        hw = HARDWARE[result["profile"]]
        fitted = fit.fit_host(ranking.plans_of(result, hw), np.array([r["measured_s"] for r in result["rows"]]))
        print(f"# fitted over {len(result['rows'])} layouts of {args.runs}: "
              + ", ".join(f"{k} = {v:.3g}" for k, v in fitted.items()))
        for path, other in searches.items():
            spearman, pick = ranking.rank_again(other, dataclasses.replace(hw, **fitted))
            print(f"{path}: {len(other['rows'])} layouts, Spearman {spearman:.3f}, the pick {pick:.2f} x the measured best")
        return 0
    print(fit.report(*measured_plans(args.runs)))
    return 0


# -- bench search ---------------------------------------------------------------------------


def add_search(benches) -> None:
    parser = benches.add_parser("search", help="the planner's ranking of layouts against the same layouts measured",
                                description=inspect.cleandoc(ranking.__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    flags.add_model(parser, "small", seq_len_help="tokens per row, and the model's longest (default: the model's)")
    add("--batch-size", type=flags.positive_int, default=32, help="rows a step (default: 32)")
    flags.add_precision(parser, "fp32")
    add("--count", type=flags.positive_int, default=12, help="layouts measured, spread over the ranking (default: 12)")
    add("--seed", type=flags.nonnegative_int, help="take the --count layouts at random instead, drawn with this seed (the "
        "constants' fit: `bench fit`)")
    add("--repeats", type=flags.positive_int, default=3, help="timed steps of a layout a round; the fastest is kept "
        "(default: 3)")
    add("--rounds", type=flags.positive_int, default=3, help="rounds, each timing every layout in turn; a layout's "
        "time is the median of its rounds' (default: 3)")
    flags.add_json(parser)
    flags.add_fake_devices(parser)
    parser.set_defaults(run=run_search)


def run_search(args) -> int:
    use_gpu_xla_flags()
    use_fake_cpu_devices_unless_accelerated(fake_device_count(args.fake_devices, flags.FAKE_DEVICES))
    hw = hardware_of(jax.devices()[0])
    if hw is None:
        raise FlagError(f"the planner has no profile of a {jax.devices()[0].device_kind}: nothing to rank against")
    config = flags.built_model(args, "small")
    flags.precision_of(args)  # (its one line, for a reduction without a precision)
    result = ranking.run(config, hw, args.batch_size, args.precision, args.grad_reduce, args.count, args.repeats,
                         args.rounds, args.seed)
    write_json(args.json, result)
    return 0
