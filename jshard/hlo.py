"""What a compiled program communicates: its collectives, by kind, with bytes per device.

Counted from the optimized HLO text (`jax.jit(f).lower(...).compile().as_text()`), so it
is exact: what XLA will run, after its own combining and rewriting. A collective inside
a loop (the scan over layers) counts once per trip. Bytes follow the textbook's K for
each kind (see docs/strategies.md):

    all-reduce          the reduced buffer                    (ring cost 2(N-1)/N · K)
    all-gather          the gathered result                   ((N-1)/N · K)
    reduce-scatter      the buffer before scattering          ((N-1)/N · K)
    all-to-all          the buffer each device sends          ((N-1)/N · K)
    collective-permute  the buffer each device sends          (K)

XLA:CPU has no bf16 collectives: it widens each to f32 (converts around it), and so would
double what a bf16 program moves. Given the program as jshard lowered it (StableHLO, what a
GPU runs), `collectives(..., program=)` counts each buffer in the dtype the program gave it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import re

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_OP = re.compile(r"=\s*(?P<result>\(.*?\)|\S+)\s+(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
SHAPE = re.compile(r"\b(?P<dtype>pred|f8\w*|[suf]\d+|bf16|c64|c128)\[(?P<dims>[\d,]*)\]")
_ITEMSIZE = {"pred": 1, "bf16": 2, "c64": 8, "c128": 16}  # and f8e4m3fn, f8e5m2, ...: 1
# What XLA:CPU widens a collective's buffer to (it has no bf16 or FP8 collectives).
_WIDENED = {"bf16": "f32", "f8e4m3fn": "f16", "f8e5m2": "f16"}
WHILE = re.compile(r"\swhile\(.*body=%(?P<body>[\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"')
_INDUCTION = re.compile(r'"known_induction_variable":\{"tuple_index":"(?P<i>\d+)"')
_LOOP_PARTS = re.compile(r"\swhile\(%(?P<init>[\w.\-]+)\).*condition=%(?P<condition>[\w.\-]+)")
_BELOW = re.compile(r"compare\(%[\w.\-]+, %(?P<limit>[\w.\-]+)\), direction=LT")
_S32 = re.compile(r"^\s*%(?P<name>[\w.\-]+) = s32\[\] (?:constant\((?P<value>-?\d+)\)|copy\(%(?P<source>[\w.\-]+)\))")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition)=%(?P<name>[\w.\-]+)")  # (a conditional's: `branches`)
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_PREDICATED = re.compile(r"true_computation=%(?P<true>[\w.\-]+), false_computation=%(?P<false>[\w.\-]+)")
# XLA prints replica groups in three forms (group size in brackets):
#   a list           replica_groups={{0,2},{1,3}}                                  (2)
#   an iota          replica_groups=[2,2]<=[4]  or  [2,4]<=[2,2,2]T(1,0,2)         (the last dim)
#   mesh axes        replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp'}               (4)
#                    ... mesh['x'=8] {'x':(1)2}  (a sub-axis: pre-size 1, size 2)  (2)
# JAX <= 0.10 emits the first two; JAX >= 0.11 the mesh form for shard_map collectives.
_GROUPS_LIST = re.compile(r"replica_groups=\{(?P<groups>\{[\d,]*\}(?:,\{[\d,]*\})*)?\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(?P<dims>[\d,]+)\]<=")
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[(?P<mesh>[^\]]*)\].*?\s\{(?P<axes>(?:'?[\w.\-]+'?(?::\(\d+\)\d+)?,?)*)\}"
)
_MESH_AXIS = re.compile(r"'?(?P<name>[\w.\-]+)'?=(?P<size>\d+)")
_GROUP_AXIS = re.compile(r"'?(?P<name>[\w.\-]+)'?(?::\(\d+\)(?P<sub>\d+))?")
_PARTITIONS = re.compile(r"\bnum_partitions=(?P<n>\d+)")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=")


def _group_size(line: str, devices: int) -> int:
    """How many devices take part together in the collective on this HLO line.

    `devices` is the program's device count, the group of an empty list (`{}`: everyone).
    """
    if m := _GROUPS_MESH.search(line):
        sizes = {a["name"]: int(a["size"]) for a in _MESH_AXIS.finditer(m["mesh"])}
        return math.prod(int(a["sub"] or sizes[a["name"]]) for a in _GROUP_AXIS.finditer(m["axes"]))
    if m := _GROUPS_IOTA.search(line):
        return int(m["dims"].split(",")[-1])
    if m := _GROUPS_LIST.search(line):
        if not m["groups"]:
            return devices
        return len([d for d in m["groups"][1:].split("}")[0].split(",") if d])
    return 1


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    buffers: tuple[int, ...]  # K of each buffer it moves (a combined collective moves several)
    count: float  # executions per program run (loop trips; a conditional's branch by its weight: a mean device's)
    group: int  # devices taking part together
    line: str
    dtypes: tuple[str, ...] = ()  # each buffer's, as compiled (a combined one's may differ: bf16 and FP8 weights)
    name: str = ""  # its HLO instruction (an asynchronous one's start)
    asynchronous: bool = False  # split into a start and a done, which the schedule may move apart

    @property
    def bytes(self) -> int:
        """K per execution, per device, as above; 0 for a group of one device, which moves
        nothing (XLA:CPU keeps a psum over a mesh axis of size 1, e.g. `data=1`)."""
        return sum(self.buffers) if self.group > 1 or self.kind == "collective-permute" else 0


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """{computation name: its instruction lines}, and the entry computation's name."""
    blocks, current, entry = {}, None, ""
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            current = blocks.setdefault(m["name"], [])
            entry = m["name"] if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return blocks, entry


