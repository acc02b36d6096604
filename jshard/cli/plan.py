"""`jshard plan`: its flags (the shared ones, a hardware profile and its overrides, `--validate`,
`--png`) and a `PlanInput` from them; the estimate, its validation and its picture are
`jshard.planner`'s."""

from __future__ import annotations

import argparse
import dataclasses

from jshard import aot
from jshard.cli import flags
from jshard.app.config import FlagError, write_json
from jshard.mesh import fake_device_count, mesh_sizes, use_fake_cpu_devices, use_gpu_xla_flags
from jshard.planner.estimate import PlanInput, estimate
from jshard.planner.hardware import GiB, HARDWARE, Hardware
from jshard.planner.memory_chart import memory_png
from jshard.planner.report_text import report
from jshard.planner.search import bottleneck, pick, search, table
from jshard.planner.validate import (MEMORY_TOLERANCE, format_validation, validate_one, validation_cases, validation_models,
                                  within_tolerance)
from jshard.app.curves import check_output_path
from jshard.rules import preset
from jshard.app.train_config import AUTO, SEQ_LEN, TrainConfig

HARDWARE_FLAGS = (  # flag, Hardware field, unit
    ("--peak-tflops", "peak_flops", 1e12), ("--hbm-gib", "hbm_bytes", GiB), ("--hbm-bw-gbs", "hbm_bw", 1e9),
    ("--intra-bw-gbs", "intra_bw", 1e9), ("--inter-bw-gbs", "inter_bw", 1e9), ("--gpus-per-node", "gpus_per_node", 1),
)


# Where plan's defaults differ from `jshard train`'s: a plan is for the GPUs a run is bound for
# (--hardware), train's defaults for a first run on this machine's CPU devices. The set-up says
# which differ (`defaults_line`).
DEFAULTS = dict(strategy="dp", precision="bf16")


def add_parser(commands) -> None:
    parser = commands.add_parser("plan", help="memory, communication and overlap estimates; --validate checks them against XLA")
    add = parser.add_argument
    flags.add_model(parser, None, "small", seq_len_help="tokens per row, and the model's longest (default: the model's)")
    flags.add_strategy(parser, DEFAULTS["strategy"], auto=True)
    flags.add_mesh(parser, shown="the strategy's axes over --devices: each inner one 2, the outermost the rest")
    add("--devices", type=flags.positive_int, default=8, help="devices to plan for when --mesh is not given (default: 8)")
    flags.add_pipeline(parser)
    flags.add_batch(parser)
    flags.add_grad_accum(parser)
    flags.add_precision(parser, DEFAULTS["precision"])
    flags.add_remat(parser)
    add("--hardware", choices=HARDWARE, default="h100", help="device profile (default: h100)")
    for flag, field, unit in HARDWARE_FLAGS:
        add(flag, dest=field, type=float if field != "gpus_per_node" else int,
            help=f"override the profile's {field}" + (f" (in {flag.rsplit('-', 1)[-1]})" if unit > 1 else ""))
    flags.add_json(parser, "the estimate (or the validation rows)")
    add("--png", metavar="FILE", help="also draw the memory per device to FILE, a PNG: a bar of its kinds against the HBM "
        "(a pipeline: one per --stage-remat)")
    add("--validate", action="store_true",
        help="build small steps on --fake-devices CPU devices and compare with XLA (ignores the model flags)")
    add("--target", choices=aot.TARGETS, help="with --validate: compile every step for these GPUs with XLA:GPU, on "
        "this machine (no GPU needed; `jshard compile`), instead of for the CPU; the models 4 times as wide and "
        "long, twice as deep (plan.validate.GPU_VALIDATION_SCALE, GPU_VALIDATION_DEPTH)")
    add("--search", action="store_true",
        help="rank every layout of the model over --devices (strategies, meshes, remat, micro-batches, schedules, "
             "accumulation) by predicted step time for --batch-size rows a step (default: 4 a device); no --mesh")
    add("--top", type=flags.positive_int, default=10, help="with --search: the layouts shown (default: 10)")
    add("--compile", type=flags.positive_int, metavar="N", help="with --search: also compile the first N layouts that fit "
        "for these GPUs with XLA:GPU here, no GPU needed (`jshard compile`; --devices and --hardware must be a "
        "target's: h100 or h200 on 1, 8 or 16), to confirm their memory and bytes")
    flags.add_layout(parser)
    flags.add_fake_devices(parser)
    parser.set_defaults(run=run)


def plan_input(args, hw: Hardware | None = None, devices: int | None = None) -> PlanInput:
    """The planner's input from the shared flags, on `hw` (default: --hardware and its overrides)
    and `devices` (default: --devices) where --mesh is not given."""
    flags.precision_of(args)  # (its one line, for a reduction without a precision)
    config = flags.built_model(args, "small", remat=args.remat)
    hw = hw or dataclasses.replace(HARDWARE[args.hardware], **{field: getattr(args, field) * unit
                                                                for _, field, unit in HARDWARE_FLAGS
                                                                if getattr(args, field) is not None})
    sizes = mesh_sizes(args.mesh, preset(args.strategy), devices or args.devices)
    return PlanInput(config, flags.layout_of(args, sizes), hw, args.batch_size)


