"""The sharding-spec layer: logical axis names -> mesh axes.

Models name the dims of their params (`out_sharding` metadata on Flax NNX Variables) and
of their activations (`constrain(x, names)`). A `Rules` object maps those names onto mesh
axes; every PartitionSpec in jshard is derived here, and nowhere else.

Resolution, for one tensor with logical names `names`:
- Rules are ordered; earlier rules take priority. Each rule `(name, axes)` gives every
  not-yet-assigned dim called `name` the mesh `axes` (one axis, a tuple of axes sharded
  jointly, or None for "replicated, on purpose").
- A mesh axis shards at most one dim of a tensor. A rule whose axis is already taken in
  this tensor is skipped, and a later rule for the same name may apply (a fallback you
  wrote). If none does, that is an error, never a silent replication.
- Every logical name must have a rule, every mesh axis named must exist, and every
  sharded dim must divide by the product of its axes' sizes.

Params, gradients and optimizer state share one table, `params`, which gives the fully
sharded layout. `zero` says which of them use it (ZeRO stage 1: optimizer state; 2: and
gradients; 3: and params); the others drop the ZeRO axes -- the mesh axes that shard both
the batch and some param dim the activations keep whole, `fsdp` in the presets (not
`expert`, which splits `experts` in both) -- and are replicated over them.
Activations have their own table: `embed` shards a weight over `fsdp` but never an
activation.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, Union

import jax
from jax.sharding import Mesh

from jshard.mesh import STANDARD_AXES, mesh_shape

Axes = Union[None, str, tuple[str, ...]]
Kind = Literal["param", "grad", "opt"]

LOGICAL_NAMES = ("batch", "seq", "embed", "mlp", "heads", "kv_heads", "kv", "vocab", "layers", "experts")
ATTENTION_NAMES = ("batch", "seq", "heads", "kv")  # how attention's queries, keys and values are named
CONTEXT_ATTENTION = ("ring", "gather", "a2a")
ZERO_KINDS = {"opt": 1, "grad": 2, "param": 3}  # lowest ZeRO stage that shards each kind


class ShardingError(ValueError):
    """Rules that do not fit a mesh, a model or an activation. Raised before device work."""


def axes_of(axes: Axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def layout_of(spec) -> tuple[tuple[str, ...], ...]:
    """A PartitionSpec as a layout: one tuple of mesh axes per dim, `((data, fsdp), (), (tensor,))`."""
    return tuple(axes_of(entry) for entry in spec)


def _normalise(table, label: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    pairs = table.items() if isinstance(table, Mapping) else table
    out = []
    for pair in pairs:
        if not (isinstance(pair, Sequence) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ShardingError(f"{label} rule {pair!r} is not a (logical name, mesh axes) pair")
        name, axes = pair[0], axes_of(pair[1])
        if len(set(axes)) != len(axes):
            raise ShardingError(f"{label} rule {name!r} -> {axes} names a mesh axis twice")
        out.append((name, axes))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Rules:
    """Ordered rules from logical names to mesh axes, for params and for activations."""

    params: tuple = ()
    activations: tuple = ()
    zero: int = 3
    name: str = "custom"
    # An unnamed 1-D param (a bias, a norm scale) is replicated and flagged by `describe`;
    # strict rules refuse it, as they refuse every unnamed param that the mesh could split.
    strict: bool = False
    # Attention over a `seq` the rules split (context parallelism, `jshard.nn.context_parallel.context_attention`):
    # "ring" passes keys and values round the axes, "gather" all-gathers them, "a2a" trades the
    # sequence split for a heads split around attention (all-to-all, DeepSpeed-Ulysses).
    context_attention: str = "ring"
    # Sequence parallelism's gather before a column-parallel matmul and reduce-scatter after a
    # row-parallel one as collective matmuls: ppermute steps beside partial matmuls
    # (`jshard.nn.collective_matmul`).
    collective_matmul: bool = False
    # A model written with JAX's own sharding annotations names mesh axes, not logical names: a
    # PartitionSpec in a param's metadata, or its array's NamedSharding. This table renames its
    # author's axes onto jshard's, `(("tp", "tensor"),)`; jshard's own axis names need no entry.
    model_axes: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "params", _normalise(self.params, "param"))
        object.__setattr__(self, "activations", _normalise(self.activations, "activation"))
        object.__setattr__(self, "model_axes", _model_axes(self.model_axes))
        if self.zero not in (0, 1, 2, 3):
            raise ShardingError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.context_attention not in CONTEXT_ATTENTION:
            raise ShardingError(f"context_attention must be one of {', '.join(CONTEXT_ATTENTION)}, "
                                f"got {self.context_attention!r}")

    def add(self, params=(), activations=()) -> Rules:
        """These rules first (they take priority), then the existing ones."""
        return dataclasses.replace(
            self,
            params=_normalise(params, "param") + self.params,
            activations=_normalise(activations, "activation") + self.activations,
        )

    def with_mesh_axes(self, table: Mapping[str, str]) -> Rules:
        """These rules for a model whose params carry PartitionSpecs over its author's mesh axes,
        `table` renaming each onto a jshard axis: `preset("dp+fsdp+tp").with_mesh_axes({"tp": "tensor"})`.
        The model's layout is then its own; the preset picks the ZeRO stage and the batch axes."""
        return dataclasses.replace(self, model_axes=_model_axes(table))

    def check_model_axes(self, specs: dict[str, jax.P], sizes: dict[str, int]) -> None:
        """Every mesh axis the model's PartitionSpecs (`specs`: path -> spec) name is jshard's or renamed
        onto one (`model_axes`): else one error for them all, before any param's own."""
        rename = dict(self.model_axes)
        unknown = {a: [] for spec in specs.values() for entry in spec for a in axes_of(entry)
                   if rename.get(a, a) not in sizes}
        for path, spec in specs.items():
            for axis in {a for entry in spec for a in axes_of(entry)} & set(unknown):
                unknown[axis].append(path)
        if unknown:
            axis, paths = next(iter(unknown.items()))
            shown = ", ".join(repr(p) for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
            raise ShardingError(
                f"the model's PartitionSpecs name mesh axis {', '.join(map(repr, unknown))} (params {shown}), which "
                f"jshard's mesh does not have ({', '.join(sizes)}). Fix: rename each onto one of jshard's, e.g. "
                f"rules.with_mesh_axes({{{axis!r}: 'tensor'}}).")

    def mesh_spec(self, spec, shape, sizes: dict[str, int], kind: Kind = "param", where="tensor") -> jax.P:
        """A PartitionSpec over the model author's mesh axes (`model_axes`) as one over jshard's:
        renamed, ZeRO axes dropped below the ZeRO stage (as `table` drops them), checked against the
        mesh, axes of size 1 left out. `P()` (or any spec shorter than the rank) leaves the remaining dims whole."""
        shape = tuple(shape)
        if len(spec) > len(shape):
            raise ShardingError(f"{where}: PartitionSpec {spec} has {len(spec)} entries for a tensor of rank "
                                f"{len(shape)} (shape {shape}). Fix: give at most one entry per dim.")
        rename, keep = dict(self.model_axes), set(self.zero_axes) if self.zero >= ZERO_KINDS[kind] else set()
        entries, seen = [], set()
        for dim, entry in enumerate(spec):
            axes = []
            for axis in axes_of(entry):
                ours = rename.get(axis, axis)
                if ours not in sizes:
                    raise ShardingError(
                        f"{where}: PartitionSpec {spec} names mesh axis {axis!r}, which is not one of jshard's "
                        f"({', '.join(sizes)}). Fix: rename the model's axes onto jshard's, e.g. "
                        f"rules.with_mesh_axes({{{axis!r}: 'tensor'}}).")
                if ours in seen:
                    raise ShardingError(f"{where}: PartitionSpec {spec} puts mesh axis {ours!r} on two dims. "
                                        "Fix: rename the model's axes onto distinct jshard axes (rules.with_mesh_axes).")
                seen.add(ours)
                if ours in self.zero_axes and ours not in keep or sizes[ours] == 1:
                    continue  # held whole over the ZeRO axes below their stage; an axis of 1 splits nothing
                axes.append(ours)
            n = math.prod(sizes[a] for a in axes)
            if shape[dim] % n:
                raise ShardingError(
                    f"{where}: dim {dim} (size {shape[dim]}) of PartitionSpec {spec} does not divide by "
                    f"{'×'.join(f'{a}={sizes[a]}' for a in axes)}. Fix: make the size a multiple of {n} or change the mesh.")
            entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
        return jax.P(*entries)

    @property
    def zero_axes(self) -> tuple[str, ...]:
        """Mesh axes that shard both the tokens (the batch, or the sequence: context parallelism's
        devices, like data-parallel ones, hold the same params and sum their gradients) and some
        param dim that activations keep whole: the ZeRO / FSDP axes, whose weights are gathered to
        meet the rows. An axis that splits a param dim as it splits the activations of that name
        (`experts` over `expert`, `heads` over `tensor`) is where that part of the computation
        happens: the rows travel to it (all-to-all), not the weight."""
        rows = {a for name, axes in self.activations if name in ("batch", "seq") for a in axes}
        computed_in_place = {a for rule in self.params if rule in self.activations for a in rule[1]}
        return tuple(dict.fromkeys(a for _, axes in self.params for a in axes
                                   if a in rows and a not in computed_in_place))

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """Every mesh axis some rule names: the standard ones in mesh order, then any other."""
        named = {a for _, axes in self.params + self.activations for a in axes}
        return tuple(a for a in STANDARD_AXES if a in named) + tuple(sorted(named - set(STANDARD_AXES)))

    def table(self, kind: Kind | Literal["activation"]) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The rules that lay out `kind`; kinds below the ZeRO stage drop the ZeRO axes."""
        if kind == "activation":
            return self.activations
        if self.zero >= ZERO_KINDS[kind]:
            return self.params
        drop = set(self.zero_axes)
        return tuple((name, tuple(a for a in axes if a not in drop)) for name, axes in self.params)

    # -- checks against a mesh -------------------------------------------------------

    def check_mesh(self, mesh: Mesh) -> None:
        """Every mesh axis the rules name exists, and every axis of size > 1 is used."""
        sizes = mesh_shape(mesh)
        problems = _unknown_axes(self.params, sizes, "param rule") + _unknown_axes(self.activations, sizes, "activation rule")
        used = {a for _, axes in self.params + self.activations for a in axes}
        for axis, size in sizes.items():
            if size > 1 and axis not in used:
                problems.append(
                    f"mesh axis {axis!r} has size {size}, but no rule of {self.name!r} maps a "
                    f"logical name to it: the {size} devices along it would all do the same work. "
                    f"Fix: choose a preset that uses {axis!r} (see jshard.rules.PRESET_PARTS) or "
                    f"give it size 1."
                )
        raise_problems(problems)

    # -- one tensor ------------------------------------------------------------------

    def spec(self, names, shape, mesh, kind: Kind | Literal["activation"] = "param", where="tensor") -> jax.P:
        """The PartitionSpec of one tensor with logical `names` and global `shape`.

        `shape=None` skips the divisibility check: inside `shard_map`, where only the local
        shape is known and the global one was checked when the step was built.
        """
        shape = (None,) * len(tuple(names)) if shape is None else tuple(shape)
        spec, _ = resolve(self.table(kind), tuple(names), shape, mesh_shape(mesh), where)
        return spec

    def axes(self, name: str, mesh, kind: Kind | Literal["activation"] = "activation", split: bool = False) -> tuple[str, ...]:
        """The mesh axes that logical dim `name` lives on (`split`: only those of size > 1)."""
        sizes = mesh_shape(mesh)
        return tuple(a for a in axes_of(self.spec((name,), None, mesh, kind)[0]) if not split or sizes[a] > 1)

    def context_axes(self, mesh) -> tuple[str, ...]:
        """The mesh axes (of size > 1) that split attention's `seq`: context parallelism's. A step
        sums gradients over them as over the batch axes (each device saw its chunks' tokens)."""
        seq = axes_of(self.spec(ATTENTION_NAMES, None, mesh, "activation")[1])
        return tuple(a for a in seq if mesh_shape(mesh)[a] > 1)

    def __str__(self) -> str:
        def fmt(table):
            # The trailing "replicated on purpose" rules are listed as one group.
            tail = len(table)
            while tail and not table[tail - 1][1]:
                tail -= 1
            mapped = ", ".join(f"{n}->{'+'.join(a) if a else '-'}" for n, a in table[:tail])
            rest = ", ".join(n for n, _ in table[tail:])
            return "; ".join(part for part in (mapped, rest and f"{'else ' if mapped else ''}replicated: {rest}") if part)

        context = f", {self.context_attention} attention over a split seq" if any(
            name == "seq" and axes and "context" in axes for name, axes in self.activations) else ""
        context += ", collective matmuls" if self.collective_matmul else ""
        renamed = f"\n  model axes:  {', '.join(f'{a}->{b}' for a, b in self.model_axes)}" if self.model_axes else ""
        return (
            f"Rules {self.name!r} (ZeRO stage {self.zero}{context})\n"
            f"  params:      {fmt(self.params)}\n  activations: {fmt(self.activations)}{renamed}"
        )


def _model_axes(table) -> tuple[tuple[str, str], ...]:
    pairs = tuple(table.items() if isinstance(table, Mapping) else table)
    bad = [pair for pair in pairs if not (isinstance(pair, Sequence) and len(pair) == 2
                                          and all(isinstance(a, str) for a in pair))]
    if bad:
        raise ShardingError(f"mesh axes entry {bad[0]!r} is not a (model's mesh axis, jshard mesh axis) pair of names")
    return tuple((a, b) for a, b in pairs)


def _unknown_axes(table, sizes: dict[str, int], label: str) -> list[str]:
    return [
        f"{label} {name!r} -> {axis!r} names a mesh axis the mesh does not have (axes: "
        f"{', '.join(sizes)}). Fix: build the mesh with {axis}=N (jshard.make_mesh always has "
        "data, stage, fsdp, context, expert, tensor) or change the rule."
        for name, axes in table for axis in axes if axis not in sizes
    ]


def raise_problems(problems: list[str]) -> None:
    """Every problem found, as one line: the first whole (what, where, the fix), then where the
    others are (`where: what` each; most are the same problem of another param)."""
    if len(problems) == 1:
        raise ShardingError(problems[0])
    if problems:
        others = [p.split(": ", 1)[0] for p in problems[1:]]
        shown = ", ".join(others[:8]) + (f" and {len(others) - 8} more" if len(others) > 8 else "")
        raise ShardingError(f"{problems[0]} ({len(problems)} sharding problems; the others at {shown})")


def resolve(table, names, shape, sizes, where):
    """(PartitionSpec, notes) for one tensor; notes name dims that took a fallback rule."""
    if len(names) != len(shape):
        raise ShardingError(
            f"{where}: {len(names)} logical names {names} for a tensor of rank {len(shape)} "
            f"(shape {shape}). Fix: give exactly one name (or None) per dim."
        )
    known = {name for name, _ in table}
    unknown = [n for n in names if n is not None and n not in known]
    if unknown:
        raise ShardingError(
            f"{where}: logical name {unknown[0]!r} (dim {names.index(unknown[0])}, names {names}) "
            f"has no rule. Fix: add one, e.g. rules.add(params=[({unknown[0]!r}, None)]) to "
            "replicate it on purpose, or map it to a mesh axis."
        )
    raise_problems(_unknown_axes([(n, a) for n, a in table if n in names], sizes, f"{where}: rule"))
    assigned: list[tuple[str, ...] | None] = [() if n is None else None for n in names]
    owner: dict[str, int] = {}  # mesh axis -> the dim it shards
    clashes: dict[int, str] = {}
    notes = []
    for name, axes in table:
        for dim, dim_name in enumerate(names):
            if dim_name != name or assigned[dim] is not None:
                continue
            taken = [a for a in axes if a in owner]
            if taken:
                clashes[dim] = (
                    f"rule {name!r} -> {axes} cannot apply: mesh axis {taken[0]!r} already shards "
                    f"dim {owner[taken[0]]} ({names[owner[taken[0]]]!r})"
                )
                continue
            n_shards = math.prod(sizes[a] for a in axes)
            over = "×".join(f"{a}={sizes[a]}" for a in axes) + (f" = {n_shards}" if len(axes) > 1 else "")
            if name == "layers" and shape[dim] is not None and shape[dim] % n_shards:
                # A pipeline's uneven stages: its step pads the stack to split it (`make_plan`);
                # outside the step JAX splits a dim only evenly, so the model holds it whole.
                assigned[dim] = ()
                continue
            if shape[dim] is not None and shape[dim] % n_shards:
                raise ShardingError(
                    f"{where}: dim {dim} ({name!r}, size {shape[dim]}) does not divide by {over}. Fix: make the size "
                    f"a multiple of {n_shards}, change the mesh, or map {name!r} elsewhere."
                )
            if dim in clashes:
                notes.append(f"dim {dim} ({name!r}) fell back to {axes or 'replicated'}: {clashes[dim]}")
            assigned[dim] = axes
            owner.update({a: dim for a in axes})
    for dim, axes in enumerate(assigned):
        if axes is None:
            raise ShardingError(
                f"{where}: {clashes[dim]}; a mesh axis may shard only one dim of a tensor. "
                f"Fix: map one of the two names to another axis, or add a fallback rule "
                f"({names[dim]!r}, None) after it."
            )
    entries = [None if not a else a[0] if len(a) == 1 else a for a in assigned]
    return jax.P(*entries), notes


# -- presets ---------------------------------------------------------------------------

PRESET_PARTS = {
    "dp": "batch over `data`; params replicated",
    "zero1": "batch over `fsdp`; optimizer state sharded over `fsdp`",
    "zero2": "as zero1, and gradients sharded over `fsdp`",
    "zero3": "as zero2, and params sharded over `fsdp` (alias: fsdp)",
    "tp": "Megatron tensor parallel: heads, mlp and vocab over `tensor`",
    "sp": "tp plus sequence parallel: the residual stream's seq over `tensor`",
    "sp-overlap": "as sp, its gathers and reduce-scatters done as collective matmuls: ppermute steps, each "
                  "beside a partial matmul",
    "pp": "pipeline: the stacked `layers` over `stage`",
    "cp": "context parallel: every activation's seq over `context`, load-balanced; ring attention",
    "cp-gather": "as cp, with attention all-gathering keys and values instead of the ring",
    "cp-a2a": "as cp, in order; around attention an all-to-all trades the seq split for a heads split "
              "(DeepSpeed-Ulysses): each device attends over the whole sequence with its heads, "
              "by the model's kernel (cuDNN's flash on a GPU)",
    "ep": "expert parallel: a mixture of experts' `experts` over `expert`, rows sent to them by all-to-all; "
          "elsewhere the batch over `expert` too",
}

# The context-parallel parts and the attention each takes (`Rules.context_attention`).
CONTEXT_PRESETS = {"cp": "ring", "cp-gather": "gather", "cp-a2a": "a2a"}


def preset(name: str, strict: bool = False) -> Rules:
    """Rules for a strategy or a '+'-joined combination, e.g. 'dp+fsdp+tp+sp+pp' (`strict`: see Rules)."""
    parts = [p.strip() for p in name.lower().replace("fsdp", "zero3").split("+")]
    unknown = [p for p in parts if p not in PRESET_PARTS]
    if unknown:
        raise ShardingError(
            f"unknown strategy {unknown[0]!r} in preset {name!r}. Known: "
            f"{', '.join(PRESET_PARTS)} and 'fsdp' (= zero3), joined with '+'."
        )
    zeros = [int(p[-1]) for p in parts if p.startswith("zero")]
    if len(zeros) > 1:
        raise ShardingError(f"preset {name!r} names more than one ZeRO stage; pick one")
    overlap = "sp-overlap" in parts
    tp, sp = "tp" in parts or "sp" in parts or overlap, "sp" in parts or overlap
    named = [p for p in parts if p in CONTEXT_PRESETS]
    if len(named) > 1:
        raise ShardingError(f"preset {name!r} names both {named[0]} and {named[1]}; pick one")
    cp = bool(named)

    # Priority order matters only where two names want one axis: attention activations
    # (batch, seq, heads or kv_heads, kv) give `tensor` to the heads, and seq falls back to
    # replicated. A Llama's grouped KV heads split over `tensor` as its query heads do.
    tensor_names = [("vocab", "tensor"), ("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor")] if tp else []
    batch_axes = tuple(a for a, on in (("data", "dp" in parts), ("fsdp", bool(zeros))) if on)
    # Expert parallelism: `expert` holds its own rows of the batch (data parallel) everywhere
    # but in the experts, which it splits; a MoE layer's buffer of rows per expert names both
    # dims, so `experts` takes the axis there and its rows fall back to the other batch axes:
    # laying the buffer out from one to the other is an all-to-all over `expert`.
    experts = [("experts", "expert")] if "ep" in parts else []
    batch = [("batch", batch_axes + ("expert",)), ("batch", batch_axes)] if experts else [("batch", batch_axes)]
    zero_axes = ("fsdp", "context") if named else "fsdp"
    params = tensor_names + experts + ([("embed", zero_axes)] if zeros else []) + ([("layers", "stage")] if "pp" in parts else [])
    # Context parallelism splits seq over `context` everywhere; with sequence parallelism the
    # residual stream's seq is split over `tensor` too, within each device's context block,
    # and attention's (whose heads hold `tensor`) falls back to `context` alone.
    seq = [("seq", ("context", "tensor")), ("seq", "context")] if cp and sp else (
        [("seq", "context")] if cp else [("seq", "tensor")] if sp else [])
    activations = experts + batch + tensor_names + seq
    replicated = [(n, None) for n in LOGICAL_NAMES]  # every other name: replicated, on purpose
    canonical = "+".join(p for p in PRESET_PARTS if (p in parts and not (p == "sp" and overlap)) or (p == "tp" and tp))
    return Rules(params + replicated, activations + replicated, zero=zeros[0] if zeros else 0, name=canonical,
                 strict=strict, context_attention=CONTEXT_PRESETS[named[0]] if named else "ring",
                 collective_matmul=overlap)


# -- activations -----------------------------------------------------------------------

_active: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("jshard_rules", default=None)


@contextlib.contextmanager
def use_rules(rules: Rules):
    """Within this block, layers lay out activations by `rules` (on the mesh in context)."""
    token = _active.set(rules)
    try:
        yield
    finally:
        _active.reset(token)


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Rules):
    """Within this block, `constrain` lays out activations by `rules` on `mesh`."""
    rules.check_mesh(mesh)
    with use_rules(rules), jax.set_mesh(mesh):
        yield


def active_rules() -> Rules | None:
    return _active.get()


def manual_axes() -> frozenset[str]:
    """The mesh axes split by hand here: all of them inside a jshard step's shard_map."""
    return frozenset(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def constrain(x: jax.Array, names: Iterable[str | None]) -> jax.Array:
    """Lay out activation `x`, whose dims are called `names`, as the active rules say.

    Outside `activate(...)` this is the identity, so models also run on one device.
    Inside `shard_map` layouts change only by explicit collectives (`jshard.nn.relayout`),
    so it is the identity there too.
    """
    rules = _active.get()
    if rules is None or manual_axes():
        return x
    names = tuple(names)
    spec = rules.spec(names, x.shape, jax.sharding.get_abstract_mesh(), "activation", where=f"activation {names}")
    return jax.lax.with_sharding_constraint(x, spec)


def named(*names: str | None) -> dict:
    """Metadata naming a Flax Variable's dims: `nnx.Linear(..., kernel_metadata=named('embed', 'mlp'))`."""
    return {"out_sharding": names}