def loop_trips(line: str, blocks: dict[str, list[str]], holder: str) -> int:
    """How many times the loop on HLO `line` (in computation `holder`) runs its body: XLA's
    known_trip_count; else, where XLA:GPU peeled the first trip off a loop and left no count (a
    gradient accumulation's), `i < K` read from its condition from i's start in its init tuple
    (a constant, through copies), one a trip; else 1."""
    if t := _TRIPS.search(line):
        return int(t["n"])
    parts, index = _LOOP_PARTS.search(line), _INDUCTION.search(line)
    if not parts or not index:
        return 1

    def s32(lines, name):  # a scalar's constant value, following copies; None if it is not one
        found = {m["name"]: m for m in map(_S32.match, lines) if m}
        while name in found and found[name]["value"] is None:
            name = found[name]["source"]
        return int(found[name]["value"]) if name in found else None

    condition = [parts["condition"]] + [m["name"] for line in blocks.get(parts["condition"], []) for m in _CALLED.finditer(line)]
    limit = next((s32(blocks[c], m["limit"]) for c in condition if c in blocks for line in blocks[c]
                  if (m := _BELOW.search(line))), None)
    init = next((line for line in blocks[holder] if re.match(rf"^\s*%{re.escape(parts['init'])} = .* tuple\(", line)), None)
    operands = re.findall(r"%([\w.\-]+)", init.split(" tuple(", 1)[1]) if init else []
    start = s32(blocks[holder], operands[int(index["i"])]) if int(index["i"]) < len(operands) else None
    return limit - start if limit is not None and start is not None and limit > start else 1


def branches(line: str) -> list[str]:
    """A conditional's computations in the order of its branch index (a predicate's: false,
    true, as `lax.cond` numbers them); [] for any other instruction."""
    if found := _BRANCHES.search(line):
        return [n.strip().lstrip("%") for n in found["names"].split(",")]
    return [found["false"], found["true"]] if (found := _PREDICATED.search(line)) else []


def _executions(blocks: dict[str, list[str]], entry: str, branch_weights=None) -> dict[str, float]:
    """How many times each computation runs per program run: loop bodies once per trip, each
    branch of a conditional every time (an upper bound), unless `branch_weights(line)` (as
    `matmul_flops` takes it) says how often each runs."""
    runs: dict[str, float] = collections.Counter({entry: 1})
    pending = [entry]
    while pending:
        name = pending.pop(0)
        for line in blocks[name]:
            if arms := branches(line):
                weights = branch_weights(line) if branch_weights else None
                for i, arm in enumerate(arms):
                    if arm in blocks:
                        runs[arm] += runs[name] * (1 if weights is None else weights[i])
                        pending.append(arm)
                continue
            loop = WHILE.search(line)
            trips = loop_trips(line, blocks, name) if loop else 1
            for callee in filter(blocks.__contains__, (m["name"] for m in _CALLED.finditer(line))):
                runs[callee] += runs[name] * (trips if loop and callee == loop["body"] else 1)
                pending.append(callee)
    return runs


