"""`jshard pipeline show`: a schedule's tick table as text, JSON and a PNG.

    $ jshard pipeline show --schedule 1f1b --stages 4 --microbatches 8 [--json F] [--png F]

The tables themselves, and what they mean, are `schedules.py`'s; this module only shows them.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from jshard import flags
from jshard.parallel import schedules
from jshard.parallel.schedules import Schedule, make_schedule


def summary(schedule: Schedule) -> str:
    s = schedule
    per_stage = " ".join(str(s.peak_in_flight(stage)) for stage in range(s.stages))
    return (
        f"{s.name}: p={s.stages} stages, m={s.microbatches} micro-batches, v={s.virtual}, {s.ticks} ticks\n"
        f"bubble {s.bubble_fraction:.4f} of ideal (formula {s.formula} = {s.formula_bubble_fraction:.4f}), "
        f"{s.bubble_fraction_of_step:.1%} of the step idle; peak in flight {s.peak_in_flight()} "
        f"(stage 0..{s.stages - 1}: {per_stage})"
    )


def render(schedule: Schedule) -> str:
    """The summary, then the stage x tick grid: one row per stage, columns aligned, "." idle."""
    grid = schedule.grid()
    width = max(len(str(schedule.ticks - 1)), *(len(cell) for row in grid for cell in row))
    name_width = len(f"stage {schedule.stages - 1}")

    def line(name: str, cells) -> str:
        return " ".join([name.ljust(name_width)] + [cell.ljust(width) for cell in cells]).rstrip()

    lines = [summary(schedule), line("tick", (str(t) for t in range(schedule.ticks)))]
    lines += [line(f"stage {stage}", row) for stage, row in enumerate(grid)]
    return "\n".join(lines)


def as_json(schedule: Schedule) -> dict:
    s = schedule
    return {
        "schedule": s.name,
        "stages": s.stages,
        "microbatches": s.microbatches,
        "virtual": s.virtual,
        "ticks": s.ticks,
        "bubble_fraction": s.bubble_fraction,
        "formula_bubble_fraction": s.formula_bubble_fraction,
        "bubble_fraction_of_step": s.bubble_fraction_of_step,
        "peak_in_flight": s.peak_in_flight(),
        "peak_in_flight_per_stage": [s.peak_in_flight(stage) for stage in range(s.stages)],
        "grid": s.grid(),
    }


KIND_COLOURS = {"F": "#4c72b0", "BW": "#c44e52", "B": "#dd8452", "W": "#55a868"}


def draw_png(schedule: Schedule, path: str) -> None:
    """The grid as coloured boxes, one row per stage (needs matplotlib)."""
    from matplotlib.figure import Figure  # Figure, not pyplot: no GUI backend is involved
    from matplotlib.patches import Rectangle

    figure = Figure(figsize=(max(6.0, 0.42 * schedule.ticks), 0.55 * schedule.stages + 1.6))
    axes = figure.add_subplot()
    for tick, row in enumerate(schedule.table()):
        for stage, action in enumerate(row):
            if action is not None:
                axes.add_patch(Rectangle((tick, stage), 1, 1, facecolor=KIND_COLOURS[action.kind], edgecolor="white"))
                label = action.label(chunked=schedule.virtual > 1)
                axes.text(tick + 0.5, stage + 0.5, label, ha="center", va="center", fontsize=6, color="white")
    axes.set_xlim(0, schedule.ticks)
    axes.set_ylim(schedule.stages, 0)
    axes.set_yticks([stage + 0.5 for stage in range(schedule.stages)], [f"stage {s}" for s in range(schedule.stages)])
    axes.set_xlabel("tick")
    axes.set_title(summary(schedule), fontsize=8, loc="left")
    figure.savefig(path, dpi=150, bbox_inches="tight")


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
    add("--png", metavar="FILE", help="also draw the grid to FILE (needs matplotlib: pip install 'jshard[plot]')")
    show.set_defaults(run=run_show)


def run_show(args) -> int:
    if args.png and importlib.util.find_spec("matplotlib") is None:  # refuse before doing anything
        print("jshard pipeline show: --png needs matplotlib, an optional extra: pip install 'jshard[plot]'", file=sys.stderr)
        return 2
    schedule = make_schedule(args.schedule, args.stages, args.microbatches, args.virtual)
    schedule.validate()
    print(render(schedule))
    if args.json:
        flags.write_json(args.json, as_json(schedule))
        print(f"wrote {args.json}")
    if args.png:
        draw_png(schedule, args.png)
        print(f"wrote {args.png}")
    return 0
