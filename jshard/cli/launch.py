"""`jshard launch`: N local processes of one multi-process run; the launcher is `jshard.distributed`'s."""

from __future__ import annotations

import argparse

from jshard import distributed


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "launch", help="run a command as N processes of one multi-process JAX run on this machine",
        description=distributed.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="jshard launch -n N [--devices-per-process K] -- COMMAND...",
    )
    parser.add_argument("-n", "--processes", type=int, required=True, help="number of processes")
    parser.add_argument("--devices-per-process", type=int, default=None, metavar="K",
                        help="fake CPU devices per process (default: 8 // N, at least 1)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="COMMAND",
                        help="the command each process runs, after `--`; `jshard ...` runs with this Python")
    parser.set_defaults(run=run)


def run(args) -> int:
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return distributed.launch(command, args.processes, args.devices_per_process)
