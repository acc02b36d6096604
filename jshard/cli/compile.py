"""`jshard compile`: a step compiled for GPUs on this machine, with none (`jshard.aot`), printed
beside `jshard plan`'s estimate for the same flags."""

from __future__ import annotations

import math

import optax
from flax import nnx

from jshard import aot
from jshard.cli import flags
from jshard.cli.plan import auto_layout, plan_input
from jshard.app.config import FlagError, write_json
from jshard.mesh import use_gpu_xla_flags, xla_flags_line, xla_options_line
from jshard.models import decoder, gpt_loss
from jshard.planner.estimate import estimate
from jshard.planner.hardware import HARDWARE
from jshard.planner.report_text import report
from jshard.planner.schedule import timeline
from jshard.app.train_config import AUTO


def add_parser(commands) -> None:
    parser = commands.add_parser("compile", help="compile the step for GPUs with XLA:GPU on this machine (no GPU needed) "
                                                 "and compare it with the plan")
    add = parser.add_argument
    flags.add_model(parser, None, "small", seq_len_help="tokens per row, and the model's longest (default: the model's)")
    flags.add_strategy(parser, "dp", auto=True)
    flags.add_mesh(parser, shown="the strategy's axes over the target's devices: each inner one 2, the outermost the rest")
    flags.add_pipeline(parser)
    flags.add_batch(parser)
    flags.add_grad_accum(parser)
    flags.add_precision(parser, "mixed")
    flags.add_remat(parser)
    add("--target", choices=aot.TARGETS, default="h100x8", help="GPUs to compile for, hosts of 8 (default: h100x8)")
    add("--hlo", metavar="FILE", help="also write the optimized GPU HLO to FILE")
    flags.add_layout(parser)
    flags.add_json(parser, "the plan, the compiled program's figures and their comparison")
    parser.set_defaults(run=run)


def run(args) -> int:
    args = flags.with_layout(args)
    target = aot.target(args.target)
    if reason := aot.gpu_compiler_missing():  # before planning: the one thing to fix
        raise aot.CompileError(reason)
    use_gpu_xla_flags(compiling_for_gpu=True)  # the program a jshard run on those GPUs would compile
    aot.use_cpu_for_jax()
    picked = None
    if args.strategy == AUTO:  # the search's pick for the target's devices, then compiled to confirm it
        args, picked = auto_layout(args, HARDWARE[target.hardware], target.devices)
    planned = plan_input(args, HARDWARE[target.hardware], target.devices)
    est = estimate(planned)
    if (n := math.prod(est["mesh"].values())) != target.devices:
        raise FlagError(f"--mesh {args.mesh}: {n} devices, but --target {target.name} has {target.devices}. "
                        f"Fix: sizes whose product is {target.devices}, or another --target.")
    print(report(est) if not picked else "\n".join((lines := report(est).splitlines())[:4] + [picked] + lines[4:]))
    config = planned.model
    model = nnx.eval_shape(lambda: decoder(config, nnx.Rngs(0)))
    rows = est["tokens_per_step"] // config.seq_len  # (the plan's: every accumulated micro-batch's rows)
    program = aot.compile_step(model, optax.adamw(1e-4), gpt_loss, planned.layout, target, (rows, config.seq_len + 1))
    devices = f"{target.hosts} × {target.per_host} × {HARDWARE[target.hardware].name.upper()}"
    along = timeline(program.hlo, program.mesh, HARDWARE[target.hardware], program.ticks)
    print(aot.report(program, est, devices, along))
    print(f"XLA_FLAGS in effect: {xla_flags_line()}; this program's own options: {xla_options_line(program.xla_options)}")
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(program.hlo)
        print(f"wrote {args.hlo}")
    write_json(args.json, dict(plan=est, compiled=program.as_json() | dict(timeline=along.as_json()),
                               compared=aot.compared(program, est)))
    return 0

