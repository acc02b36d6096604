"""Pipeline schedules as tick tables: valid, with the textbook bubbles and memory, and shown.

Pure Python: the tables need no JAX (conftest's fake devices are not used here).
"""

import json

import pytest

from jshard.cli import main
from jshard.parallel.schedules import (
    Action,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    ScheduleError,
    ZeroBubbleH1,
    make_schedule,
    stage_layers,
)
from jshard.cli.show import render

pytestmark = pytest.mark.fast  # the whole file: the schedules' tables, nothing compiled

SIZES = [(p, m) for p in (2, 4) for m in (p, 2 * p, 4 * p)]
VIRTUAL = 2
LAYERS = 16  # splits over p*v chunks for every p in SIZES and v = VIRTUAL


def schedules(name):
    return [make_schedule(name, p, m, VIRTUAL if name == "interleaved" else None) for p, m in SIZES]


def all_schedules():
    return [s for name in ("gpipe", "1f1b", "interleaved", "zb-h1") for s in schedules(name)]


# Under unit costs a micro-batch costs 2 ticks per stage (F, BW), or 3 when the backward is
# split (F, B, W); interleaved does that once per chunk. The ideal step is just the busy work.
# The idle slots the textbook formulas give, multiplied out: busy * formula.
def expected_busy_and_idle(schedule):
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual
    if isinstance(schedule, ZeroBubbleH1):
        return 3 * p * m, p * (p - 1)  # 3pm * (p-1)/(3m)
    return 2 * p * m * v, 2 * p * (p - 1)  # 2pmv * (p-1)/(v m)


@pytest.mark.parametrize("schedule", all_schedules(), ids=str)
def test_table_is_valid_and_its_bubble_is_the_formula(schedule):
    schedule.validate()
    busy, idle = expected_busy_and_idle(schedule)
    assert (schedule.busy_slots, schedule.idle_slots) == (busy, idle)
    assert schedule.ticks * schedule.stages == busy + idle
    assert schedule.bubble_fraction == pytest.approx(schedule.formula_bubble_fraction, rel=1e-12)
    chunks = schedule.stages * schedule.virtual
    assert stage_layers(LAYERS, schedule.stages, schedule.virtual) == (LAYERS // chunks,) * chunks


def test_formulas_hold_across_a_sweep_of_sizes():
    for p in range(1, 7):
        for m in range(1, 3 * p + 1):
            sweep = [GPipe(p, m), OneFOneB(p, m)]
            if m >= p:
                sweep.append(ZeroBubbleH1(p, m))
            if m % p == 0:
                sweep += [Interleaved1F1B(p, m, virtual=v) for v in (1, 2, 3)]
            for schedule in sweep:
                schedule.validate()
                assert schedule.bubble_fraction == pytest.approx(schedule.formula_bubble_fraction, rel=1e-12), schedule


@pytest.mark.parametrize("p, m", SIZES)
def test_formula_values(p, m):
    assert GPipe(p, m).formula_bubble_fraction == OneFOneB(p, m).formula_bubble_fraction == (p - 1) / m
    assert Interleaved1F1B(p, m, virtual=3).formula_bubble_fraction == (p - 1) / (3 * m)
    assert ZeroBubbleH1(p, m).formula_bubble_fraction == (p - 1) / (3 * m)
    for schedule in (GPipe(p, m), OneFOneB(p, m)):  # SPEC: (p-1)/(m+p-1) of the step
        assert schedule.bubble_fraction_of_step == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)


def test_1f1b_and_gpipe_also_take_fewer_microbatches_than_stages():
    for schedule in (OneFOneB(4, 2), GPipe(4, 2), GPipe(4, 1), OneFOneB(1, 3)):
        schedule.validate()
        assert schedule.bubble_fraction == pytest.approx(schedule.formula_bubble_fraction, rel=1e-12)
    assert OneFOneB(4, 2).peak_in_flight() == 2


@pytest.mark.parametrize("schedule", schedules("1f1b"), ids=str)
def test_1f1b_holds_at_most_p_minus_s_microbatches_on_stage_s(schedule):
    p = schedule.stages
    assert [schedule.peak_in_flight(s) for s in range(p)] == [p - s for s in range(p)]
    assert schedule.peak_in_flight() == p


@pytest.mark.parametrize("schedule", schedules("gpipe"), ids=str)
def test_gpipe_holds_all_m_microbatches(schedule):
    assert schedule.peak_in_flight(0) == schedule.peak_in_flight() == schedule.microbatches


@pytest.mark.parametrize("schedule", schedules("zb-h1"), ids=str)
def test_zb_h1_holds_p_on_every_stage_until_w(schedule):
    assert [schedule.peak_in_flight(s) for s in range(schedule.stages)] == [schedule.stages] * schedule.stages


