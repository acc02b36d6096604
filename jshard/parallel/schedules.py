"""Pipeline schedules as data: which stage does what at each tick.

A pipeline splits the model's layers over p devices (stages) and the batch into m
micro-batches. A device does four kinds of work on a micro-batch:

    F    forward through the device's layers
    BW   full backward: input gradient and weight gradient together (GPipe, 1F1B, interleaved)
    B    input-gradient backward only: what the previous stage waits for (zero-bubble)
    W    weight-gradient backward only: nobody waits for it, so it can fill idle ticks

A schedule is the order in which each device runs its work (`Schedule.order`). When each
action runs follows from that order and the dependencies, found by simulating the pipeline
tick by tick (`simulate`): a device runs the next action of its order once everything it
needs was done in an earlier tick, and idles otherwise, as a device blocked on a receive
would. With k the position of a stage in the pipeline:

    F(i) at k           needs F(i) at k-1                  its input activation
    B(i) or BW(i) at k  needs F(i) at k                    the activations it saved
                        and B(i) or BW(i) at k+1           the gradient of its output
    W(i) at k           needs B(i) at k                    the output gradient B received

Every action takes one tick ("unit costs"): F, B and W, and BW too, which counts as one
tick here although it costs about two forwards in practice. Under unit costs the idle
slots per busy slot (the bubble relative to the ideal, bubble-free step) are:

    GPipe, 1F1B         (p-1)/m
    interleaved 1F1B    (p-1)/(v*m)      v model chunks per device
    ZB-H1               (p-1)/(3m)       a micro-batch costs three ticks: F, B, W

and as a fraction of the whole step, idle/(idle+busy), GPipe and 1F1B give (p-1)/(m+p-1).
The simulated tables meet these formulas exactly (ZB-H1 for m >= p); the tests check it.

The tables are static so that an SPMD program can run them: every device knows at trace
time what every device does at every tick. This module needs no JAX.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import ClassVar

KINDS = ("F", "B", "W", "BW")

# One piece of work in the whole pipeline: (kind, micro-batch, virtual stage). The virtual
# stage is the position in the pipeline: model chunk c on device d is c*p + d.
Work = tuple[str, int, int]


class ScheduleError(ValueError):
    """Sizes a schedule cannot be built from, or a tick table that breaks a dependency."""


def _check_positive(where: str, **values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{where}: {name} must be a positive int, got {value!r}. Fix: pass {name}=1 or more.")


# --- actions -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Action:
    """One tick of work on one device: `kind` of micro-batch `microbatch` through the device's
    model chunk `virtual` (always 0 unless the schedule is interleaved).

    str(Action("F", 3)) is "F3"; str(Action("F", 3, 1)) is "F3.1", micro-batch 3 through
    chunk 1. Grids of interleaved schedules label every action with its chunk (F3.0 too), so
    that their columns read alike.
    """

    kind: str
    microbatch: int
    virtual: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ScheduleError(f"Action kind {self.kind!r} is not one of {', '.join(KINDS)}.")

    def label(self, chunked: bool = False) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.virtual}" if chunked else "")

    def __str__(self) -> str:
        return self.label(chunked=self.virtual > 0)


def one_f_one_b(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then forward/backward pairs, then the backwards left over.

    After the warm-up every forward, which creates one micro-batch's activations, is followed
    by a backward, which frees one: a device never holds more than warmup + 1.
    """
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        order += [forward, backward]
    return order + backwards[len(forwards) - warmup:]


