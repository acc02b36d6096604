"""`jshard plan --png`: the memory per device as stacked bars, one segment per kind, against the
device's HBM (`memory_png`); under a pipeline one bar per `--stage-remat` mode (`memory_rows`).
"""

from __future__ import annotations

from jshard.mesh import mesh_text
from jshard.parallel.schedules import SCHEDULES
from jshard.placement import format_bytes
from jshard.planner.hardware import GiB


MEMORY_COLOURS = {  # model state in blues and greens, what the step adds in warm colours
    "params": "#4c72b0", "grads": "#64b5cd", "master": "#55a868", "optimizer": "#8fbc8f",
    "accumulated": "#a1c9f4", "gathered": "#8172b3", "chunk_weights": "#937860", "activations": "#dd8452", "reduction": "#da8bc3",
    "batch": "#c44e52",
}
UNITS = (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
PNG_DPI = 120
HBM_SCALE = 10  # the HBM line is drawn when it is at most this many times the largest bar


def memory_rows(est: dict) -> list[tuple[str, dict[str, int]]]:
    """(label, {kind: bytes per device}) per bar: the plan; under a pipeline, one per `--stage-remat`
    mode of the trade the report prints (they differ only in activations), the plan's marked."""
    memory = {kind: n for kind, n in est["memory_bytes_per_device"].items() if kind != "total"}
    trade = est["stage_remat_trade"]
    if not trade:
        return [(f"{est['strategy']}, remat {est['model']['remat']}", memory)]
    return [(f"{_schedule_name(est)}, stage remat {mode}" + ("\n(this plan)" if mode == est["stage_remat"] else ""),
             memory | {"activations": t["activations"]}) for mode, t in trade.items()]


def memory_png(est: dict, path: str):
    """Memory per device as horizontal stacked bars (`memory_rows`) and the HBM as a dashed line; returns the Figure."""
    from matplotlib.figure import Figure  # Figure, not pyplot: no GUI backend is involved

    rows = memory_rows(est)
    hbm, hardware = est["hardware"]["hbm_bytes"], est["hardware"]["name"]
    totals = [sum(memory.values()) for _, memory in rows]
    # A plan that uses a sliver of HBM would be an invisible bar next to the line: scale to the bars instead.
    hbm_on_scale = hbm <= HBM_SCALE * max(totals)
    largest = max(totals + [hbm] if hbm_on_scale else totals)
    unit_name, unit = _unit(largest)
    figure = Figure(figsize=(10, 1.5 + 0.65 * len(rows)), layout="constrained")
    axes = figure.add_subplot()
    axes.set_xlim(0, 1.3 * largest / unit)  # room right of the longest bar for its total
    _draw_bars(axes, rows, unit)
    if hbm_on_scale:
        axes.axvline(hbm / unit, color="black", linestyle="--", linewidth=1.2,
                     label=f"HBM {format_bytes(hbm, 1)}\n({hardware})")
    _label_totals(axes, rows, unit, hbm)
    axes.set_xlabel(f"memory per device ({unit_name})")
    axes.invert_yaxis()  # the first row on top
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)
    off_scale = "" if hbm_on_scale else f"\nHBM {format_bytes(hbm, 1)} ({hardware}) is off the scale"
    axes.set_title(_memory_title(est) + off_scale, fontsize=9, loc="left")
    figure.legend(loc="outside right upper", frameon=False, fontsize=8)
    figure.savefig(path, dpi=PNG_DPI)
    return figure


def _unit(largest: float) -> tuple[str, int]:
    """The largest binary unit the axis reaches at least one of."""
    return next((name, n) for name, n in UNITS if largest >= n or n == 1)


def _draw_bars(axes, rows, unit: int) -> None:
    """One `barh` per kind (a legend entry each), stacked left to right in the planner's order, each
    segment wide enough to hold it labelled with its size."""
    labels = [label for label, _ in rows]
    left = [0.0] * len(rows)
    kinds = [kind for kind in rows[0][1] if any(m[kind] for _, m in rows)]  # kinds a plan does not have stay out
    for kind in kinds:
        widths = [m[kind] / unit for _, m in rows]
        bars = axes.barh(labels, widths, left=left, height=0.6, label=kind.replace("_", " "),
                         color=MEMORY_COLOURS.get(kind, "#bbbbbb"), edgecolor="white", linewidth=0.8)
        wide = axes.get_xlim()[1] * 0.05
        axes.bar_label(bars, labels=[f"{w:.3g}" if w >= wide else "" for w in widths], label_type="center",
                       fontsize=7, color="white")
        left = [a + b for a, b in zip(left, widths)]


def _label_totals(axes, rows, unit: int, hbm: float) -> None:
    """Each bar's total at its end, in red where it does not fit."""
    for y, (_, memory) in enumerate(rows):
        total = sum(memory.values())
        fits = total <= hbm
        axes.text(total / unit, y, f" {format_bytes(total, 1)}" + ("" if fits else "\n does not fit"),
                  va="center", fontsize=8, color="black" if fits else "#c00000")


def _schedule_name(est: dict) -> str:
    """The `--schedule` name of the plan's schedule (the estimate records its class)."""
    return {cls.__name__: name for name, cls in SCHEDULES.items()}.get(est["schedule"], est["schedule"])


def _memory_title(est: dict) -> str:
    model, mesh = est["model"], mesh_text(est["mesh"])
    pipeline = f", {_schedule_name(est)} m={est['microbatches']}" if est["schedule"] else ""
    return (f"{model['kind']} {_count(model['params'])} params, {model['layers']} layers, seq {model['seq_len']}, "
            f"{model['dtype']}, remat {model['remat']}\n"
            f"{est['strategy']} on {mesh}{pipeline}, micro-batch {est['micro_batch_size']} rows")


def _count(n: int) -> str:
    """70.6 B, 125 M, 838 k: a parameter count as people say it."""
    scales = (("B", 1e9), ("M", 1e6), ("k", 1e3), ("", 1))
    return next(f"{n / scale:.3g} {name}".rstrip() for name, scale in scales if n >= scale or scale == 1)
