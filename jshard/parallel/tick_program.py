"""A pipeline schedule's tick table as the integers the executor runs (`pipelining.py`).

Per tick and device: which action (F, BW, B or W, or none), at which position, on which
micro-batch and chunk, reading and writing which buffer slots. Each buffer (stage inputs, output
gradients, residuals per segment, B's crossover per segment) holds a value from the tick it is
written to the tick it is last read; slots are assigned here, in Python, from the table, so a
buffer holds as many micro-batches as the schedule keeps in flight: m for GPipe, p for 1F1B on
the first stage.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jshard.parallel.schedules import Schedule
from jshard.rules import ShardingError

ROLES = ("first", "middle", "last")  # where in the pipeline a chunk is: position 0, between, p·v - 1
KINDS = ("F", "BW", "B", "W")  # what a device does in a tick (or nothing)
SEGMENTS = ("first", "layers", "last")  # embeddings at position 0, the chunk's layers, head and loss at the end
STAGE_REMAT = ("none", "full")  # keep each segment's residuals / keep the stage input and recompute


def segments(role: str) -> tuple[str, ...]:
    """The segments a chunk at `role` runs."""
    return tuple(s for s in SEGMENTS if s in ("layers", role))


def work(schedule: Schedule, stage_remat: str) -> float:
    """The executor's work over the unpipelined step's: F + 2F keeping the residuals; F + (F + 2F)
    recomputing the forward for the backward; ZB-H1 recomputing, F + (F + B) + (F + W)."""
    return 1.0 if stage_remat == "none" else 5 / 3 if schedule.backward == "B" else 4 / 3


def check_stage_remat(stage_remat: str) -> str:
    if stage_remat not in STAGE_REMAT:
        raise ShardingError(f"build_step: stage_remat={stage_remat!r}. Fix: 'none' (a stage keeps what its backward "
                            "needs) or 'full' (it keeps its input, and the backward recomputes the chunk's forward).")
    return stage_remat


@dataclasses.dataclass(frozen=True)
class Program:
    """A schedule as arrays the scan reads one row of per tick; [tick, stage] unless noted.
    A buffer's last index (= its count) is a slot nobody reads: where nothing is written."""

    kind: np.ndarray  # 1 + index into KINDS of the action (0: none)
    role: np.ndarray  # index into ROLES: where in the pipeline the action's chunk is
    microbatch: np.ndarray
    chunk: np.ndarray
    act_slot: np.ndarray  # the activation slot the action reads (its stage input)
    grad_slot: np.ndarray  # the gradient slot it reads (its output's gradient)
    act_arrival: np.ndarray  # where the activation sent in this tick goes, at its end
    grad_arrival: np.ndarray
    act_late: np.ndarray  # where the activation sent late (the last tick's output, sent in this one) goes
    grad_late: np.ndarray
    saved_slot: dict[str, np.ndarray]  # per segment: the slot of F's residuals that B / W / BW read
    saved_write: dict[str, np.ndarray]  # per segment: where F's residuals go at the end of the tick
    crossover_slot: dict[str, np.ndarray]  # per segment: the slot of what B handed W
    crossover_write: dict[str, np.ndarray]
    sends_forward: np.ndarray  # [tick]: whether any device sends this tick's activation
    sends_backward: np.ndarray  # [tick]: whether any device sends this tick's input gradient
    late_forward: np.ndarray  # [tick]: whether the last tick's activations are sent in this one
    late_backward: np.ndarray
    act_slots: int
    grad_slots: int
    saved_slots: dict[str, int]  # 0: not buffered (stage_remat="full")
    crossover_slots: dict[str, int]  # 0: no W (every schedule but ZB-H1)

    def rows(self) -> dict:
        """The per-tick arrays, as the scan's xs."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), (np.ndarray, dict)) and not f.name.endswith("slots")}


def _role(position: int, positions: int) -> str:
    return "first" if position == 0 else "last" if position == positions - 1 else "middle"


def _assign_slots(lifetimes: dict, stages: int) -> tuple[dict, int]:
    """Slots for values that live from the end of tick `start` to tick `end` on `stage`.

    A value read for the last time at tick t frees its slot for one written at the end of t.
    """
    slot_of, count = {}, 0
    for stage in range(stages):
        free_at: list[int] = []  # per slot, the last tick it is read
        for key, (start, end) in sorted(((k, v) for k, v in lifetimes.items() if k[0] == stage), key=lambda kv: kv[1]):
            slot = next((s for s, last in enumerate(free_at) if last <= start), len(free_at))
            free_at[slot:slot + 1] = [end]
            slot_of[key] = slot
        count = max(count, len(free_at))
    return slot_of, count


def compile_program(schedule: Schedule, stage_remat: str = "none") -> Program:
    """Which branch, micro-batch, chunk and buffer slots every device uses at every tick."""
    keep = stage_remat == "none"  # (checked by the plan)
    p, v, m, table = schedule.stages, schedule.virtual, schedule.microbatches, schedule.table()
    positions, ticks = p * v, len(table)
    done = {}  # (kind, micro-batch, position) -> tick
    for tick, row in enumerate(table):
        for stage, action in enumerate(row):
            if action is not None:
                done[schedule.work(action, stage)] = tick
    last_backward = {(i, k): done.get(("W", i, k), done.get(("BW", i, k))) for i in range(m) for k in range(positions)}
    first_backward = {(i, k): done[schedule.backward, i, k] for i in range(m) for k in range(positions)}
    # Stage inputs arrive from F at k-1 and wait for F (or, recomputed, for the last backward);
    # output gradients arrive from the backward at k+1 and wait for B / BW.
    acts = {(k % p, i, k): (done["F", i, k - 1], done["F", i, k] if keep else last_backward[i, k])
            for i in range(m) for k in range(1, positions)}
    grads = {(k % p, i, k): (done[schedule.backward, i, k + 1], first_backward[i, k])
             for i in range(m) for k in range(positions - 1)}
    at = {segment: [k for k in range(positions) if segment in segments(_role(k, positions))] for segment in SEGMENTS}
    saved = {segment: {(k % p, i, k): (done["F", i, k], last_backward[i, k]) for i in range(m) for k in at[segment]}
             if keep else {} for segment in SEGMENTS}
    crossover = {segment: {(k % p, i, k): (done["B", i, k], done["W", i, k]) for i in range(m) for k in at[segment]}
                 if schedule.backward == "B" else {} for segment in SEGMENTS}
    act_slot_of, act_slots = _assign_slots(acts, p)
    grad_slot_of, grad_slots = _assign_slots(grads, p)
    saved_slots = {s: _assign_slots(saved[s], p) for s in SEGMENTS}
    crossover_slots = {s: _assign_slots(crossover[s], p) for s in SEGMENTS}

    shape = (ticks, p)
    arrays = {name: np.zeros(shape, np.int32) for name in ("kind", "role", "microbatch", "chunk")}
    arrays |= {name: np.full(shape, act_slots, np.int32) for name in ("act_slot", "act_arrival", "act_late")}
    arrays |= {name: np.full(shape, grad_slots, np.int32) for name in ("grad_slot", "grad_arrival", "grad_late")}
    slot_arrays = {f"{name}_{use}": {s: np.full(shape, slots[s][1], np.int32) for s in SEGMENTS}
                   for name, slots in (("saved", saved_slots), ("crossover", crossover_slots))
                   for use in ("slot", "write")}
    for tick, row in enumerate(table):
        for stage, action in enumerate(row):
            if action is None:
                continue
            kind, i, k = schedule.work(action, stage)
            arrays["kind"][tick, stage], arrays["role"][tick, stage] = 1 + KINDS.index(kind), ROLES.index(_role(k, positions))
            arrays["microbatch"][tick, stage], arrays["chunk"][tick, stage] = i, action.virtual
            arrays["act_slot"][tick, stage] = act_slot_of.get((stage, i, k), act_slots)
            arrays["grad_slot"][tick, stage] = grad_slot_of.get((stage, i, k), grad_slots)
            for s in SEGMENTS:
                for name, slots, writer in (("saved", saved_slots, "F"), ("crossover", crossover_slots, "B")):
                    slot = slots[s][0].get((stage, i, k), slots[s][1])
                    slot_arrays[f"{name}_{'write' if kind == writer else 'slot'}"][s][tick, stage] = slot
    # A send whose values no stage reads in the next tick goes late: in that tick, beside its
    # compute, which it then need not wait for (nor it for the send).
    first_read = {"act": {key: done["F", key[1], key[2]] for key in acts}, "grad": {key: end for key, (_, end) in grads.items()}}
    for name, values, slot_of in (("act", acts, act_slot_of), ("grad", grads, grad_slot_of)):
        reads = {}
        for key, (start, _) in values.items():
            reads.setdefault(start, []).append(first_read[name][key])
        late = {tick for tick, ticks in reads.items() if min(ticks) > tick + 1}
        for (stage, i, k), (start, _) in values.items():
            arrays[f"{name}_late" if start in late else f"{name}_arrival"][start + (start in late), stage] = slot_of[stage, i, k]
    return Program(**arrays, **slot_arrays,
                   sends_forward=(arrays["act_arrival"] != act_slots).any(axis=1),
                   sends_backward=(arrays["grad_arrival"] != grad_slots).any(axis=1),
                   late_forward=(arrays["act_late"] != act_slots).any(axis=1),
                   late_backward=(arrays["grad_late"] != grad_slots).any(axis=1),
                   act_slots=act_slots, grad_slots=grad_slots,
                   saved_slots={s: saved_slots[s][1] for s in SEGMENTS},
                   crossover_slots={s: crossover_slots[s][1] for s in SEGMENTS})