_PROGRAM_OP = re.compile(r'"stablehlo\.(?P<kind>all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)"')
_PROGRAM_TYPES = re.compile(r"[)>]\s*:\s*\((?P<operands>[^)]*)\)\s*->\s*(?P<results>.*)$")
_TENSOR = re.compile(r"tensor<(?P<dims>(?:\d+x)*)(?P<dtype>[a-z]+\d*(?:[A-Z]+\d*)*)>")  # f32, bf16, f8E4M3FN
_SPLIT_COUNT = re.compile(r"split_count = (?P<n>\d+)")
_PROGRAM_GROUPS = re.compile(r"replica_groups = dense<(\[\[[\d, \[\]]*\]\])>")
_PROGRAM_MESH_AXES = re.compile(r"replica_group_mesh_axes<[^>]*?axes = \[(?P<axes>[^\]]*)\]")


def program_dtypes(program_text: str) -> dict[tuple, set[str]]:
    """{(kind, elements of K): the dtypes the program gives such buffers}, from StableHLO text;
    also {(kind, elements, replica groups or mesh axes): ...} for ops that name them (two collectives
    of one size over other axes, say a bf16 activation's over `tensor` and an fp32 gradient's
    over `data`, are told apart by their groups)."""
    found: dict[tuple, set[str]] = collections.defaultdict(set)
    kind, parts, groups = None, 1, None
    for line in program_text.splitlines():
        if m := _PROGRAM_OP.search(line):
            kind = m["kind"].replace("_", "-")
            parts = int(n["n"]) if kind == "all-to-all" and (n := _SPLIT_COUNT.search(line)) else 1
            if dense := _PROGRAM_GROUPS.search(line):  # JAX <= 0.10: device ids
                groups = frozenset(frozenset(dims_of(g)) for g in re.findall(r"\[([\d, ]+)\]", dense[1]))
            elif named := _PROGRAM_MESH_AXES.search(line):  # JAX >= 0.11: mesh axes, by name
                groups = frozenset(re.findall(r'name = "([^"]+)"', named["axes"]))
            else:
                groups = None
        if kind and (types := _PROGRAM_TYPES.search(line)):
            # K: the operand of a reduce-scatter, the result of the others (module docstring)
            for t in _TENSOR.finditer(types["operands" if kind == "reduce-scatter" else "results"]):
                elements = math.prod(int(d) for d in t["dims"].split("x") if d)
                dtype = {"i1": "pred"}.get(t["dtype"], t["dtype"].lower())
                for n in (elements, elements // parts) if parts > 1 else (elements,):  # XLA:CPU sends an
                    found[kind, n].add(dtype)                                       # all-to-all's parts apart
                    if groups:
                        found[kind, n, groups].add(dtype)
            kind = None
    return found


def _top_level(result: str) -> list[str]:
    """A result type's top-level parts: "((a, b), (c, d))" -> ["(a, b)", "(c, d)"]; "f32[4]" -> ["f32[4]"]."""
    if not result.startswith("("):
        return [result]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(result):
        depth += {"(": 1, ")": -1, "[": 1, "]": -1, "{": 1, "}": -1}.get(ch, 0)
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            parts.append(result[start:i].strip())
            start = i + 1
    return [p for p in parts if SHAPE.search(p)]


def _k_shapes(kind: str, result: str, start: bool, group: int) -> list[tuple[str, int]]:
    """(dtype, elements) of each buffer of K (the module docstring) on an HLO line whose result
    type is `result`. An asynchronous start returns (operands, results) (K: the results; a
    reduce-scatter's, the operands before scattering; XLA before 2025 gave an all-reduce's results
    alone), or (operand, result, contexts) for a permute (K: what is sent; XLA:GPU's combined
    permutes, ((operands), (results))); a synchronous reduce-scatter returns its scattered part
    (K: group times it)."""
    def shapes(text: str) -> list[tuple[str, int]]:
        return [(m["dtype"], math.prod(dims_of(m["dims"]))) for m in SHAPE.finditer(text)]

    parts = _top_level(result)
    if start and kind == "collective-permute":
        return shapes(parts[0]) if parts[0].startswith("(") else shapes(result)[:1]
    if start and len(parts) == 2 and (parts[0].startswith("(") or kind != "all-reduce"):
        return shapes(parts[0] if kind == "reduce-scatter" else parts[1])
    scale = group if kind == "reduce-scatter" and not start else 1
    return [(dtype, n * scale) for dtype, n in shapes(result)]


def itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype) or (1 if dtype.startswith("f8") else int(dtype[1:]) // 8)


def collectives(hlo_text: str, program: str | None = None, branch_weights=None) -> list[Collective]:
    """Every collective of a compiled HLO module, with how often it runs (inside a conditional,
    on every run unless `branch_weights` says how often: `_executions`); with the lowered
    `program` (StableHLO text), its buffers in the program's dtypes (see the module docstring)."""
    asked = program_dtypes(program) if program else {}
    blocks, entry = computations(hlo_text)
    runs = _executions(blocks, entry, branch_weights)
    devices = int(m["n"]) if (m := _PARTITIONS.search(hlo_text)) else 1
    found = []
    for name, lines in blocks.items():
        for line in lines:
            if not (m := _OP.search(line)):
                continue
            group = _group_size(line, devices)
            groups = (_groups(line, devices) or _named_axes(line)) if asked else None
            buffers, dtypes = [], []
            for dtype, elements in _k_shapes(m["kind"], m["result"], bool(m["start"]), group):
                # The program's dtype for buffers of this kind and size (over these groups, where
                # the program names them); where it has such buffers in two dtypes, the one
                # XLA:CPU widens to the compiled one; else (or none) the compiled one stands.
                asked_dtypes = asked.get((m["kind"], elements, groups)) or asked.get((m["kind"], elements), set())
                if len(asked_dtypes) > 1:
                    asked_dtypes = {d for d in asked_dtypes if _WIDENED.get(d, d) == dtype}
                buffers.append(elements * itemsize(next(iter(asked_dtypes)) if len(asked_dtypes) == 1 else dtype))
                dtypes.append(dtype)
            found.append(Collective(m["kind"], tuple(buffers), runs.get(name, 0), group, line.strip(),
                                    tuple(dtypes), _NAME.match(line)["name"], bool(m["start"])))
    return found


def bytes_by_kind(hlo_text: str, program: str | None = None, branch_weights=None) -> dict[str, int]:
    """{kind: bytes per device per program run}, for the kinds present."""
    totals: dict[str, float] = collections.Counter()
    for c in collectives(hlo_text, program, branch_weights):
        totals[c.kind] += c.bytes * c.count
    return {kind: round(n) for kind, n in totals.items() if n}


# -- matmul FLOPs ---------------------------------------------------------------------------

_DEFINE = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<dtype>pred|[suf]\d+|bf16)\[(?P<dims>[\d,]*)\]")
DOT = re.compile(r"\bdot\(%(?P<lhs>[\w.\-]+),.*lhs_contracting_dims=\{(?P<contracted>[\d,]*)\}")


