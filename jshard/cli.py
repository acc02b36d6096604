"""`jshard` command line: one sub-command per job, each registered by the module that owns it."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    # Imported here so `jshard --help` stays fast and each module owns its own flags.
    from jshard import bench, train
    from jshard.parallel import schedules

    parser = argparse.ArgumentParser(prog="jshard", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train.add_parser(commands)
    bench.add_parser(commands)
    schedules.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    from jshard.checkpoint import CheckpointError
    from jshard.collectives import CollectiveError
    from jshard.mesh import MeshError
    from jshard.parallel.schedules import ScheduleError
    from jshard.rules import ShardingError
    from jshard.train import TrainError

    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    # Bad input: the message is the help.
    except (MeshError, ShardingError, CollectiveError, ScheduleError, TrainError, CheckpointError) as e:
        print(f"jshard {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
