"""Pictures: `jshard plot` (a run's metrics file), `jshard pipeline show --png`, `jshard plan --png`.

Each picture is checked as a file (a PNG of the figure's size) and as data (the figure's lines
and bars are the numbers given, or the planner's own), and every bad input is one clear error,
exit 2, before anything is drawn."""

import json

import matplotlib.image
import pytest

from jshard import planner
from jshard.cli import build_parser, main
from jshard.parallel.schedules import make_schedule
from jshard.cli import show
from jshard.cli.plan import plan_input
from jshard.cli.show import draw_png
from jshard.app.curves import DPI, PlotError, metrics_png, read_metrics

PNG_HEADER = b"\x89PNG\r\n\x1a\n"

# Six steps, evaluated at 3 and 5; then a resumed run wrote steps 5 and 6 again: its lines win,
# so step 5's eval (only in the first line) is gone and step 6's is the resumed run's.
FIRST_RUN = [
    dict(step=1, loss=5.5, step_s=2.0, tokens_per_s=500.0, mfu=0.01),
    dict(step=2, loss=4.0, step_s=0.1, tokens_per_s=10000.0, mfu=0.30),
    dict(step=3, loss=3.5, step_s=0.1, tokens_per_s=10200.0, mfu=0.31, eval_loss=3.7, eval_perplexity=40.4),
    dict(step=4, loss=3.2, step_s=0.1, tokens_per_s=10100.0, mfu=0.30),
    dict(step=5, loss=3.0, step_s=0.1, tokens_per_s=9900.0, mfu=0.29, eval_loss=3.3, eval_perplexity=27.1),
]
RESUMED = [
    dict(step=5, loss=2.9, step_s=2.1, tokens_per_s=480.0, mfu=0.01),
    dict(step=6, loss=2.8, step_s=0.1, tokens_per_s=10300.0, mfu=0.32, eval_loss=3.0, eval_perplexity=20.1),
]
LATEST = FIRST_RUN[:4] + RESUMED  # one record per step, as the picture must show them


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def lines_by_label(axes) -> dict:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in axes.lines}


def assert_png_of(path, width: float, height: float, pixels: int = 1) -> None:
    """A PNG matplotlib can read back, `width` x `height` to within `pixels` (1: rounding)."""
    with open(path, "rb") as f:
        assert f.read(8) == PNG_HEADER
    rows, columns = matplotlib.image.imread(path).shape[:2]
    assert abs(rows - height) <= pixels and abs(columns - width) <= pixels, (rows, columns, height, width)


# --- jshard plot: a run's metrics file -------------------------------------------------------------


@pytest.mark.parametrize("given", ["file", "records"])
def test_metrics_png_draws_the_latest_record_of_each_step(tmp_path, given):
    metrics = write_jsonl(tmp_path / "run.jsonl", FIRST_RUN + RESUMED) if given == "file" else FIRST_RUN + RESUMED
    out = tmp_path / "run.png"
    figure = metrics_png(metrics, out, title="run")
    width, height = figure.get_size_inches() * DPI
    assert_png_of(out, width, height)
    loss, speed, mfu = figure.axes[:3]
    steps = [r["step"] for r in LATEST]
    assert lines_by_label(loss) == {
        "train loss": (steps, [r["loss"] for r in LATEST]),
        "eval loss": ([3, 6], [3.7, 3.0]),  # step 5's eval was replaced by the resumed run's step 5
    }
    assert lines_by_label(speed)["tokens/s"] == (steps, pytest.approx([r["tokens_per_s"] / 1e3 for r in LATEST]))
    assert lines_by_label(mfu)["MFU"] == (steps, pytest.approx([r["mfu"] * 100 for r in LATEST]))
    assert figure.get_suptitle() == "run"


@pytest.mark.parametrize("mfu, drawn", [
    ([None] * 6, None),  # no peak: the panel says so
    ([None, 0.3, None, 0.31, 0.3, None], ([2, 4, 5], [30.0, 31.0, 30.0])),  # only the steps that have one
])
def test_mfu_null_is_left_out_and_all_null_is_said(tmp_path, mfu, drawn):
    records = [r | {"mfu": m} for r, m in zip(LATEST, mfu)]
    figure = metrics_png(records, tmp_path / "run.png")
    panel = figure.axes[2]
    texts = [t.get_text() for t in panel.texts]
    if drawn is None:
        assert len(panel.lines) == 0 and texts == ["no MFU: peak unknown"]
    else:
        steps, values = lines_by_label(panel)["MFU"]
        assert (steps, values) == (drawn[0], pytest.approx(drawn[1])) and texts == []


