"""`jshard plan`: will this fit, and will communication hide behind compute? Answered before
any device work, from the formulas in ../shared/SPEC.md, and checked against XLA.

    estimate.py   the formulas: memory, communication and time per device, from the step's
                  own layout table on an abstract mesh (no devices)
    validate.py   the same estimate for small steps built on fake CPU devices, against
                  `compiled.memory_analysis()` and the compiled HLO's collective bytes

This module is the command line: the shared flags (`jshard.flags`), a hardware profile and
its overrides, and `--validate`.
"""

from __future__ import annotations

import dataclasses

from jshard import flags
from jshard.mesh import STANDARD_AXES, use_fake_cpu_devices
from jshard.plan.estimate import (GiB, HARDWARE, Hardware, PlanInput, estimate, layout_table_of, report, sends,
                                  state_bytes, traffic)
from jshard.plan.validate import (MEMORY_TOLERANCE, VALIDATION, VALIDATION_MODELS, format_validation, validate_one,
                                  within_tolerance)
from jshard.rules import ShardingError, preset

__all__ = ["HARDWARE", "MEMORY_TOLERANCE", "VALIDATION", "VALIDATION_MODELS", "Hardware", "PlanInput", "add_parser", "estimate",
           "format_validation", "layout_table_of", "report", "sends", "state_bytes", "traffic", "validate_one"]

HARDWARE_FLAGS = (  # flag, Hardware field, unit
    ("--peak-tflops", "peak_flops", 1e12), ("--hbm-gib", "hbm_bytes", GiB), ("--hbm-bw-gbs", "hbm_bw", 1e9),
    ("--intra-bw-gbs", "intra_bw", 1e9), ("--inter-bw-gbs", "inter_bw", 1e9), ("--gpus-per-node", "gpus_per_node", 1),
)


def add_parser(commands) -> None:
    parser = commands.add_parser("plan", help="memory, communication and overlap estimates; --validate checks them against XLA")
    add = parser.add_argument
    flags.add_model(parser, None, "small", seq_len_help="tokens per row, and the model's longest (default: the model's)")
    flags.add_strategy(parser, "dp")
    flags.add_mesh(parser, shown="the strategy's axes over --devices: each inner one 2, the outermost the rest")
    add("--devices", type=flags.positive_int, default=8, help="devices to plan for when --mesh is not given (default: 8)")
    flags.add_pipeline(parser)
    add("--micro-batch-size", type=flags.positive_int, default=1, help="rows per micro-batch per data shard (default: 1)")
    flags.add_precision(parser, "bf16")
    flags.add_remat(parser)
    add("--hardware", choices=HARDWARE, default="h100", help="device profile (default: h100)")
    for flag, field, unit in HARDWARE_FLAGS:
        add(flag, dest=field, type=float if field != "gpus_per_node" else int,
            help=f"override the profile's {field}" + (f" (in {flag.rsplit('-', 1)[-1]})" if unit > 1 else ""))
    flags.add_json(parser, "the estimate (or the validation rows)")
    add("--validate", action="store_true",
        help="build small steps on --fake-devices CPU devices and compare with XLA (ignores the model flags)")
    flags.add_fake_devices(parser)
    parser.set_defaults(run=run)


def plan_input(args) -> PlanInput:
    policy = flags.precision_of(args)
    config = flags.built_model(args, "small", dtype=policy.compute, remat=args.remat)
    hw = dataclasses.replace(HARDWARE[args.hardware], **{field: getattr(args, field) * unit
                                                          for _, field, unit in HARDWARE_FLAGS
                                                          if getattr(args, field) is not None})
    sizes = {a: 1 for a in STANDARD_AXES} | flags.mesh_sizes(args.mesh, preset(args.strategy), args.devices)
    if -1 in sizes.values():
        raise ShardingError(f"--mesh {args.mesh}: give every size; the planner has no devices to fill '-1' from")
    return PlanInput(config, sizes, args.strategy, args.schedule, args.microbatches, args.virtual,
                     args.micro_batch_size, hw, policy, args.stage_remat)


def run(args) -> int:
    if args.validate:
        use_fake_cpu_devices(args.fake_devices)
        results = []
        print(format_validation([]))
        for case, model in ((case, model) for model in VALIDATION_MODELS.values() for case in VALIDATION):
            results.append(validate_one(*case, model=model))
            print(format_validation(results[-1:]).splitlines()[1], flush=True)
        flags.write_json(args.json, results)
        ok = all(map(within_tolerance, results))
        print(f"{'all' if ok else 'NOT all'} within {MEMORY_TOLERANCE:.0%} of compiled memory with exact collective bytes")
        return 0 if ok else 1
    est = estimate(plan_input(args))
    print(report(est))
    flags.write_json(args.json, est)
    return 0