def confirm(candidates, target) -> None:
    """Each layout compiled for `target`'s GPUs (`aot.compile_step`): its memory and collective
    bytes beside the plan's, and its step timed along its own schedule (`planner.schedule`), a
    line each."""
    import optax
    from flax import nnx

    from jshard.models import decoder, gpt_loss
    from jshard.planner.schedule import timeline

    print(f"compiled for {target.name} by XLA:GPU here (no GPU):")
    for i, c in enumerate(candidates, 1):
        p, est = c.plan, c.estimate
        rows = est["tokens_per_step"] // p.config.seq_len
        program = aot.compile_step(nnx.eval_shape(lambda: decoder(p.model, nnx.Rngs(0))), optax.adamw(1e-4), gpt_loss,
                                   p.layout, target, (rows, p.config.seq_len + 1))
        vs, along = aot.compared(program, est), timeline(program.hlo, program.mesh, HARDWARE[target.hardware], program.ticks)
        print(f"{i:>3}  {c.label:<72} {program.memory['total'] / GiB:>6.1f} GiB compiled (plan {vs['memory_rel_err']:+.1%}), "
              f"{'fits' if program.fits else 'DOES NOT FIT'}; collective bytes "
              f"{'equal to the plan' if vs['bytes_exact'] else 'NOT equal to the plan'}; step along its schedule "
              f"{along.seconds * 1e3:.2f} ms (plan {est['predicted_step_s'] * 1e3:.2f}), "
              f"{(along.seconds - along.compute) * 1e3:.2f} of them waiting on collectives")


def auto_layout(args, hw: Hardware, devices: int) -> tuple[argparse.Namespace, str]:
    """`--strategy auto`: the flags with the search's best layout that fits (`plan.search`, the
    run's `--remat` kept), and a line saying what was picked."""
    given = [f for f, v in (("--mesh", args.mesh), ("--schedule", args.schedule), ("--microbatches", args.microbatches),
                            ("--virtual", args.virtual), ("--micro-batch-size", args.micro_batch_size)) if v]
    if given or args.grad_accum != 1:
        flag = given[0] if given else "--grad-accum"
        raise FlagError(f"--strategy auto chooses the layout, but {flag} fixes part of it. "
                        f"Fix: drop {flag}, or name a strategy (e.g. --strategy dp+tp).")
    base = plan_input(argparse.Namespace(**vars(args) | dict(strategy="dp", mesh=None)), hw, devices)
    best, line = pick(base.config, devices, hw, args.batch_size or 4 * devices, base.layout.precision,
                      base.layout.reduce, base.layout.remat)
    chosen = argparse.Namespace(**vars(args) | {dest: getattr(best.layout, field)
                                                 for field, dest in flags.LAYOUT_DESTS.items()} | dict(batch_size=None))
    return chosen, f"  auto        {line}"