@pytest.mark.parametrize("schedule", schedules("interleaved"), ids=str)
def test_interleaved_holds_its_warmup_plus_one_chunks(schedule):
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual
    expected = [min(m * v, (v - 1) * p + 2 * (p - 1 - s) + 1) for s in range(p)]
    assert [schedule.peak_in_flight(s) for s in range(p)] == expected


# --- the grids, by hand --------------------------------------------------------------------


def test_render_gpipe_2_stages_2_microbatches():
    assert render(GPipe(2, 2)) == "\n".join([
        "gpipe: p=2 stages, m=2 micro-batches, v=1, 6 ticks",
        "bubble 0.5000 of ideal (formula (p-1)/m = 0.5000), 33.3% of the step idle; peak in flight 2 (stage 0..1: 2 2)",
        "tick    0   1   2   3   4   5",
        "stage 0 F0  F1  .   .   BW1 BW0",
        "stage 1 .   F0  F1  BW1 BW0 .",
    ])


def test_zb_h1_defers_w_by_the_stage_index():
    F, B, W = (lambda i, k=k: Action(k, i) for k in "FBW")
    assert ZeroBubbleH1(2, 2).table() == [
        [F(0), None],
        [F(1), F(0)],
        [None, B(0)],
        [B(0), F(1)],
        [W(0), B(1)],
        [B(1), W(0)],  # stage 1 runs W0 only after B1: deferred by one micro-batch
        [W(1), W(1)],
    ]


def test_interleaved_goes_round_the_devices_once_per_chunk():
    grid = Interleaved1F1B(2, 2, virtual=2).grid()
    assert grid[0][:4] == ["F0.0", "F1.0", "F0.1", "F1.1"]
    assert grid[1][:5] == [".", "F0.0", "F1.0", "F0.1", "BW0.1"]


def test_action_labels():
    assert [str(Action("F", 3)), str(Action("BW", 3)), str(Action("W", 12)), str(Action("F", 3, 1))] == [
        "F3", "BW3", "W12", "F3.1"]
    assert Action("B", 3).label(chunked=True) == "B3.0"
    with pytest.raises(ScheduleError, match="'X' is not one of F, B, W, BW"):
        Action("X", 0)


# --- validate() catches broken tables -------------------------------------------------------


def broken(table, tick, stage, action):
    table = [list(row) for row in table]
    table[tick][stage] = action
    return table


@pytest.mark.parametrize(
    "make_broken, fragment",
    [
        # stage 1's F0 one tick earlier, at tick 0, together with stage 0's
        (lambda t: broken(broken(t, 1, 1, None), 0, 1, Action("F", 0)),
         "tick 0: F0 on stage 1 runs before F0 on stage 0 is done (at tick 0)"),
        (lambda t: broken(t, 5, 0, None), "BW0 on stage 0 never runs"),
        (lambda t: broken(t, 2, 0, Action("F", 1)), "tick 2: F1 on stage 0 runs again (first at tick 1)"),
        (lambda t: broken(t, 2, 0, Action("B", 0)), "B0 on stage 0 is not work of this schedule"),
        (lambda t: broken(t, 2, 0, Action("F", 0, 1)), "F0.1 on stage 0 is not work of this schedule"),
        (lambda t: t[:3] + [t[3][:1]] + t[4:], "tick 3 has 1 slots, one per stage wants 2"),
        # stage 0's backwards before stage 1's: BW1 at tick 3 on both stages
        (lambda t: broken(broken(t, 4, 0, None), 3, 0, Action("BW", 1)),
         "tick 3: BW1 on stage 0 runs before BW1 on stage 1 is done (at tick 3)"),
    ],
)
def test_validate_names_the_broken_rule(make_broken, fragment):
    schedule = GPipe(2, 2)
    with pytest.raises(ScheduleError) as e:
        schedule.validate(make_broken(schedule.table()))
    assert fragment in str(e.value) and str(schedule) in str(e.value)


def test_zb_h1_w_before_its_b_is_caught():
    schedule = ZeroBubbleH1(2, 2)
    table = broken(broken(schedule.table(), 3, 0, Action("W", 0)), 4, 0, Action("B", 0))
    with pytest.raises(ScheduleError, match="tick 3: W0 on stage 0 runs before B0 on stage 0 is done"):
        schedule.validate(table)


