"""The pipeline executor's tick table read back onto its compiled program.

`pipelining.value_and_grad` traces each tick's choices as `lax.cond`s (one per kind of
action, a switch over the stage's role inside each, one around each send, one per padding
row of an uneven stack, one around a backward's sums of the params outside the stack), each
in a named scope. XLA keeps them conditionals inside the scan
over ticks, where which branch runs depends on the device's stage and the tick. A reading of
the program that took every branch (`hlo.collectives`) or the costliest (`hlo.matmul_flops`,
`planner.schedule`) on every tick would charge each tick a forward and a backward of the last
stage's, and a send where none goes; `TickBranches` says which branch runs, from the
executor's own table (`tick_program.compile_program`).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from jshard import hlo
from jshard.parallel.pipelining import ENDS_SCOPE, PADDING_SCOPE, SEND_SCOPES, layer_mask
from jshard.parallel.schedules import Schedule
from jshard.parallel.tick_program import KINDS, ROLES, Program, compile_program

_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')


def _scopes(line: str) -> list[str]:
    """The names of the scopes an HLO instruction was traced in (its op_name metadata)."""
    return m["name"].split("/") if (m := _OP_NAME.search(line)) else []


@dataclasses.dataclass(frozen=True)
class TickBranches:
    """Which branch of each of the executor's conditionals (found by the scope it names each
    with) a device of each stage runs: per tick (`taken`, for a timeline) or how often
    (`weights`, for a count)."""

    program: Program
    stages: int
    mask: np.ndarray | None  # `layer_mask`: [position, row], which rows of a chunk hold a layer

    @classmethod
    def of(cls, schedule: Schedule, stage_remat: str = "none", stage_layers: tuple[int, ...] | None = None):
        return cls(compile_program(schedule, stage_remat), schedule.stages, layer_mask(stage_layers))

    @property
    def ticks(self) -> int:
        return self.program.kind.shape[0]

    def chooses(self, line: str) -> tuple[str, str | None] | None:
        """What the conditional on HLO `line` decides, by its innermost scope: ("kind", "F") an
        action of that kind or nothing, ("role", "F") the role inside that kind's action,
        ("send", "sends_forward") a send, ("padding", None) a row of the stack, ("ends", "BW")
        that kind's sums of the params outside the stack (at the first and last positions only);
        None: none of the executor's."""
        scopes = _scopes(line)[:-1]  # (the last: the primitive, `cond`)
        inner = scopes[-1] if scopes else ""
        kind = next((n[len("pipeline_"):] for n in reversed(scopes) if n.startswith("pipeline_")), None)
        if inner == PADDING_SCOPE:
            return "padding", None
        if inner == ENDS_SCOPE:
            return "ends", kind
        if inner in SEND_SCOPES:
            return "send", inner
        if kind in KINDS and inner in (f"pipeline_{kind}", "role"):
            return ("kind" if inner != "role" else "role"), kind
        return None

    def taken(self, line: str, stage: int, tick: int, trip: int) -> int | None:
        """The branch of the conditional on HLO `line` that a device of `stage` runs at `tick`,
        on trip `trip` of the loop around it (a stack's row: a chunk's first rows hold its
        layers); None where it is none of the executor's."""
        chosen, program = self.chooses(line), self.program
        if chosen is None:
            return None
        what, name = chosen
        if what == "send":
            return int(getattr(program, name)[tick])
        if what == "kind":
            return int(program.kind[tick, stage] == 1 + KINDS.index(name))
        if what == "role":
            return int(program.role[tick, stage])
        if what == "ends":
            return int(program.role[tick, stage] != ROLES.index("middle"))
        position = program.chunk[tick, stage] * self.stages + stage
        return 1 if self.mask is None else int(trip < self.mask[position].sum())

    def weights(self, line: str, stage: int | None = None) -> np.ndarray | None:
        """How often a device of `stage` runs each branch of the conditional on `line`, per run
        of the computation holding it (None: over all stages, the mean); None where it is none
        of the executor's. Every stage runs each kind of action equally often, so the mean is a
        mean device's."""
        if (chosen := self.chooses(line)) is None:
            return None
        if stage is None:
            return np.mean([self.weights(line, s) for s in range(self.stages)], axis=0)
        (what, name), program = chosen, self.program
        if what == "send":
            runs = getattr(program, name).mean()
            return np.array([1 - runs, runs])
        if what == "padding":  # (every action of a kind runs each of the stage's chunks equally often)
            layers = self.mask[stage::self.stages].mean() if self.mask is not None else 1.0
            return np.array([1 - layers, layers])
        of_kind = program.kind[:, stage] == 1 + KINDS.index(name)
        if what == "role":
            return np.bincount(program.role[:, stage][of_kind], minlength=len(ROLES)) / max(of_kind.sum(), 1)
        if what == "ends":
            ends = (program.role[:, stage][of_kind] != ROLES.index("middle")).mean() if of_kind.any() else 0.0
            return np.array([1 - ends, ends])
        return np.array([1 - of_kind.mean(), of_kind.mean()])  # (no, yes)


def matmul_flops(schedule: Schedule, hlo_text: str, stage_remat: str = "none",
                 stage_layers: tuple[int, ...] | None = None) -> list[float]:
    """Per stage, the matmul FLOPs a device of that stage runs in one step of the compiled
    program `hlo_text` (`hlo.matmul_flops`; XLA's `cost_analysis()` counts a loop body once
    and a conditional's costliest branch), each of the executor's conditionals weighted by how
    often that stage runs each branch (`TickBranches.weights`)."""
    branches = TickBranches.of(schedule, stage_remat, stage_layers)
    return [hlo.matmul_flops(hlo_text, lambda line, stage=stage: branches.weights(line, stage))
            for stage in range(schedule.stages)]