def run_search(args) -> int:
    """`--search`: the ranked table (`plan.search`), or one line saying why nothing is left."""
    given = [f for f, v in (("--mesh", args.mesh), ("--schedule", args.schedule), ("--micro-batch-size",
             args.micro_batch_size), ("--validate", args.validate)) if v]
    if given:
        raise FlagError(f"--search chooses the layout itself; {given[0]} fixes part of it. "
                        f"Fix: drop {given[0]}, or drop --search to plan that one layout.")
    base = plan_input(argparse.Namespace(**vars(args) | dict(strategy="dp", mesh=None)), devices=args.devices)
    hw = base.hardware
    target = None
    if args.compile:  # before JAX starts: XLA's GPU flags, and JAX itself on the CPU
        target = next((t for t in aot.TARGETS.values() if t.hardware == hw.name and t.devices == args.devices), None)
        if target is None:
            raise FlagError(f"--compile: no compile target of {args.devices} × {hw.name} "
                            f"(targets: {', '.join(aot.TARGETS)}). Fix: --devices and --hardware of one, or drop --compile.")
        if reason := aot.gpu_compiler_missing():
            raise aot.CompileError(reason)
        use_gpu_xla_flags(compiling_for_gpu=True)
        aot.use_cpu_for_jax()
    if args.devices > hw.gpus_per_node and args.devices % hw.gpus_per_node:
        raise FlagError(f"--devices {args.devices} is not a whole number of {hw.gpus_per_node}-GPU nodes. "
                        f"Fix: --devices a multiple of {hw.gpus_per_node}, or --gpus-per-node to match.")
    rows = args.batch_size or 4 * args.devices
    found = search(base.config, args.devices, hw, rows, base.layout.precision, base.layout.reduce)
    estimated = [c for c in found if c.estimate]
    if not estimated:
        raise FlagError(f"--search: no layout of {args.devices} devices is left for this model and {rows} rows a step "
                        "(each refused: stages or tensor not dividing the layers or heads, rows not dividing over the "
                        "data shards). Fix: another --batch-size or --devices.")
    if not estimated[0].estimate["fits"]:
        least = min(estimated, key=lambda c: c.estimate["memory_bytes_per_device"]["total"])
        raise FlagError(f"--search: no layout fits in {hw.hbm_bytes / GiB:.0f} GiB a device; the smallest, "
                        f"{least.label}, needs {least.estimate['memory_bytes_per_device']['total'] / GiB:.1f} GiB. "
                        "Fix: more --devices, a shorter --seq-len or a smaller --batch-size.")
    fits = sum(1 for c in estimated if c.estimate["fits"])
    print(f"jshard plan --search: {base.config.family} {base.config.layers} layers, embed {base.config.embed}, seq "
          f"{base.config.seq_len}, {rows} rows a step on {args.devices} x {hw.name} ({hw.gpus_per_node} a node): "
          f"{len(found)} layouts, {len(found) - len(estimated)} refused, {fits} fit")
    print(table(found, args.top))
    if target:
        confirm([c for c in estimated if c.estimate["fits"]][:args.compile], target)
    write_json(args.json, [dict(layout=c.label, **{k: c.estimate[k] for k in (
        "strategy", "mesh", "micro_batch_size", "microbatches", "schedule", "predicted_step_s", "predicted_mfu",
        "fits", "compute_terms")}, memory_bytes=c.estimate["memory_bytes_per_device"]["total"],
        bottleneck=bottleneck(c.estimate)) for c in estimated])
    return 0


def run(args) -> int:
    args = flags.with_layout(args)
    if args.search:
        return run_search(args)
    if args.png:  # refuse before any work
        if args.validate:
            raise FlagError("--png draws a plan's memory; --validate has no plan to draw: give one or the other")
        check_output_path(args.png)
    if args.target and not args.validate:
        raise FlagError("--target compiles the validation steps for GPUs: give --validate too "
                        "(one plan's program for a target: jshard compile)")
    if args.validate:
        devices, hardware, models = None, "cpu", validation_models("cpu")
        if args.target:
            use_gpu_xla_flags(compiling_for_gpu=True)
            target = aot.target(args.target)
            devices, hardware, models = aot.target_devices(target), target.hardware, validation_models("gpu")
        else:
            use_fake_cpu_devices(fake_device_count(args.fake_devices, flags.FAKE_DEVICES))
        results = []
        print(format_validation([]))
        for case, model in validation_cases():
            results.append(validate_one(*case, model=models[model], devices=devices, hardware=hardware))
            print(format_validation(results[-1:]).splitlines()[1], flush=True)
        write_json(args.json, results)
        ok = all(map(within_tolerance, results))
        print(f"{'all' if ok else 'NOT all'} within {MEMORY_TOLERANCE:.0%} of compiled memory with exact collective bytes")
        return 0 if ok else 1
    picked = None
    if args.strategy == AUTO:
        args, picked = auto_layout(args, plan_input(argparse.Namespace(**vars(args) | dict(
            strategy="dp", mesh=None, schedule=None, microbatches=None, virtual=None))).hardware, args.devices)
    est = estimate(plan_input(args))
    lines = report(est).splitlines()
    if picked:
        lines.insert(4, picked)
    if line := defaults_line(args, est):
        lines.insert(4, line)  # after the set-up's strategy line
    print("\n".join(lines))
    write_json(args.json, est)
    if args.png:
        memory_png(est, args.png)
        print(f"wrote {args.png}")
    return 0


def defaults_line(args, est: dict) -> str | None:
    """One set-up line naming plan's defaults in force that differ from `jshard train`'s (None
    where none do), and why they differ."""
    train = TrainConfig()
    rows = est["tokens_per_step"] // est["model"]["seq_len"]
    differ = [f"{what} {mine} (train: {theirs})" for what, mine, theirs, in_force in (
        ("strategy", args.strategy, train.layout.strategy, args.strategy == DEFAULTS["strategy"]),
        ("precision", args.precision, train.layout.precision, args.precision == DEFAULTS["precision"]),
        ("seq", est["model"]["seq_len"], f"{SEQ_LEN} or the model's if shorter", args.seq_len is None),
        ("batch", f"{rows} rows", train.data.batch_size, args.batch_size is None and args.micro_batch_size is None),
    ) if in_force and str(mine) != str(theirs)]
    if not differ:
        return None
    return (f"  defaults    {', '.join(differ)}: plan's are for the GPUs a run is bound for (--hardware), "
            "train's for a first run on this machine")