def dims_of(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _own_flops(lines: list[str]) -> int:
    """2·M·N·K of each dot in one computation (called computations not included)."""
    shapes, flops = {}, 0
    for line in lines:
        if m := _DEFINE.match(line):
            shapes[m["name"]] = dims_of(m["dims"])
            if dot := DOT.search(line):
                lhs = shapes.get(dot["lhs"], [])
                flops += 2 * math.prod(shapes[m["name"]]) * math.prod(lhs[d] for d in dims_of(dot["contracted"]) if d < len(lhs))
    return flops


def matmul_flops(hlo_text: str, branch_weights=None) -> float:
    """Matmul FLOPs (2·M·N·K per dot, fused or not) per program run on one device: loop
    bodies once per trip. A conditional counts its costliest branch, unless
    `branch_weights(line)` (given the conditional's HLO line) returns how often each branch
    (`branches`, in index order) runs per run of the computation holding it (a pipeline's tick
    table, say: `parallel.tick_branches.TickBranches`), or None to keep the costliest."""
    blocks, entry = computations(hlo_text)
    own = {name: _own_flops(lines) for name, lines in blocks.items()}
    memo: dict[str, float] = {}

    def total(name: str) -> float:
        if name in memo:
            return memo[name]
        flops = float(own[name])
        for line in blocks[name]:
            loop = WHILE.search(line)
            trips = loop_trips(line, blocks, name) if loop else 1
            if arms := branches(line):
                costs = [total(n) if n in blocks else 0.0 for n in arms]
                weights = branch_weights(line) if branch_weights else None
                flops += sum(w * c for w, c in zip(weights, costs)) if weights is not None else max(costs, default=0)
                continue
            for callee in (m["name"] for m in _CALLED.finditer(line)):
                if callee in blocks and not (loop and callee != loop["body"]):
                    flops += total(callee) * (trips if loop else 1)
        memo[name] = flops
        return flops

    return total(entry)


# -- what a collective waits for ----------------------------------------------------------

# One instruction: its name, result type (a tuple's in parentheses), opcode and operands.
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>\(.*?\)|\S+)\s+(?P<op>[\w\-]+)\((?P<args>[^)]*)\)")