def test_plot_command_writes_next_to_the_metrics_by_default(tmp_path, capsys):
    metrics = write_jsonl(tmp_path / "run.jsonl", LATEST)
    assert main(["plot", metrics]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'run.png'}\n"
    assert (tmp_path / "run.png").read_bytes()[:8] == PNG_HEADER


def test_read_metrics_keeps_file_order_and_skips_blank_lines(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps(LATEST[1]) + "\n\n" + json.dumps(LATEST[0]) + "\n")
    assert read_metrics(path) == [LATEST[1], LATEST[0]]


GOOD = json.dumps(LATEST[0])
BAD_METRICS = [  # (the file's text, or None for no file; the message)
    (None, "no such file; jshard train --metrics"),
    ("", "no steps, the file is empty"),
    ("\n  \n", "no steps, the file is empty"),
    (GOOD + "\n{\"step\": 2, \"loss\":\n", 'line 2: not JSON (Expecting value); each line must be one JSON object'),
    ('{"step": 1, "step_s": 0.1}\n', 'line 1: no "loss"; each line must be one JSON object with at least "step"'),
    (GOOD + '\n{"loss": 2.0}\n', 'line 2: no "step"'),
    ('{"step": "3", "loss": 2.0}\n', 'line 1: "step" is "3", not a whole number'),
    ('{"step": 3, "loss": null}\n', 'line 1: "loss" is null, not a number'),
    (GOOD + '\n{"step": 2, "loss": 2.0, "mfu": "n/a"}\n', 'line 2: "mfu" is "n/a", not a number or null'),
    ("[1, 2]\n", "line 1: [1, 2] is not a JSON object"),
]


