"""`jshard pipeline show`: a schedule's tick table as text, JSON and a PNG (`jshard.cli.show`)."""

from __future__ import annotations

import argparse

from jshard.cli import flags
from jshard.cli.show import as_json, draw_png, render
from jshard.app.config import write_json
from jshard.parallel import schedules
from jshard.parallel.schedules import make_schedule
from jshard.app.curves import check_output_path


def add_parser(commands) -> None:
    parser = commands.add_parser("pipeline", help="pipeline schedules: show which stage does what at each tick")
    pipeline_commands = parser.add_subparsers(dest="pipeline", required=True)
    show = pipeline_commands.add_parser(
        "show",
        help="print a schedule's stage x tick grid, its bubble next to the formula, and its peak in flight",
        description=schedules.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = show.add_argument
    flags.add_pipeline(show, microbatches=8, schedule="required")
    add("--stages", type=int, default=4, help="pipeline stages p (default: 4)")
    flags.add_json(show, "the grid and its numbers")
    add("--png", metavar="FILE", help="also draw the grid to FILE, a PNG")
    show.set_defaults(run=run_show)


def run_show(args) -> int:
    if args.png:
        check_output_path(args.png)  # refuse before writing anything
    schedule = make_schedule(args.schedule, args.stages, args.microbatches, args.virtual)
    schedule.validate()
    print(render(schedule))
    if args.json:
        write_json(args.json, as_json(schedule))
        print(f"wrote {args.json}")
    if args.png:
        draw_png(schedule, args.png)
        print(f"wrote {args.png}")
    return 0