# -- the kernels a program launches --------------------------------------------------------

CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]+)"')


_KERNEL_TARGETS = (("cublas", "__cublas"), ("cudnn", "__cudnn"), ("triton", "__gpu$xla.gpu.triton"))


def kernel_counts(hlo_text: str) -> dict[str, int]:
    """The launches written in an optimized GPU program, by kind (each instruction once, not
    per loop trip): XLA's fusions, cuBLAS matmuls (and of them, `cublas_fp8`: FP8 GEMMs), cuDNN
    calls (attention), Triton kernels (Pallas's: `nn.flash`), other custom calls. Two compiles of one step compare by these (a device's
    own against a deviceless one)."""
    counts = dict(fusion=0, cublas=0, cublas_fp8=0, cudnn=0, triton=0, other=0)
    for line in hlo_text.splitlines():
        if not (m := INSTRUCTION.match(line)) or m["op"] not in ("fusion", "custom-call"):
            continue
        if m["op"] == "fusion":
            counts["fusion"] += 1
            continue
        target = t["target"] if (t := CUSTOM_CALL_TARGET.search(line)) else ""
        kind = next((k for k, prefix in _KERNEL_TARGETS if target.startswith(prefix)), "other")
        counts[kind] += 1
        counts["cublas_fp8"] += target.startswith("__cublas") and target.endswith("$f8")
    return counts


def callees(line: str) -> list[str]:
    return [m["name"] for m in _CALLED.finditer(line)] + branches(line)


def permutes_waiting_for_matmuls(hlo_text: str) -> list[bool]:
    """For each instruction that runs a collective-permute (the permute, or the conditional or
    call holding it) and no matmul, in a computation that runs matmuls (a loop body): whether
    it waits for one of them, through its operands. One that does not can run beside that
    compute (on a GPU, asynchronously)."""
    blocks, _ = computations(hlo_text)
    memo: dict[tuple[str, str], bool] = {}

    def runs(name: str, op: str) -> bool:  # whether computation `name` runs an `op`, directly or not
        if (name, op) not in memo:
            memo[name, op] = False
            memo[name, op] = any(f" {op}(" in line or any(runs(c, op) for c in callees(line) if c in blocks)
                                 for line in blocks[name])
        return memo[name, op]

    def line_runs(line: str, op: str) -> bool:
        return f" {op}(" in line or any(runs(c, op) for c in callees(line) if c in blocks)

    found = []
    for computation, lines in blocks.items():
        if not runs(computation, "dot"):  # only where compute and sends meet (a loop body, say)
            continue
        parsed = {m["name"]: (m, line) for line in lines if (m := INSTRUCTION.match(line))}
        for name, (m, line) in parsed.items():
            if not line_runs(line, "collective-permute") or line_runs(line, "dot"):
                continue
            seen, pending, waits = set(), re.findall(r"%([\w.\-]+)", m["args"]), False
            while pending and not waits:
                operand = pending.pop()
                if operand in seen or operand not in parsed:
                    continue
                seen.add(operand)
                waits = line_runs(parsed[operand][1], "dot")
                pending += re.findall(r"%([\w.\-]+)", parsed[operand][0]["args"])
            found.append(waits)
    return found


# -- which mesh axes a collective runs over, and what the schedule puts beside it -----------