# --- schedules -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Schedule(abc.ABC):
    """p = `stages` devices, m = `microbatches`; a subclass says in what order each device works."""

    stages: int
    microbatches: int

    name: ClassVar[str]
    formula: ClassVar[str]  # the textbook bubble relative to ideal, as text
    virtual: ClassVar[int] = 1  # model chunks per device; only the interleaved schedule has more
    backward: ClassVar[str] = "BW"  # what the previous stage waits for: BW, or B when W is split off

    def __post_init__(self):
        _check_positive(str(self), stages=self.stages, microbatches=self.microbatches, virtual=self.virtual)

    @abc.abstractmethod
    def order(self, stage: int) -> list[Action]:
        """The actions device `stage` runs, in the order it runs them."""

    @property
    @abc.abstractmethod
    def formula_bubble_fraction(self) -> float:
        """The textbook bubble relative to ideal (idle / busy) for these sizes, under unit costs."""

    def _require_microbatches_at_least_stages(self, why: str) -> None:
        p, m = self.stages, self.microbatches
        if m < p:
            raise ScheduleError(
                f"{self}: {self.name} needs at least as many micro-batches as stages (m >= p), got m={m} "
                f"with p={p}: {why}. Fix: use microbatches >= {p}, or the 1f1b schedule, which takes any m."
            )

    # --- dependencies, in terms of Work = (kind, micro-batch, virtual stage) ---

    def work(self, action: Action, stage: int) -> Work:
        return action.kind, action.microbatch, action.virtual * self.stages + stage

    def needs(self, work: Work) -> list[Work]:
        """What must be done, in an earlier tick, before `work` can run."""
        kind, microbatch, position = work
        if kind == "F":
            return [("F", microbatch, position - 1)] if position > 0 else []
        if kind == "W":
            return [("B", microbatch, position)]
        last = self.stages * self.virtual - 1
        return [("F", microbatch, position)] + ([(self.backward, microbatch, position + 1)] if position < last else [])

    def all_work(self) -> set[Work]:
        """Every piece of work a step must do exactly once."""
        kinds = ("F", "B", "W") if self.backward == "B" else ("F", "BW")
        positions = range(self.stages * self.virtual)
        return {(kind, i, k) for kind in kinds for i in range(self.microbatches) for k in positions}

    def describe(self, work: Work) -> str:
        kind, microbatch, position = work
        action = Action(kind, microbatch, position // self.stages)
        return f"{action.label(chunked=self.virtual > 1 or action.virtual > 0)} on stage {position % self.stages}"

    # --- the tick table and what it shows ---

    @functools.cached_property
    def _table(self) -> tuple[tuple[Action | None, ...], ...]:
        return simulate(self)

    def table(self) -> list[list[Action | None]]:
        """[tick][stage] -> the action that stage runs at that tick, None when it idles."""
        return [list(row) for row in self._table]

    def grid(self) -> list[list[str]]:
        """[stage][tick] -> the action's label ("F3", "BW3", "F3.1"), "." when idle."""
        chunked = self.virtual > 1
        return [[row[stage].label(chunked) if row[stage] else "." for row in self._table] for stage in range(self.stages)]

    @property
    def ticks(self) -> int:
        return len(self._table)

    @property
    def busy_slots(self) -> int:
        return sum(action is not None for row in self._table for action in row)

    @property
    def idle_slots(self) -> int:
        return self.ticks * self.stages - self.busy_slots

    @property
    def bubble_fraction(self) -> float:
        """Idle slots per busy slot: the step takes 1 + this times as long as with no bubble."""
        return self.idle_slots / self.busy_slots

    @property
    def bubble_fraction_of_step(self) -> float:
        """Idle slots per slot of the whole step: (p-1)/(m+p-1) for GPipe and 1F1B."""
        return self.idle_slots / (self.ticks * self.stages)

    def peak_in_flight(self, stage: int | None = None) -> int:
        """Most micro-batches holding activations on `stage` at once (all stages: the largest).

        A micro-batch is in flight on a stage from its forward until its backward is finished:
        its BW, or its W when the backward is split, since W still reads the stage's saved
        input. Interleaved schedules count micro-batch x chunk pairs, each 1/v of a stage's
        layers. This is what sizes the buffers that hold residuals between forward and backward.
        """
        if stage is None:
            return max(self.peak_in_flight(s) for s in range(self.stages))
        finished = "W" if self.backward == "B" else "BW"
        alive = peak = 0
        for row in self._table:
            action = row[stage]
            if action is not None:
                alive += (action.kind == "F") - (action.kind == finished)
                peak = max(peak, alive)
        return peak

    def validate(self, table: list[list[Action | None]] | None = None) -> None:
        """Check a tick table (by default this schedule's own): every stage has a slot each tick,
        every piece of work runs exactly once, and everything it needs ran in an earlier tick.
        Raises ScheduleError naming the tick, the stage and the rule broken."""
        table = self._table if table is None else table
        problems, done_at = [], {}
        for tick, row in enumerate(table):
            if len(row) != self.stages:
                problems.append(f"tick {tick} has {len(row)} slots, one per stage wants {self.stages}")
            for stage, action in enumerate(row):
                if action is None:
                    continue
                work = self.work(action, stage)
                if work in done_at:
                    problems.append(f"tick {tick}: {self.describe(work)} runs again (first at tick {done_at[work]})")
                done_at.setdefault(work, tick)
        expected = self.all_work()
        problems += [f"{self.describe(w)} never runs" for w in sorted(expected - done_at.keys())]
        problems += [f"{self.describe(w)} is not work of this schedule" for w in sorted(done_at.keys() - expected)]
        for work, tick in sorted(done_at.items(), key=lambda item: item[1]):
            for need in self.needs(work):
                if done_at.get(need, tick) >= tick:
                    when = f"at tick {done_at[need]}" if need in done_at else "never"
                    problems.append(f"tick {tick}: {self.describe(work)} runs before {self.describe(need)} is done ({when})")
        if problems:
            shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
            raise ScheduleError(f"{self}: the tick table breaks {len(problems)} rule(s):\n- " + "\n- ".join(shown))


@dataclasses.dataclass(frozen=True)
class GPipe(Schedule):
    """All forwards, then all backwards (Huang et al., 2019).

    Simple, and any m works, but every stage holds all m micro-batches' activations when the
    forwards end: peak in flight m.
    """

    name = "gpipe"
    formula = "(p-1)/m"

    def order(self, stage: int) -> list[Action]:
        forwards = [Action("F", i) for i in range(self.microbatches)]
        # Last in, first out: the order in which autodiff through the loop of forwards runs them.
        return forwards + [Action("BW", i) for i in reversed(range(self.microbatches))]

    @property
    def formula_bubble_fraction(self) -> float:
        return (self.stages - 1) / self.microbatches


@dataclasses.dataclass(frozen=True)
class OneFOneB(Schedule):
    """One forward, one backward (PipeDream-Flush; Narayanan et al., 2021; Megatron-LM).

    GPipe's bubble, but stage s starts its backwards after p-1-s forwards, so it holds at most
    p-s micro-batches: p on the first stage, however large m is. Any m works: with m < p the
    early stages' warm-up takes all their forwards, so they run all forwards first, as in GPipe.
    """

    name = "1f1b"
    formula = "(p-1)/m"

    def order(self, stage: int) -> list[Action]:
        m = self.microbatches
        # p-1-s forwards ahead: the first backward has to travel to the last stage and back.
        warmup = self.stages - 1 - stage
        return one_f_one_b([Action("F", i) for i in range(m)], [Action("BW", i) for i in range(m)], warmup)

    @property
    def formula_bubble_fraction(self) -> float:
        return (self.stages - 1) / self.microbatches


@dataclasses.dataclass(frozen=True)
class Interleaved1F1B(Schedule):
    """1F1B over v model chunks per device (Megatron-LM's interleaved schedule).

    The layers are cut into p*v chunks; device d holds chunks d, d+p, d+2p, ... so a
    micro-batch goes through the devices v times. Each tick does 1/v of a stage's work, so
    the warm-up and cool-down, which last about as many ticks as in 1F1B, cost 1/v as much:
    bubble (p-1)/(v*m), at the price of v times more point-to-point sends and more
    activations held (counted in chunks by peak_in_flight).
    """

    virtual: int = 2

    name = "interleaved"
    formula = "(p-1)/(v*m)"

    def __post_init__(self):
        super().__post_init__()
        p, m = self.stages, self.microbatches
        self._require_microbatches_at_least_stages("micro-batches go through the chunks in groups of p")
        if m % p:
            raise ScheduleError(
                f"{self}: interleaved needs the micro-batches in whole groups of p={p} (m a multiple of p), "
                f"got m={m}. Fix: use microbatches={m // p * p} or {(m // p + 1) * p}."
            )

    def order(self, stage: int) -> list[Action]:
        p, v = self.stages, self.virtual

        def in_groups(kind: str, chunks: list[int]) -> list[Action]:
            # A group of p micro-batches through chunk chunks[0], the same group through
            # chunks[1], ..., then the next group. p in a row is what keeps a device busy until
            # the group's first micro-batch comes back round from the last device.
            per_round = p * v
            return [
                Action(kind, n // per_round * p + n % p, chunks[n % per_round // p])
                for n in range(self.microbatches * v)
            ]

        forwards = in_groups("F", list(range(v)))
        backwards = in_groups("BW", list(reversed(range(v))))
        # The first group through the first v-1 chunks, then 2(p-1-s) more: the time the first
        # group's last chunk takes to reach the last device and its backward to come back.
        warmup = (v - 1) * p + 2 * (p - 1 - stage)
        return one_f_one_b(forwards, backwards, warmup)

    @property
    def formula_bubble_fraction(self) -> float:
        return (self.stages - 1) / (self.virtual * self.microbatches)


@dataclasses.dataclass(frozen=True)
class ZeroBubbleH1(Schedule):
    """ZB-H1 (Qi et al., 2024, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split
    into B (input gradient) and W (weight gradient), and the W's moved into the bubbles.

    Only B is on the path from the last stage back to the first; W can wait. Stage s runs
    W(i) right after B(i+s), s micro-batches late, and its last s W's after its last B: the
    later the stage, the earlier its B's end, and the deferred W's fill exactly that tail.
    Held activations: p-s awaiting B plus s awaiting W, so p on every stage, 1F1B's first-stage
    peak. Bubble (p-1)/(3m) against 1F1B's (p-1)/m under the same unit costs per action.
    """

    name = "zb-h1"
    formula = "(p-1)/(3m)"
    backward = "B"

    def __post_init__(self):
        super().__post_init__()
        self._require_microbatches_at_least_stages(
            "with fewer, the first stage runs out of work before the first B returns and the "
            "deferred W's cannot fill that wait, so the bubble exceeds (p-1)/(3m)"
        )

    def order(self, stage: int) -> list[Action]:
        m = self.microbatches
        split = one_f_one_b([Action("F", i) for i in range(m)], [Action("B", i) for i in range(m)], self.stages - 1 - stage)
        order = []
        for action in split:
            order.append(action)
            if action.kind == "B" and action.microbatch >= stage:
                order.append(Action("W", action.microbatch - stage))
        return order + [Action("W", i) for i in range(max(m - stage, 0), m)]

    @property
    def formula_bubble_fraction(self) -> float:
        return (self.stages - 1) / (3 * self.microbatches)


# --- from orders to a tick table -------------------------------------------------------------


def simulate(schedule: Schedule) -> tuple[tuple[Action | None, ...], ...]:
    """Each tick, every device runs the next action of its order if everything that action
    needs was done in an earlier tick; otherwise it idles. Returns [tick][stage]."""
    orders = [schedule.order(stage) for stage in range(schedule.stages)]
    position = [0] * schedule.stages
    done: set[Work] = set()
    table = []
    while any(at < len(order) for at, order in zip(position, orders)):
        wanted = [order[at] if at < len(order) else None for at, order in zip(position, orders)]
        row = tuple(
            action if action and all(need in done for need in schedule.needs(schedule.work(action, stage))) else None
            for stage, action in enumerate(wanted)
        )
        if not any(row):  # nothing can ever run again: the orders contradict the dependencies
            waits = [f"stage {stage} waits to run {action}" for stage, action in enumerate(wanted) if action]
            raise ScheduleError(f"{schedule}: deadlock at tick {len(table)} ({'; '.join(waits)}). This is a bug in its order.")
        for stage, action in enumerate(row):
            if action:
                done.add(schedule.work(action, stage))
                position[stage] += 1
        table.append(row)
    return tuple(table)


# --- making one by name, and the layer split the executor needs ------------------------------

SCHEDULES: dict[str, type[Schedule]] = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "interleaved": Interleaved1F1B,
    "zb-h1": ZeroBubbleH1,
}


def make_schedule(name: str, stages: int, microbatches: int, virtual: int | None = None) -> Schedule:
    """The schedule called `name` (gpipe, 1f1b, interleaved, zb-h1). `virtual` is the number of
    model chunks per device, for interleaved only; None takes its default, 2."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}. Fix: use one of {', '.join(SCHEDULES)}.")
    schedule = SCHEDULES[name]
    if virtual is None:
        return schedule(stages, microbatches)
    if "virtual" in {field.name for field in dataclasses.fields(schedule)}:
        return schedule(stages, microbatches, virtual)
    if virtual != 1:
        raise ScheduleError(
            f"{name} with stages={stages}, microbatches={microbatches}: virtual={virtual} applies to the "
            f"interleaved schedule only; {name} runs one model chunk per device. Fix: drop virtual, or use interleaved."
        )
    return schedule(stages, microbatches)


def stage_layers(layers: int, stages: int, virtual: int = 1) -> tuple[int, ...]:
    """The layers of each model chunk, in pipeline order (position k = c·stages + d is device d's
    chunk c): `layers` split over stages·virtual chunks, as evenly as they go.

    Where the chunks do not divide the layers, the remainder goes to the middle chunks, the last
    middle one first, then to the first chunk, never to the last (a remainder is below the chunks'
    count): the first chunk also runs the embedding and the last the head and the loss (a
    vocab-wide matmul: the dearer of the two), so they get fewer layers (Megatron and torchtitan
    count them as a layer each for the same reason), and under 1F1B the earlier stages hold more
    micro-batches in flight, so the extra layers' activations go to the later ones. 6 on 4:
    (1, 2, 2, 1); 7 on 2: (4, 3), not (3, 4), the head being dearer than the embedding; 80 on 6:
    (13, 13, 13, 14, 14, 13). Every chunk needs a layer: fewer layers than chunks is refused."""
    _check_positive("pipeline layer split", layers=layers, stages=stages, virtual=virtual)
    chunks = stages * virtual
    if layers < chunks:
        raise ScheduleError(
            f"{layers} layers on stages={stages} x virtual={virtual} = {chunks} model chunks: a chunk needs at least "
            f"one layer. Fix: stages x virtual at most {layers}, or a model with at least {chunks} layers.")
    counts = [layers // chunks] * chunks
    middle = list(range(chunks - 2, 0, -1))
    for k in (middle + [0, chunks - 1])[:layers % chunks]:
        counts[k] += 1
    return tuple(counts)