@pytest.mark.parametrize("text, message", BAD_METRICS, ids=[m.split(";")[0] for _, m in BAD_METRICS])
def test_bad_metrics_file_is_one_error(tmp_path, capsys, text, message):
    metrics = tmp_path / "run.jsonl"
    if text is not None:
        metrics.write_text(text)
    assert main(["plot", str(metrics)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"jshard plot: {metrics}") and message in captured.err
    assert captured.err.count("\n") == 1
    assert not (tmp_path / "run.png").exists()


@pytest.mark.parametrize("output, message", [
    ("missing/run.png",
     "{tmp}/missing/run.png: directory {tmp}/missing does not exist; create it first (mkdir -p {tmp}/missing)"),
    ("run.jsonl", "{tmp}/run.jsonl is the metrics file itself; give the picture another name with -o FILE.png"),
    ("run.txt", "{tmp}/run.txt: matplotlib writes no .txt picture; name it .png, .pdf or .svg"),
])
def test_bad_output_path_is_one_error(tmp_path, capsys, output, message):
    metrics = write_jsonl(tmp_path / "run.jsonl", LATEST)
    assert main(["plot", metrics, "-o", str(tmp_path / output)]) == 2
    assert capsys.readouterr().err == f"jshard plot: {message.format(tmp=tmp_path)}\n"
    assert read_metrics(metrics) == LATEST  # untouched


@pytest.mark.parametrize("records, message", [
    ([], "no steps to draw"),
    ([LATEST[0], {"step": 2}], 'record 2: no "loss"'),
])
def test_bad_records_are_refused(tmp_path, records, message):
    with pytest.raises(PlotError, match=message):
        metrics_png(records, tmp_path / "run.png")
    assert not (tmp_path / "run.png").exists()


# --- jshard pipeline show --png --------------------------------------------------------------------


@pytest.mark.parametrize("name, virtual", [("1f1b", None), ("interleaved", 2), ("zb-h1", None)])
def test_pipeline_png_has_a_box_per_action_and_a_legend_of_their_kinds(tmp_path, name, virtual):
    schedule = make_schedule(name, 4, 8, virtual)
    out = tmp_path / "pipeline.png"
    figure = draw_png(schedule, str(out))
    # What savefig's bbox_inches="tight" keeps, in inches; measured here at the figure's own dpi,
    # whose text extents differ from the PNG's by a pixel or two.
    box = figure.get_tightbbox().padded(0.1)
    assert_png_of(out, box.width * show.DPI, box.height * show.DPI, pixels=3)
    actions = [a for row in schedule.table() for a in row if a is not None]
    assert len(figure.axes[0].patches) == len(actions)
    kinds = {"1f1b": ["F: forward", "BW: full backward"], "interleaved": ["F: forward", "BW: full backward"],
             "zb-h1": ["F: forward", "B: input-gradient backward", "W: weight-gradient backward"]}[name]
    assert [t.get_text() for t in figure.legends[0].get_texts()] == kinds + ["idle"]


def test_pipeline_png_in_a_missing_directory_is_refused_before_anything(tmp_path, capsys):
    json_path = tmp_path / "grid.json"
    argv = ["pipeline", "show", "--schedule", "gpipe", "--json", str(json_path), "--png", str(tmp_path / "no" / "g.png")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"jshard pipeline: {tmp_path}/no/g.png: directory")
    assert not json_path.exists()


# --- jshard plan --png -----------------------------------------------------------------------------

PLANS = {  # a pipeline (a bar per --stage-remat, this plan the second), ZeRO-3 (gathered layers), a 70B that does not fit
    "pipeline": ["--model", "tiny", "--strategy", "dp+pp", "--mesh", "data=2,stage=2", "--schedule", "zb-h1",
                 "--microbatches", "4", "--stage-remat", "full", "--hardware", "cpu"],
    "zero3": ["--model", "small", "--strategy", "zero3", "--devices", "8", "--remat", "full"],
    "70b": ["--model", "llama-3.1-70b", "--mesh", "data=2,stage=4,tensor=8", "--strategy", "dp+tp+sp+pp",
            "--schedule", "1f1b", "--microbatches", "16", "--remat", "selective"],
}


def planned(argv: list[str]) -> dict:
    """The planner's estimate for `jshard plan ARGV`, through its own API."""
    return planner.estimate(plan_input(build_parser().parse_args(["plan", *argv])))


def with_stage_remat(argv: list[str], mode: str) -> list[str]:
    if "--stage-remat" in argv:
        i = argv.index("--stage-remat")
        return argv[:i] + argv[i + 2:] + ["--stage-remat", mode]
    return argv + ["--stage-remat", mode]


@pytest.mark.parametrize("name", PLANS)
def test_plan_png_bars_are_the_planners_memory(tmp_path, name):
    argv = PLANS[name]
    est = planned(argv)
    out = tmp_path / "plan.png"
    figure = planner.memory_png(est, str(out))
    width, height = figure.get_size_inches() * planner.PNG_DPI
    assert_png_of(out, width, height)
    axes = figure.axes[0]
    unit = dict(planner.UNITS)[axes.get_xlabel().split("(")[1].rstrip(")")]
    segments = {bars.get_label(): [patch.get_width() * unit for patch in bars.patches] for bars in axes.containers}
    # Each bar is one of the planner's estimates: the plan, or under a pipeline the plan under each --stage-remat.
    modes = list(est["stage_remat_trade"] or [None])
    expected = [planned(with_stage_remat(argv, mode)) if mode else est for mode in modes]
    for row, other in enumerate(expected):
        memory = {k.replace("_", " "): v for k, v in other["memory_bytes_per_device"].items() if k != "total" and v}
        assert {kind: widths[row] for kind, widths in segments.items() if widths[row]} == pytest.approx(memory)
        assert sum(widths[row] for widths in segments.values()) == pytest.approx(other["memory_bytes_per_device"]["total"])
    labels = [label.get_text() for label in axes.get_yticklabels()]
    assert [row for row, label in enumerate(labels) if "(this plan)" in label] == (
        [modes.index(est["stage_remat"])] if est["stage_remat_trade"] else [])
    hbm = [line.get_xdata()[0] * unit for line in axes.lines]
    assert hbm == ([pytest.approx(est["hardware"]["hbm_bytes"])] if name == "70b" else [])  # tiny plans: off the scale


def test_plan_png_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "plan.png"
    assert main(["plan", *PLANS["zero3"], "--png", str(out)]) == 0
    assert capsys.readouterr().out.endswith(f"\nwrote {out}\n")
    assert out.read_bytes()[:8] == PNG_HEADER


@pytest.mark.parametrize("extra, message", [
    (["--png", "{tmp}/no/plan.png"], "{tmp}/no/plan.png: directory {tmp}/no does not exist; create it first"),
    (["--png", "{tmp}/plan.png", "--validate"], "--png draws a plan's memory; --validate has no plan to draw"),
])
def test_plan_png_bad_input_is_refused_before_planning(tmp_path, capsys, extra, message):
    assert main(["plan", *PLANS["zero3"], *(a.format(tmp=tmp_path) for a in extra)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"jshard plan: {message.format(tmp=tmp_path)}")
    assert list(tmp_path.iterdir()) == []
