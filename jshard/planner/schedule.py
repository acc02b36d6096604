"""A compiled GPU program's step, timed along its own schedule.

XLA:GPU's optimized HLO lists each computation's instructions in the order they run, and an
asynchronous collective runs between its start and its done, beside whatever the schedule puts
there. This walks that order with two clocks: the compute stream's, advanced by each kernel's
time, and the links', on which each collective runs in the order it was started, from its start
or when the one before it ends. A done whose transfer has not ended waits for it: that wait is
the collective's exposed time. A loop runs its body trip by trip, so a collective started before
a loop and done after it hides behind the trips between (XLA:GPU's pipeliner keeps a start and
its done in one trip: it moves the next trip's transfer into this one). A conditional runs its
longest branch, except a pipeline's: given the tick table (`parallel.tick_branches.TickBranches`),
the scan over ticks runs each tick once per stage, each taking the branches its row says (its
action's kind, its role, a send or none), and the tick lasts as long as its slowest stage.

Each kernel is timed by the planner's physics, from its shapes in the HLO:

- a cuBLAS GEMM by its shape's roofline (`physics.gemm_seconds`: the measured sweep where the
  device kind has one, else the datasheet at `matmul_efficiency`); a fusion around a dot likewise;
- cuDNN's fused attention by its FLOPs (4·b·h·s·s'·d forward, twice that backward: the count
  `physics.ATTENTION_EFFICIENCY` was measured at);
- jshard's flash kernels (Triton) likewise, 4·b·h·s·s'·d FLOPs each of the forward, dq and dkv
  kernels (what the planner charges them);
- every other kernel (XLA's fusions, copies) by the bytes it reads and writes at streaming
  bandwidth: a fused operand only sliced counts its slices, an in-place update its update (and
  the slot it reads back, where it does);
- a collective by its link's latency and bandwidth (`physics.collective_seconds`), its axes read
  off its replica groups;
- a loop's trip as `physics.loop_seconds` says, each kernel's launch gap `physics.LAUNCH_GAP_S`
  (both where the device kind has a measured sweep).

Where `hlo.overlapped` asks only whether some matmul is scheduled between a start and its done,
this says how much of the transfer the work scheduled there covers: the optimizer's memory-bound
updates hide a gradient's reduce-scatter as well as a matmul does, and one small matmul does not
hide a gather ten times longer. What it does not model: two streams of compute, collectives
slowing the kernels beside them (they share HBM and SMs), and the links' contention between two
collectives in flight (the second waits for the first).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from jshard import hlo
from jshard.mesh import STANDARD_AXES as AXES
from jshard.planner import physics
from jshard.planner.hardware import Hardware, link, nodes

_OPERAND = re.compile(r"%([\w.\-]+)")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id",
         "opt-barrier", "add-dependency", "iota"}
_GEMM_CONFIG = re.compile(r'"dot_dimension_numbers":\{(?P<dims>[^}]*)\}')
_FLASH = re.compile(r"jshard_flash_(?:forward|dq|dkv)\b")  # (`nn.flash`'s kernels, named in their metadata)
_ATTENTION_SHAPE = re.compile(r'"intermediate_tensor_shape":\s*\{"element_type":\s*"\w+",\s*"dimensions":\s*\[(?P<dims>[^\]]*)\]')


def _shapes(type_text: str) -> list[tuple[str, list[int]]]:
    """(dtype, dims) of each array in an HLO type (a tuple's, in order)."""
    return [(m["dtype"], hlo.dims_of(m["dims"])) for m in hlo.SHAPE.finditer(type_text)]


def _nbytes(type_text: str) -> int:
    return sum(math.prod(dims) * hlo.itemsize(dtype) for dtype, dims in _shapes(type_text))


def _gemm_dtype(dtype: str) -> str:
    """An operand's HLO dtype as `physics.gemm_seconds` names the rates it keeps."""
    return "fp8" if dtype.startswith("f8") else "bf16" if dtype == "bf16" else "f32"


@dataclasses.dataclass
class Timed:
    """A collective as the schedule runs it, summed over its executions: its seconds on the
    link, and those of them no work covered. A done that waits charges each transfer on the
    link during its wait the part of the wait it ran (its own, and those started before it)."""

    kind: str
    axes: str
    bytes: int  # per execution, per device (`hlo.Collective.bytes`)
    executions: int = 0
    seconds: float = 0.0
    exposed: float = 0.0


@dataclasses.dataclass
class Timeline:
    """The step along its schedule: `seconds` in all, `compute` of them the kernels and loop
    trips (the rest the step waited on collectives), and each collective by its start's name."""

    seconds: float
    compute: float
    collectives: dict[str, Timed]

    def _sums(self, key) -> dict:
        """{key(c): [seconds exposed, seconds]} over the collectives."""
        totals: dict = {}
        for c in self.collectives.values():
            row = totals.setdefault(key(c), [0.0, 0.0])
            row[0], row[1] = row[0] + c.exposed, row[1] + c.seconds
        return dict(sorted(totals.items()))

    def hidden(self) -> dict[tuple[str, str], float]:
        """{(kind, axes): the share of their time that work beside them covers}, as the planner
        keys its traffic (collectives that take no time left out)."""
        return {k: max(0.0, 1 - e / s) for k, (e, s) in self._sums(lambda c: (c.kind, c.axes)).items() if s}

    def hidden_by_kind(self) -> dict[str, float]:
        """{kind: the share of its time covered}, over its axes."""
        return {k: max(0.0, 1 - e / s) for k, (e, s) in self._sums(lambda c: c.kind).items() if s}

    def exposed(self) -> dict[tuple[str, str], float]:
        """{(kind, axes): seconds the step waited on them}."""
        return {k: e for k, (e, _) in self._sums(lambda c: (c.kind, c.axes)).items()}

    def as_json(self) -> dict:
        return dict(step_s=self.seconds, compute_s=self.compute, waiting_s=self.seconds - self.compute,
                    hidden=self.hidden_by_kind(),
                    exposed_s={f"{kind} {axes}": seconds for (kind, axes), seconds in self.exposed().items()},
                    collectives={n: dataclasses.asdict(c) for n, c in self.collectives.items()})


class _Program:
    """One HLO module's computations, and what timing them needs (read once)."""

    def __init__(self, hlo_text: str, mesh: dict[str, int], hw: Hardware, ticks=None):
        self.blocks, self.entry = hlo.computations(hlo_text)
        self.ticks, self.lane, self.trips = ticks, None, []  # (the lane: the stage and tick being run)
        mesh = {a: mesh.get(a, 1) for a in AXES}
        self.hw, self.gap = hw, physics.LAUNCH_GAP_S if physics.measured(hw.name) else 0.0
        self.types = {m["name"]: m["type"] for lines in self.blocks.values() for m in map(hlo.INSTRUCTION.match, lines) if m}
        self.links: dict[str, tuple[float, Timed]] = {}  # a collective's name: (seconds an execution, its row)
        for c in hlo.collectives(hlo_text):
            axes = hlo.group_axes(c.line, mesh)
            if axes:  # its link, and its group's size, from the mesh axes it runs over (a permute's too)
                bandwidth, kind_of_link = link("+".join(axes), mesh, hw)
                group, hosts = math.prod(mesh[a] for a in axes), nodes("+".join(axes), mesh, hw)
            else:  # groups that are no set of mesh axes: inside a node if they fit one
                group, hosts = c.group, -(-c.group // hw.gpus_per_node)
                bandwidth, kind_of_link = (hw.intra_bw, "intra") if hosts == 1 else (hw.inter_bw, "inter")
            seconds = physics.collective_seconds(c.kind, c.bytes, group, kind_of_link, bandwidth, hosts)
            self.links[c.name] = (seconds, Timed(c.kind, "+".join(axes) if axes else "?", c.bytes))
        # An `async-start` that wraps a collective (XLA's unsugared form) runs it.
        for line in (line for lines in self.blocks.values() for line in lines if " async-start(" in line):
            start = hlo.INSTRUCTION.match(line)["name"]
            inner = [i["name"] for c in hlo.callees(line) if c in self.blocks
                     for i in filter(None, map(hlo.INSTRUCTION.match, self.blocks[c])) if i["name"] in self.links]
            if inner and start not in self.links:
                self.links[start] = self.links.pop(inner[0])
        self.kernel_memo: dict[str, float] = {}
        self.compute = 0.0  # seconds of kernels and loop trips run so far

    # -- one kernel ----------------------------------------------------------------------------

    def kernel_seconds(self, line: str, op: str, result: str, operands: list[str]) -> float:
        if op == "custom-call":
            target = t["target"] if (t := hlo.CUSTOM_CALL_TARGET.search(line)) else ""
            if target.startswith("__cublas"):
                return self.gemm_seconds(line, operands)
            if target.startswith("__cudnn$fmha"):
                return self.attention_seconds(line, operands, backward="Backward" in target)
            if _FLASH.search(line):
                return self.flash_seconds(operands)
        if op in ("fusion", "fusion-start"):  # (an asynchronous fusion: timed as one, its done free)
            callee = next((c for c in hlo.callees(line) if c in self.blocks), None)
            if op == "fusion-start" and callee:
                result = next((m["type"] for m in map(hlo.INSTRUCTION.match, self.blocks[callee]) if m and "ROOT" in m[0]),
                              result)
            if callee and (dot := next((l for l in self.blocks[callee] if " dot(" in l), None)):
                return self.dot_seconds(dot) + self.gap
            # a cuBLAS call fused with the slices of its operands it reads in place (XLA's
            # dynamic_slice_fusion: a GEMM on a layer's slice of a stacked residual)
            if callee and (gemm := next((l for l in self.blocks[callee] if '"__cublas' in l), None)):
                return self.gemm_seconds(gemm, _OPERAND.findall(hlo.INSTRUCTION.match(gemm)["args"]))
            return self.fusion_bytes(callee, result, operands) / self.hw.stream_bw + self.gap
        if op == "copy-start":  # an asynchronous copy: its operand read and written
            return 2 * sum(_nbytes(self.types.get(o, "")) for o in operands) / self.hw.stream_bw + self.gap
        # an unfused copy, slice or other op: reads and writes its result's bytes
        return 2 * _nbytes(result) / self.hw.stream_bw + self.gap

    def gemm_seconds(self, line: str, operands: list[str]) -> float:
        """A cuBLAS call: (batch) m × k @ k × n, from its operands' shapes and its dimension numbers."""
        config = _GEMM_CONFIG.search(line)
        numbers = json.loads("{" + config["dims"] + "}") if config else {}
        lhs, rhs = (_shapes(self.types.get(o, ""))[:1] for o in operands[:2])
        if not lhs or not rhs:
            return self.gap
        (dtype, a), (_, b) = lhs[0], rhs[0]
        contract = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
        batch = [int(d) for d in numbers.get("lhs_batch_dimensions", [])]
        rhs_skip = {int(d) for d in numbers.get("rhs_contracting_dimensions", []) + numbers.get("rhs_batch_dimensions", [])}
        m = math.prod(n for i, n in enumerate(a) if i not in contract and i not in batch)
        n = math.prod(x for i, x in enumerate(b) if i not in rhs_skip)
        k = math.prod(a[i] for i in contract)
        return math.prod(a[i] for i in batch) * physics.gemm_seconds(m, n, k, _gemm_dtype(dtype), self.hw) + self.gap

    def dot_seconds(self, line: str) -> float:
        """A dot inside a fusion (a Triton GEMM): its result's rows × its last dim, over k."""
        m = hlo.INSTRUCTION.match(line)
        out = _shapes(m["type"]) if m else []
        lhs = _shapes(self.types.get(_OPERAND.findall(m["args"])[0], "")) if m and m["args"] else []
        contracted = hlo.DOT.search(line)
        if not out or not lhs or not contracted or not out[0][1]:
            return 0.0
        k = math.prod(lhs[0][1][int(d)] for d in hlo.dims_of(contracted["contracted"]))
        dims = out[0][1]
        return physics.gemm_seconds(math.prod(dims[:-1]), dims[-1], k, _gemm_dtype(lhs[0][0]), self.hw)

    def attention_seconds(self, line: str, operands: list[str], backward: bool) -> float:
        """cuDNN's flash attention: b·h query rows of s over s' keys, head dim d from the queries;
        4·b·h·s·s'·d FLOPs forward, twice that backward, counted as `ATTENTION_EFFICIENCY` was
        measured (a causal kernel's, at the model-FLOPs count that does not halve it)."""
        scores = _ATTENTION_SHAPE.search(line)
        queries = _shapes(self.types.get(operands[0], "")) if operands else []
        dims = hlo.dims_of(scores["dims"].replace('"', "").replace(" ", "")) if scores else []
        if len(dims) != 4 or not queries:
            return self.gap
        b, h, s, s_kv = dims
        flops = 4 * b * h * s * s_kv * queries[0][1][-1] * (2 if backward else 1)
        return flops / (self.hw.peak_flops * physics.ATTENTION_EFFICIENCY) + self.gap

    def flash_seconds(self, operands: list[str]) -> float:
        """One of jshard's flash kernels (`nn.flash`, Triton): queries (b, s, h, d) over keys
        (b, s', h, d), its first two operands in each of the forward and the two backward kernels
        (dq, dkv); 4·b·h·s·s'·d FLOPs each, the count the planner charges them at cuDNN's rate
        (their own is unmeasured)."""
        queries, keys = (_shapes(self.types.get(o, ""))[:1] for o in operands[:2]) if len(operands) > 1 else ([], [])
        if not queries or not keys or len(queries[0][1]) != 4 or len(keys[0][1]) != 4:
            return self.gap
        (_, (b, s, h, d)), (_, (_, s_kv, _, _)) = queries[0], keys[0]
        return 4 * b * h * s * s_kv * d / (self.hw.peak_flops * physics.ATTENTION_EFFICIENCY) + self.gap

    def fusion_bytes(self, callee: str | None, result: str, operands: list[str]) -> int:
        """What a fusion reads and writes: each operand whole, but one it only slices (its slices)
        or updates in place (nothing read; its update written in place of the whole)."""
        if callee is None:
            return sum(_nbytes(self.types.get(o, "")) for o in operands) + _nbytes(result)
        lines = self.blocks[callee]
        params, users = {}, {}
        for line in lines:
            if not (m := hlo.INSTRUCTION.match(line)):
                continue
            if m["op"] == "parameter":
                params[int(m["args"])] = m["name"]
            for i, name in enumerate(_OPERAND.findall(m["args"])):
                users.setdefault(name, []).append((m["op"], i, m["type"], line))
        def uses(name):  # its users, through bitcasts (a relabelling, no kernel of its own)
            found = []
            for op, i, type_text, line in users.get(name, []):
                found += uses(hlo.INSTRUCTION.match(line)["name"]) if op == "bitcast" else [(op, i, type_text, line)]
            return found

        read, written = 0, _nbytes(result)
        for index, operand in enumerate(operands):
            used = uses(params.get(index, ""))
            sliced = [t for op, i, t, _ in used if op in ("dynamic-slice", "slice", "gather") and i == 0]
            updated = [line for op, i, _, line in used if op == "dynamic-update-slice" and i == 0]
            if not used or len(sliced) + len(updated) < len(used):
                read += _nbytes(self.types.get(operand, ""))
                continue
            read += sum(map(_nbytes, sliced))
            for line in updated:  # the buffer updated in place (a slot read back beside it, say): the update written
                update = _OPERAND.findall(hlo.INSTRUCTION.match(line)["args"])[1]
                written += _nbytes(self.types.get(update, "")) - _nbytes(self.types.get(operand, ""))
        return read + max(written, 0)

    # -- the schedule --------------------------------------------------------------------------

    def run(self, name: str, clock: float, links_free: float, carried: dict) -> tuple[float, float]:
        """Run computation `name` from `clock` with the links free from `links_free`; returns both
        clocks after it. `carried`: the transfers in flight, by their start's name: (begin, end)."""
        for line in self.blocks[name]:
            if not (m := hlo.INSTRUCTION.match(line)):
                continue
            op, operands = m["op"], _OPERAND.findall(m["args"])
            if op in _FREE:
                continue
            if m["name"] in self.links and op.endswith("-start"):
                links_free = self.start(m["name"], clock, links_free, carried)
                continue
            if op.endswith("-done"):
                if operands and operands[0] in carried:
                    clock = self.wait(operands[0], clock, carried)
                continue
            if m["name"] in self.links:  # a synchronous collective: started and waited for at once
                links_free = self.start(m["name"], clock, links_free, carried)
                clock = self.wait(m["name"], clock, carried)
                continue
            if op == "while":
                body = hlo.WHILE.search(line)["body"]
                trips = hlo.loop_trips(line, self.blocks, name)
                ticking = self.lane is None and self._runs_ticks(body) and trips == self.ticks.ticks
                for trip in range(trips):
                    self.trips.append(trip)
                    lanes = [(stage, trip) for stage in range(self.ticks.stages)] if ticking else [self.lane]
                    clock, links_free = self._slowest([(body, lane) for lane in lanes], clock, links_free, carried)
                    self.trips.pop()
                    clock += physics.loop_seconds(1, self.hw)
                    self.compute += physics.loop_seconds(1, self.hw)
                continue
            if op == "call":
                clock, links_free = self.run(hlo.callees(line)[0], clock, links_free, carried)
                continue
            if op == "conditional":  # the branch the tick table says, else its longest
                arms = hlo.branches(line)
                taken = self.ticks.taken(line, *self.lane, self.trips[-1] if self.trips else 0) if self.lane else None
                if taken is not None:
                    clock, links_free = self.run(arms[taken], clock, links_free, carried)
                    continue
                clock, links_free = self._slowest([(arm, self.lane) for arm in arms if arm in self.blocks],
                                                  clock, links_free, carried)
                continue
            key = m["name"]
            if key not in self.kernel_memo:
                self.kernel_memo[key] = self.kernel_seconds(line, op, m["type"], operands)
            clock += self.kernel_memo[key]
            self.compute += self.kernel_memo[key]
        return clock, links_free


    def _slowest(self, runs: list, clock: float, links_free: float, carried: dict) -> tuple[float, float]:
        """Each of `runs`, (computation, lane) pairs, from the same state: a conditional's
        branches, or a pipeline tick's stages (lanes (stage, tick) of the loop's body); the
        slowest one's clocks and state kept. (A tick ends when its slowest stage does: the next
        waits on its sends.)"""
        lane = self.lane
        if len(runs) == 1:
            (computation, self.lane), = runs
            clocks, self.lane = self.run(computation, clock, links_free, carried), lane
            return clocks
        before, outcomes = self._state(carried), []
        for computation, self.lane in runs:
            self._restore(before, carried)
            outcomes.append((self.run(computation, clock, links_free, carried), self._state(carried)))
        self.lane = lane
        (clock, links_free), after = max(outcomes, key=lambda r: r[0], default=((clock, links_free), before))
        self._restore(after, carried)
        return clock, links_free

    def _runs_ticks(self, body: str) -> bool:
        """Whether loop `body` is a pipeline's scan over ticks: it runs a conditional the tick
        table decides per tick (an action's kind or a send), directly or in a call."""
        if self.ticks is None:
            return False
        for line in self.blocks[body]:
            if hlo.branches(line) and (self.ticks.chooses(line) or ("", ""))[0] in ("kind", "send"):
                return True
            if " call(" in line and any(self._runs_ticks(c) for c in hlo.callees(line) if c in self.blocks):
                return True
        return False

    def start(self, name: str, clock: float, links_free: float, carried: dict) -> float:
        """Collective `name` put on the links at `clock`, after those before it: in flight in
        `carried` (its begin and end); returns when the links are free again."""
        seconds, row = self.links[name]
        begin = max(clock, links_free)
        carried[name] = (begin, begin + seconds)
        row.executions, row.seconds = row.executions + 1, row.seconds + seconds
        return begin + seconds

    def wait(self, name: str, clock: float, carried: dict) -> float:
        """The compute clock after `name`'s done, from `clock`: if its transfer has not ended, it
        waits, and each transfer on the links meanwhile (this one, and those in flight before
        it) is charged the part of the wait it ran."""
        end = carried[name][1]
        if end > clock:
            for other, (begin, until) in carried.items():
                self.links[other][1].exposed += max(0.0, min(until, end) - max(begin, clock))
        del carried[name]
        return max(clock, end)

    def _state(self, carried: dict) -> tuple:
        rows = {name: (row.executions, row.seconds, row.exposed) for name, (_, row) in self.links.items()}
        return self.compute, rows, dict(carried)

    def _restore(self, state: tuple, carried: dict) -> None:
        self.compute, rows, kept = state
        for name, (executions, seconds, exposed) in rows.items():
            row = self.links[name][1]
            row.executions, row.seconds, row.exposed = executions, seconds, exposed
        carried.clear()
        carried.update(kept)


def timeline(hlo_text: str, mesh: dict[str, int], hw: Hardware, ticks=None) -> Timeline:
    """The step of a scheduled (optimized GPU) HLO module on `hw`, along its schedule; `mesh`:
    its axes' sizes (to name each collective's axes and so its link). A pipeline's `ticks`
    (`parallel.tick_branches.TickBranches`, `aot.GpuProgram.ticks`): each tick run as each stage
    runs it, the branches its row of the table takes, and timed as the slowest stage."""
    program = _Program(hlo_text, mesh, hw, ticks)
    seconds, _ = program.run(program.entry, 0.0, 0.0, {})
    rows = {name: row for name, (_, row) in program.links.items() if row.executions}
    return Timeline(seconds, program.compute, rows)
