"""`jshard` command line: one sub-command per job, each registered by the module that owns it.

Each module of this package (`train`, `generate`, `export`, `plan`, `bench`, `pipeline`,
`launch`, `plot`) holds one command's `add_parser` (its flags: `flags.py`, shared by all) and `run`,
which turns the flags into a config and calls the library. Nothing outside this package
imports it.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    # Imported here so `jshard --help` stays fast.
    from jshard.cli import bench, compile, export, generate, launch, pipeline, plan, plot, train

    parser = argparse.ArgumentParser(prog="jshard", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train.add_parser(commands)
    bench.add_parser(commands)
    pipeline.add_parser(commands)
    plan.add_parser(commands)
    compile.add_parser(commands)
    launch.add_parser(commands)
    generate.add_parser(commands)
    export.add_parser(commands)
    plot.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    from jshard.aot import CompileError
    from jshard.cli import flags
    from jshard.app.checkpoint import CheckpointError
    from jshard.collectives import CollectiveError
    from jshard.app.config import FlagError
    from jshard.distributed import DistributedError, initialize, leave, needs_supervisor, supervise
    from jshard.app.generation import GenerateError
    from jshard.app.hf import HFError
    from jshard.mesh import MeshError, check_xla_flags
    from jshard.parallel.schedules import ScheduleError
    from jshard.app.curves import PlotError
    from jshard.rules import ShardingError
    from jshard.app.train_config import TrainError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.command != "launch" and needs_supervisor():  # one process of a multi-process run, no parent yet:
        # its parent prints one line, not JAX's report, if JAX's runtime ends it (a lost host)
        return supervise([sys.executable, "-m", "jshard.cli", *argv], args.command)
    try:
        check_xla_flags()  # before JAX starts: XLA would abort on a flag it cannot read
        if args.command != "launch":  # every process of a multi-process run joins it first
            initialize()
        return int(args.run(args) or 0)
    # Bad input: the message is the help.
    except (MeshError, ShardingError, CollectiveError, ScheduleError, TrainError, CheckpointError,
            DistributedError, FlagError, PlotError, GenerateError, CompileError, HFError) as e:
        print(f"jshard {args.command}: {flags.spoken(str(e))}", file=sys.stderr)
        # At once in a multi-process run (the others may wait in a collective), or after a failed
        # save (its writes would report past the interpreter's shutdown).
        return leave(2, at_once=getattr(e, "abandoned", False))
    except Exception:
        leave(1, traceback=True)  # multi-process: the traceback, then exit 1 at once
        raise