def group_axes(line: str, mesh_axes: dict[str, int]) -> tuple[str, ...] | None:
    """The mesh axes (in mesh order, size > 1) whose devices a collective's groups are, for a
    program partitioned over a mesh of `mesh_axes` (name: size, in order; partition i is the
    i-th device of the mesh in row-major order); a collective-permute's: the axes its pairs move
    along. None where its groups are no such set."""
    if m := _GROUPS_MESH.search(line):
        named = [a["name"] for a in _GROUP_AXIS.finditer(m["axes"]) if a["name"]]
        return tuple(a for a in mesh_axes if a in named and mesh_axes[a] > 1)
    ids = np.arange(math.prod(mesh_axes.values())).reshape(tuple(mesh_axes.values()) or (1,))
    if pairs := _PAIRS.search(line):
        moved = set()
        for source, target in re.findall(r"\{(\d+),(\d+)\}", pairs[0]):
            at = np.unravel_index([int(source), int(target)], ids.shape)
            moved |= {axis for axis, (a, b) in enumerate(at) if a != b}
        return tuple(name for axis, name in enumerate(mesh_axes) if axis in moved)
    groups = _groups(line, ids.size)
    if groups is None:
        return None
    live = [a for a, n in mesh_axes.items() if n > 1]
    for k in range(len(live) + 1):
        for axes in itertools.combinations(live, k):
            if groups == _axes_groups(ids, list(mesh_axes), axes):
                return axes
    return None


def _axes_groups(ids: np.ndarray, names: list[str], axes: tuple[str, ...]) -> frozenset:
    """The groups of devices that differ only along `axes` (each a frozenset of positions)."""
    moved = np.moveaxis(ids, [names.index(a) for a in axes], range(ids.ndim - len(axes), ids.ndim))
    size = math.prod(ids.shape[names.index(a)] for a in axes)
    return frozenset(frozenset(g.tolist()) for g in moved.reshape(-1, size))


_IOTA = re.compile(r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")


def _named_axes(line: str) -> frozenset | None:
    """The mesh axes a collective in the mesh form of replica groups names; None in the others."""
    if m := _GROUPS_MESH.search(line):
        return frozenset(a["name"] for a in _GROUP_AXIS.finditer(m["axes"]) if a["name"])
    return None


def _groups(line: str, devices: int) -> frozenset | None:
    """A collective's replica groups as a set of frozensets of positions (list or iota form);
    a collective-permute's source-target pairs are no groups: None."""
    if m := _IOTA.search(line):
        dims = dims_of(m["dims"])
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m["perm"]:
            ids = ids.transpose(dims_of(m["perm"]))
        return frozenset(frozenset(g.tolist()) for g in ids.reshape(dims_of(m["shape"])))
    if m := _GROUPS_LIST.search(line):
        if not m["groups"]:
            return frozenset({frozenset(range(devices))})
        return frozenset(frozenset(dims_of(g)) for g in re.findall(r"\{([\d,]*)\}", m["groups"]))
    return None


_PAIRS = re.compile(r"source_target_pairs=\{(?:\{\d+,\d+\},?)*\}")
_DONE = re.compile(r"\s(?:[\w\-]+-done|async-done)\(%(?P<start>[\w.\-]+)\)")
# cuBLAS's GEMMs, cuDNN's attention, and Triton kernels (Pallas's: jshard's flash attention, `nn.flash`)
_LIBRARY_MATMUL = re.compile(r'custom_call_target="__(?:cublas|cudnn|gpu\$xla\.gpu\.triton)')


def overlapped(hlo_text: str) -> dict[str, bool]:
    """For each asynchronous collective's start in a scheduled module (XLA:GPU's, whose
    instruction order is the schedule): whether a matmul (a dot, a fusion or call that runs one,
    a cuBLAS, cuDNN or Triton call) is scheduled between its start and its done, so that the transfer
    can hide behind it."""
    blocks, _ = computations(hlo_text)
    memo: dict[str, bool] = {}

    def runs_matmul(name: str) -> bool:
        if name not in memo:
            memo[name] = False
            memo[name] = any(is_matmul(line) for line in blocks[name])
        return memo[name]

    def is_matmul(line: str) -> bool:
        return (" dot(" in line or bool(_LIBRARY_MATMUL.search(line))
                or any(runs_matmul(c) for c in callees(line) if c in blocks))

    found = {}
    for lines in blocks.values():
        started: dict[str, int] = {}
        for i, line in enumerate(lines):
            if (m := _NAME.match(line)) and re.search(r"\s[\w\-]+-start\(", line):
                started[m["name"]] = i
            elif (done := _DONE.search(line)) and done["start"] in started:
                found[done["start"]] = any(is_matmul(between) for between in lines[started[done["start"]] + 1:i])
    return found
