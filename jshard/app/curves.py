"""Pictures of a training run: loss, tokens/s and MFU over steps, from its metrics file.

    $ jshard plot run.jsonl [-o run.png] [--title TEXT]

The metrics file is what `jshard train --metrics FILE` writes: JSON Lines, one object per
optimizer step, `{"step", "loss", "lr", "step_s", "tokens_per_s", "mfu"}` (`mfu` null without a
peak; device memory where the backend reports it), plus `"eval_loss"` and `"eval_perplexity"` on
steps that evaluated. A resumed run
appends to it, so a step may appear twice; the later line wins. `jshard train --plot FILE`
calls `metrics_png` at the end of a run.

matplotlib is imported only inside the functions that draw, so `jshard --help` does not load
it, and pictures are drawn on a `Figure` (Agg), never through pyplot: no GUI is involved.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

DPI = 120  # sharp enough to read, small enough for docs (well under 200 KB)
FORMAT = ('each line must be one JSON object with at least "step" (a whole number) and "loss" (a number), '
          "as jshard train --metrics FILE writes")
OPTIONAL_NUMBERS = ("lr", "grad_norm", "step_s", "tokens_per_s", "mfu", "memory_bytes", "peak_memory_bytes",
                    "eval_loss", "eval_perplexity")  # a number or null where present


class PlotError(ValueError):
    """A metrics file or an output path that cannot be drawn from or to. Raised before drawing."""


def check_output_path(path) -> None:
    """Refuse a picture whose directory does not exist, before any work is spent on it."""
    directory = Path(path).parent
    if not directory.is_dir():
        raise PlotError(f"{path}: directory {directory} does not exist; create it first (mkdir -p {directory})")
    from matplotlib.backend_bases import FigureCanvasBase  # (the import costs --help nothing here)

    kinds = FigureCanvasBase.get_supported_filetypes()  # what savefig writes, by the name's suffix
    suffix = Path(path).suffix.lstrip(".").lower()
    if suffix and suffix not in kinds:
        raise PlotError(f"{path}: matplotlib writes no .{suffix} picture; name it .png, .pdf or .svg")


def check_record(record, where: str) -> dict:
    """One step's metrics: a JSON object with a whole-number "step" and a numeric "loss"."""
    if not isinstance(record, dict):
        raise PlotError(f"{where}: {json.dumps(record)[:60]} is not a JSON object; {FORMAT}")
    for key, kind, ok in (("step", "a whole number", _is_int), ("loss", "a number", _is_number)):
        if key not in record:
            raise PlotError(f'{where}: no "{key}"; {FORMAT}')
        if not ok(record[key]):
            raise PlotError(f'{where}: "{key}" is {json.dumps(record[key])}, not {kind}; {FORMAT}')
    for key in OPTIONAL_NUMBERS:
        if record.get(key) is not None and not _is_number(record[key]):
            raise PlotError(f'{where}: "{key}" is {json.dumps(record[key])}, not a number or null; {FORMAT}')
    return record


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics(path) -> list[dict]:
    """Every line of a metrics file, in file order, each checked; blank lines are skipped."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise PlotError(f"{path}: no such file; jshard train --metrics {path} writes one") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlotError(f"{path}: cannot read it ({e}); {FORMAT}") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise PlotError(f"{path} line {number}: not JSON ({e.msg}); {FORMAT}; fix or delete that line") from None
        records.append(check_record(record, f"{path} line {number}"))
    if not records:
        raise PlotError(f"{path}: no steps, the file is empty; {FORMAT}")
    return records


def latest_per_step(records: list[dict]) -> list[dict]:
    """One record per step, in step order; where a resumed run wrote a step again, its later record."""
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])


def metrics_png(metrics, path, title: str | None = None):
    """Draw `metrics` (a metrics file's path, or its records as dicts) to the PNG `path`; return the Figure."""
    check_output_path(path)
    if isinstance(metrics, (str, os.PathLike)):
        records = read_metrics(metrics)
    else:
        records = [check_record(r, f"record {i}") for i, r in enumerate(metrics, start=1)]
        if not records:
            raise PlotError("no steps to draw: the list of metrics records is empty")
    figure = metrics_figure(latest_per_step(records), title)
    figure.savefig(path, dpi=DPI)
    return figure


def metrics_figure(records: list[dict], title: str | None = None):
    """Three panels over step, one record per step: loss (train, and eval where evaluated), tokens/s, MFU."""
    from matplotlib.figure import Figure  # Figure, not pyplot: no GUI backend is involved
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(8, 7), layout="constrained")
    loss, speed, mfu = figure.subplots(3, 1, sharex=True, height_ratios=[2, 1, 1])
    draw_loss(loss, records)
    draw_series(speed, records, "tokens_per_s", 1e-3, "tokens/s", "k tokens/s", "no tokens/s recorded")
    draw_series(mfu, records, "mfu", 100, "MFU", "MFU (%)", "no MFU: peak unknown")
    mfu.set_xlabel("step")
    mfu.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    if len(records) == 1:  # give one step's axis room for whole-number ticks around it
        mfu.set_xlim(records[0]["step"] - 1, records[0]["step"] + 1)
    for axes in (loss, speed, mfu):
        axes.grid(alpha=0.3)
    figure.suptitle(title or "training run")
    return figure


def draw_loss(axes, records: list[dict]) -> None:
    """Train loss as a line; eval loss as points joined only across the steps that evaluated."""
    steps, losses = [r["step"] for r in records], [r["loss"] for r in records]
    axes.plot(steps, losses, label="train loss", color="#4c72b0", linewidth=1.2, marker=_marker(steps))
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if evals:
        axes.plot(*zip(*evals), label="eval loss", color="#dd8452", marker="o", markersize=4, linewidth=1.2)
    axes.set_ylabel("loss (nats per token)")
    # Perplexity is exp(loss): the right axis labels the loss grid's lines with it.
    perplexity = axes.secondary_yaxis("right")
    perplexity.yaxis.set_major_formatter(lambda loss, _: f"{math.exp(min(loss, 700)):.3g}")
    perplexity.set_ylabel("perplexity")
    axes.legend(loc="upper right")


def draw_series(axes, records: list[dict], key: str, scale: float, label: str, ylabel: str, empty: str) -> None:
    """One optional metric over step; where no record has it, say so in the panel instead of leaving it blank."""
    points = [(r["step"], r[key] * scale) for r in records if r.get(key) is not None]
    if points:
        steps, values = zip(*points)
        axes.plot(steps, values, label=label, color="#55a868", linewidth=1.2, marker=_marker(steps))
        top = max((v for v in values if math.isfinite(v)), default=0)
        axes.set_ylim(0, 1.1 * top or 1)  # rates read against zero, not against their own noise
    else:
        axes.text(0.5, 0.5, empty, transform=axes.transAxes, ha="center", va="center", color="0.4")
        axes.set_yticks([])
    axes.set_ylabel(ylabel)


def _marker(steps) -> str | None:
    return "o" if len(steps) == 1 else None  # a one-point line would not show at all
