"""Benchmarks: `jshard bench <what>`, one module per benchmark.

Each module's `add_parser(benches)` registers its sub-command with `set_defaults(run=...)`;
`jshard.cli` calls `run` with the parsed arguments.
"""

from jshard.bench import collectives, pipeline, step, strategies


def add_parser(commands) -> None:
    parser = commands.add_parser("bench", help="benchmark collectives and training steps")
    benches = parser.add_subparsers(dest="bench", required=True)
    collectives.add_parser(benches)
    strategies.add_parser(benches)
    pipeline.add_parser(benches)
    step.add_parser(benches)
