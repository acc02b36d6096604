"""A schedule's tick table as text (`render`), JSON (`as_json`) and a PNG (`draw_png`): what
`jshard pipeline show` prints and writes (`jshard.cli.pipeline`).

    $ jshard pipeline show --schedule 1f1b --stages 4 --microbatches 8 [--json F] [--png F]

The tables themselves, and what they mean, are `jshard.parallel.schedules`'s; this module only
shows them.
"""

from __future__ import annotations

import math

from jshard.parallel.schedules import Schedule


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
KIND_NAMES = {"F": "F: forward", "BW": "BW: full backward", "B": "B: input-gradient backward",
              "W": "W: weight-gradient backward"}
IDLE_COLOUR = "#eeeeee"  # the axes' background: every cell without an action reads as idle
DPI = 150
MAX_WIDTH = 20.0  # inches: a long schedule gets narrower cells, not an endless picture
LABEL_CELL = 0.3  # inches: narrower cells go unlabelled, the colours still say what runs


def draw_png(schedule: Schedule, path: str):
    """The grid as coloured boxes, one row per stage, a legend of the kinds of action; returns the Figure."""
    from matplotlib.figure import Figure  # Figure, not pyplot: no GUI backend is involved
    from matplotlib.patches import Patch

    width = min(max(7.5, 0.42 * schedule.ticks), MAX_WIDTH)  # 7.5 inches: room for the summary's lines
    figure = Figure(figsize=(width, 0.55 * schedule.stages + 1.9), layout="constrained")
    axes = figure.add_subplot()
    axes.set_facecolor(IDLE_COLOUR)
    kinds = draw_cells(axes, schedule, labelled=width / schedule.ticks >= LABEL_CELL)
    axes.set_xlim(0, schedule.ticks)
    axes.set_ylim(schedule.stages, 0)
    # Labels at the cells' centres, as many as fit side by side (about one per 0.35 inch).
    every = math.ceil(schedule.ticks / (width / 0.35))
    axes.set_xticks([t + 0.5 for t in range(0, schedule.ticks, every)], [str(t) for t in range(0, schedule.ticks, every)])
    axes.set_yticks([stage + 0.5 for stage in range(schedule.stages)], [f"stage {s}" for s in range(schedule.stages)])
    axes.tick_params(length=0)
    axes.set_xlabel("tick")
    axes.set_title(summary(schedule), fontsize=8, loc="left")
    handles = [Patch(facecolor=KIND_COLOURS[kind], label=KIND_NAMES[kind]) for kind in KIND_COLOURS if kind in kinds]
    handles.append(Patch(facecolor=IDLE_COLOUR, edgecolor="0.6", label="idle"))
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), frameon=False, fontsize=8)
    figure.savefig(path, dpi=DPI, bbox_inches="tight")  # tight: a long summary line widens the picture, not cut
    return figure


def draw_cells(axes, schedule: Schedule, labelled: bool) -> set[str]:
    """One box per action at (tick, stage), labelled F3, BW0.1, ... where it is wide enough; the kinds drawn."""
    from matplotlib.patches import Rectangle

    kinds = set()
    for tick, row in enumerate(schedule.table()):
        for stage, action in enumerate(row):
            if action is None:
                continue
            kinds.add(action.kind)
            axes.add_patch(Rectangle((tick, stage), 1, 1, facecolor=KIND_COLOURS[action.kind], edgecolor="white"))
            if labelled:
                label = action.label(chunked=schedule.virtual > 1)
                axes.text(tick + 0.5, stage + 0.5, label, ha="center", va="center", fontsize=6, color="white")
    return kinds