def test_an_order_that_contradicts_the_dependencies_deadlocks_loudly():
    class BackwardFirst(GPipe):
        def order(self, stage):
            return list(reversed(super().order(stage)))

    with pytest.raises(ScheduleError, match=r"deadlock at tick 0 \(stage 0 waits to run BW0; stage 1 waits to run BW0\)"):
        BackwardFirst(2, 2).table()


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, fragments",
    [
        (lambda: make_schedule("gpipe", 0, 4), ["GPipe(stages=0, microbatches=4)", "stages must be a positive int"]),
        (lambda: make_schedule("1f1b", 4, 0), ["microbatches must be a positive int, got 0"]),
        (lambda: OneFOneB(4.0, 8), ["stages must be a positive int, got 4.0"]),
        (lambda: make_schedule("interleaved", 4, 8, 0), ["virtual must be a positive int, got 0"]),
        (lambda: make_schedule("zb-h1", 4, 3), ["zb-h1 needs at least as many micro-batches as stages (m >= p)",
                                                "got m=3 with p=4", "Fix: use microbatches >= 4"]),
        (lambda: make_schedule("interleaved", 4, 2), ["interleaved needs at least as many micro-batches as stages"]),
        (lambda: make_schedule("interleaved", 4, 6), ["whole groups of p=4", "Fix: use microbatches=4 or 8"]),
        (lambda: make_schedule("1f1b", 4, 8, 2), ["virtual=2 applies to the interleaved schedule only",
                                                  "Fix: drop virtual, or use interleaved"]),
        (lambda: make_schedule("pipedream", 4, 8), ["unknown schedule 'pipedream'", "gpipe, 1f1b, interleaved, zb-h1"]),
        (lambda: stage_layers(6, 4, 2), ["6 layers on stages=4 x virtual=2 = 8 model chunks: a chunk needs at least "
                                         "one layer", "Fix: stages x virtual at most 6"]),
        (lambda: stage_layers(3, 4), ["3 layers on stages=4 x virtual=1 = 4 model chunks"]),
        (lambda: stage_layers(0, 4), ["layers must be a positive int, got 0"]),
    ],
)
def test_bad_input_says_what_where_and_the_fix(make, fragments):
    with pytest.raises(ScheduleError) as e:
        make()
    assert all(fragment in str(e.value) for fragment in fragments), str(e.value)


@pytest.mark.parametrize("layers, stages, virtual, expected", [
    (16, 4, 2, (2,) * 8), (12, 4, 1, (3,) * 4),
    # The remainder goes to the middle chunks, the last middle one first; the first chunk (the
    # embedding) gets a fewer, the last (head and loss, dearer) never gets one more.
    (6, 4, 1, (1, 2, 2, 1)), (7, 2, 1, (4, 3)), (24, 16, 1, (1,) * 7 + (2,) * 8 + (1,)),
    (80, 6, 1, (13, 13, 13, 14, 14, 13)), (7, 2, 2, (2, 2, 2, 1)), (6, 2, 2, (1, 2, 2, 1)), (5, 5, 1, (1,) * 5),
])
def test_stage_layers_balances_the_chunks(layers, stages, virtual, expected):
    counts = stage_layers(layers, stages, virtual)
    assert counts == expected and sum(counts) == layers and max(counts) - min(counts) <= 1


def test_make_schedule_defaults():
    assert make_schedule("1f1b", 4, 8, 1) == OneFOneB(4, 8)
    assert make_schedule("interleaved", 4, 8).virtual == 2


# --- jshard pipeline show -------------------------------------------------------------------


def test_cli_prints_the_grid_and_writes_json(tmp_path, capsys):
    path = tmp_path / "1f1b.json"
    assert main(["pipeline", "show", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "bubble 0.3750 of ideal (formula (p-1)/m = 0.3750)" in out
    assert "stage 3 .   .   .   F0  BW0 F1  BW1 F2  BW2" in out
    written = json.loads(path.read_text())
    assert set(written) >= {"schedule", "stages", "microbatches", "virtual", "ticks", "bubble_fraction",
                            "formula_bubble_fraction", "peak_in_flight", "grid"}
    assert (written["schedule"], written["ticks"], written["peak_in_flight"]) == ("1f1b", 22, 4)
    assert written["bubble_fraction"] == written["formula_bubble_fraction"] == 0.375
    assert written["grid"][0][:8] == ["F0", "F1", "F2", "F3", ".", ".", ".", "BW0"]


def test_cli_bad_input_is_reported_not_raised(capsys):
    assert main(["pipeline", "show", "--schedule", "interleaved", "--stages", "4", "--microbatches", "6"]) == 2
    assert "jshard pipeline: Interleaved1F1B(stages=4, microbatches=6, virtual=2)" in capsys.readouterr().err


def test_cli_png_draws_the_grid(tmp_path):
    path = tmp_path / "zb.png"
    assert main(["pipeline", "show", "--schedule", "zb-h1", "--png", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
