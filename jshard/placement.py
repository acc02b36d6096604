"""Putting Flax NNX models on a mesh by their rules: specs, sharded init, and a report.

    model = jshard.init(lambda: GPT(config, rngs=nnx.Rngs(0)), mesh, rules)
    print(jshard.describe(model, mesh, rules))

`init` resolves every spec on an abstract model (`nnx.eval_shape`) first, so bad rules
fail before any device work, then creates each param directly in its shards: a model too
big for one device never exists whole on one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import flax
import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jshard.mesh import STANDARD_AXES, mesh_shape
from jshard.precision import Precision
from jshard.rules import ZERO_KINDS, Kind, Rules, ShardingError, axes_of, layout_of, raise_problems, resolve


@dataclasses.dataclass(frozen=True)
class Placement:
    """How one Variable is laid out on the mesh."""

    path: str
    names: tuple | None
    shape: tuple[int, ...]
    dtype: np.dtype  # or a PRNG key's dtype (an RNG stream's key), which also has an itemsize
    spec: jax.P
    bytes_per_device: int
    flags: tuple[str, ...]  # why this layout may not be what the strategy wanted
    fp8: bool = False  # a projection's kernel, whose product an `fp8` policy runs in FP8 (`nn.Linear`'s metadata)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def value_of(leaf):
    """A leaf's array: a Variable's value, or the leaf itself (a bare array of the graph, `nnx.data`)."""
    return leaf.get_value() if _is_variable(leaf) else leaf


def path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _flatten(tree):
    """(path, Variable or array) for every leaf of an NNX module, State or any pytree of them."""
    if isinstance(tree, nnx.Pytree):  # a module or an optimizer: its State
        tree = nnx.state(tree)
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)


def paths_and_shapes(tree) -> list[tuple[str, tuple[int, ...]]]:
    """(path, shape) of every Variable (or bare array) of `tree`, in leaf order, as `place` names them."""
    return [(path_str(path), tuple(np.shape(value_of(leaf))))
            for path, leaf in _flatten(tree)[0]]


# Names that fit a param of each rank, for the error that asks for them.
_EXAMPLE_NAMES = {1: "('embed',)", 2: "('embed', 'mlp')", 3: "('embed', 'heads', 'kv')",
                  4: "(None, None, 'embed', 'mlp') (a conv kernel)"}


def place(tree, sizes: dict[str, int], rules: Rules, kind: Kind = "param") -> list[Placement]:
    """Resolve every Variable (or bare array) of `tree` on a mesh of `sizes` (checked against the
    rules by the caller), in leaf order: by its logical names, or by its author's PartitionSpec over
    mesh axes (`Rules.mesh_spec`). All problems raise as one error."""
    table = rules.table(kind)
    sharding_axes = list(dict.fromkeys(a for _, axes in table for a in axes if sizes[a] > 1))
    zero_axes = [a for a in rules.zero_axes if sizes[a] > 1] if rules.zero >= ZERO_KINDS[kind] else []
    placed, problems, leaves = [], [], _flatten(tree)[0]
    metadata = [leaf.get_metadata().get("out_sharding") if _is_variable(leaf) else None for _, leaf in leaves]
    mesh_specs = [_mesh_spec(leaf, names) for (_, leaf), names in zip(leaves, metadata)]
    rules.check_model_axes({path_str(path): spec for (path, _), spec in zip(leaves, mesh_specs) if spec is not None},
                           sizes)
    for (path, leaf), names, mesh_spec in zip(leaves, metadata, mesh_specs):
        where = f"{kind} {path_str(path)!r}"
        value = value_of(leaf)
        shape, dtype = tuple(np.shape(value)), value.dtype  # a NumPy dtype, or an RNG key's
        flags: list[str] = []
        if mesh_spec is not None:  # the model's own layout, over mesh axes (JAX's annotations)
            names = None
            try:
                spec = rules.mesh_spec(mesh_spec, shape, sizes, kind, where)
            except ShardingError as e:
                problems.append(str(e))
                continue
        elif names is None:
            # ZeRO needs no names: it splits an unnamed param by itself. Other axes (tensor,
            # experts, a pipeline's stages) split a param by what its dims mean: they need names.
            needs_names = [a for a in sharding_axes if a not in zero_axes or not isinstance(leaf, nnx.Param)]
            if shape and (needs_names and len(shape) > 1 or rules.strict and sharding_axes):
                example = _EXAMPLE_NAMES.get(len(shape), repr((None,) * len(shape)))
                problems.append(
                    f"{where} (shape {shape}) has no logical axis names, but rules {rules.name!r} "
                    f"shard {kind}s over {', '.join(needs_names or sharding_axes)}, which split a param by what its "
                    f"dims mean (ZeRO alone would split it by itself). Fix: name its {len(shape)} dim(s), e.g. "
                    f"nnx.Param(value, out_sharding={example}), or kernel_metadata=jshard.named(...) "
                    f"(bias_metadata=... for a bias) on a Flax layer (None for a dim that stays whole)."
                )
                continue
            spec, flags = _split_by_itself(shape, zero_axes if isinstance(leaf, nnx.Param) else [], sizes,
                                           bool(sharding_axes))
        else:
            try:
                spec, flags = resolve(table, tuple(names), shape, sizes, where)
            except ShardingError as e:
                problems.append(str(e))
                continue
        used = {a for entry in spec for a in axes_of(entry)}
        missed = [a for a in zero_axes if a not in used]
        if missed and shape and names is not None:
            flags.append(f"replicated over {'+'.join(missed)}, which ZeRO stage {rules.zero} means to shard")
        nbytes = math.prod(shape) * dtype.itemsize // math.prod(sizes[a] for a in used)
        fp8 = bool(leaf.get_metadata().get("fp8")) if _is_variable(leaf) else False
        placed.append(Placement(path_str(path), names, shape, dtype, spec, nbytes, tuple(flags), fp8))
    raise_problems(problems)
    return placed


def _mesh_spec(leaf, names) -> jax.P | None:
    """A Variable's layout as its author gave it over mesh axes, where it has one: a PartitionSpec
    in its `out_sharding` (Flax's `sharding`) metadata, or else its array's own NamedSharding on a
    mesh of the author's (an initializer's `out_sharding=`) that names some axis. jshard's logical
    names are a plain tuple (`jshard.named`); an array jshard placed is on a mesh of jshard's axes."""
    if isinstance(names, (jax.P, NamedSharding)):  # (Flax's tutorials: with_partitioning(init, NamedSharding(...)))
        return names if isinstance(names, jax.P) else names.spec
    if names is not None or not _is_variable(leaf):
        return None
    sharding = getattr(leaf.get_value(), "sharding", None)
    # (a spec that names no axis says nothing: every array made under an Explicit mesh has one)
    if (isinstance(sharding, NamedSharding) and not set(sharding.mesh.axis_names) <= set(STANDARD_AXES)
            and any(sharding.spec)):
        return sharding.spec
    return None


def adopt_array_shardings(tree) -> None:
    """Record each Variable's layout that only its array holds (an initializer's `out_sharding=` on the
    author's mesh) as its `out_sharding` metadata, in place: what is derived from the Variable (an
    optimizer's moments, made under no mesh of the author's) then carries it too."""
    for _, leaf in _flatten(tree)[0]:
        if _is_variable(leaf) and leaf.get_metadata().get("out_sharding") is None:
            spec = _mesh_spec(leaf, None)
            if spec is not None:
                leaf.set_metadata(out_sharding=spec)


def _full(layout, ndim: int):
    return tuple(layout) + ((),) * (ndim - len(layout))


def _split_by_itself(shape, zero_axes, sizes, could_split: bool) -> tuple[jax.P, list[str]]:
    """An unnamed param's spec: split over the ZeRO axes on its largest dim they divide, as a
    named one would be; else whole (flagged where the rules could have split it)."""
    if not shape or not could_split:
        return jax.P(), []
    n = math.prod(sizes[a] for a in zero_axes)
    dims = sorted((d for d in range(len(shape)) if zero_axes and shape[d] % n == 0), key=lambda d: -shape[d])
    if not dims:
        why = f"no dim divides {'×'.join(zero_axes)}={n}" if zero_axes else "unnamed 1-D params are; strict rules refuse them"
        return jax.P(), [f"no logical names: replicated ({why})"]
    entry = tuple(zero_axes) if len(zero_axes) > 1 else zero_axes[0]
    spec = jax.P(*[entry if d == dims[0] else None for d in range(len(shape))])
    return spec, [f"no logical names: split by itself over {'+'.join(zero_axes)} on dim {dims[0]} (ZeRO)"]


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """One param as the step holds it: its placements and layouts (a tuple of mesh axes per
    dim), and its dtypes under the step's precision policy (`jshard.precision`)."""

    placement: Placement  # in the `param` layout: spec, bytes per device, what `describe` flags
    opt_placement: Placement  # in the `opt` layout: the optimizer state's, the update's (ZeRO)
    held: np.dtype  # the params' dtype on the devices, gathered and differentiated
    reduce: np.dtype  # the gradient reduction's
    master: np.dtype | None  # the optimizer's copy in the `opt` layout, beside Adam's moments; None: the param
    compute: np.dtype  # what jshard.nn's layers cast a matrix to before they gather it (`nn.param`)
    fp8: bool = False  # its product runs in FP8 (an `fp8` policy, a projection's kernel): ZeRO-3 gathers it in e4m3

    @classmethod
    def of(cls, placement: Placement, opt_placement: Placement, policy: Precision | None) -> ParamLayout:
        """Its dtypes under `policy` (None: as the param is, no master)."""
        held = policy.param if policy else placement.dtype
        return cls(placement, opt_placement, held, policy.reduce if policy else held, policy and policy.master,
                   policy.compute if policy else held, bool(policy and policy.fp8 and placement.fp8))

    path = property(lambda self: self.placement.path)
    shape = property(lambda self: self.placement.shape)
    # One tuple of axes per dim (a whole param's spec may be P(): no dims named)
    param = property(lambda self: _full(layout_of(self.placement.spec), len(self.shape)))
    opt = property(lambda self: _full(layout_of(self.opt_placement.spec), len(self.shape)))

    @property
    def names(self) -> tuple:
        return self.placement.names or (None,) * len(self.shape)

    @property
    def stacked(self) -> bool:
        """Whether it is a stack of layers (its first logical name is 'layers'): what a pipeline splits."""
        return self.names[:1] == ("layers",)

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> int:
        """As held on the devices (and gathered)."""
        return self.elements * self.held.itemsize

    @property
    def reduce_bytes(self) -> int:
        return self.elements * self.reduce.itemsize

    @property
    def optimizer_dtype(self) -> np.dtype:
        """What the optimizer updates, and its moments are in: the master's dtype, or the param's."""
        return self.master or self.held

    @property
    def scattered_bytes(self) -> int:
        """What ZeRO-3's reduce-scatter of its gradient moves: the gradient of what the layer
        computes with, a matrix (a kernel, an embedding) cast to the compute dtype first where that
        is narrower, a vector (a norm's scale) as held."""
        matrix = len([n for n in self.names if n != "layers"]) >= 2
        dtype = self.compute if matrix and self.compute.itemsize < self.held.itemsize else self.held
        return self.elements * dtype.itemsize

    @property
    def gathered_bytes(self) -> int:
        """What a ZeRO-3 gather moves of it: as its gradient's reduce-scatter, but a kernel whose
        product runs in FP8 in e4m3, one byte an element (`nn.fp8`)."""
        return self.elements if self.fp8 else self.scattered_bytes

    @property
    def stacked_kernel(self) -> bool:
        """A matmul weight of the layer stack: ZeRO-3 gathers it again in backward."""
        return self.stacked and len(self.shape) > 2


def specs(tree, mesh: Mesh, rules: Rules, kind: Kind = "param"):
    """The PartitionSpec of every Variable of `tree`, in a tree of the same structure.

    `tree` is an NNX module (its State is used), a State, or any pytree of Variables and
    arrays such as an optax state over a State. `kind` picks the layout: 'param', 'grad'
    or 'opt' (optimizer state, whose Variables carry the names of their params). Bare
    arrays need no names when they are scalars (an optimizer's step count).
    """
    return specs_of(tree, _place_checked(tree, mesh, rules, kind))


def _place_checked(tree, mesh: Mesh, rules: Rules, kind: Kind) -> list[Placement]:
    """`place` for the user's entry points below, which take any mesh: checked against the rules first."""
    rules.check_mesh(mesh)
    return place(tree, mesh_shape(mesh), rules, kind)


def specs_of(tree, placed: list[Placement]):
    """As `specs`, from the placements `place` already resolved for `tree`."""
    flat, treedef = _flatten(tree)
    leaves = [leaf.replace(p.spec) if _is_variable(leaf) else p.spec for (_, leaf), p in zip(flat, placed)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def shardings(tree, mesh: Mesh, rules: Rules, kind: Kind = "param") -> nnx.State:
    """As `specs`, as NamedShardings on `mesh`: for `jax.jit` in/out_shardings and `device_put`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs(tree, mesh, rules, kind))


def init(factory: Callable[[], nnx.Module], mesh: Mesh, rules: Rules, kind: Kind = "param"):
    """Build `factory()` with every Variable created directly in its shards on `mesh`.

    `factory` runs under tracing, so it must make its own `nnx.Rngs`:
    `lambda: GPT(config, rngs=nnx.Rngs(0))`, not a lambda over an Rngs made outside.
    """
    try:
        abstract = nnx.eval_shape(factory)
    except flax.errors.TraceContextError as e:
        raise ShardingError(
            "jshard.init(factory, ...): the factory uses an nnx.Rngs (or another Variable) "
            "created outside it. Fix: create it inside, e.g. lambda: GPT(config, rngs=nnx.Rngs(0))."
        ) from e
    graphdef = nnx.graphdef(abstract)
    out_shardings = shardings(abstract, mesh, rules, kind)  # every error surfaces here
    state = jax.jit(lambda: nnx.state(factory()), out_shardings=out_shardings)()
    return nnx.merge(graphdef, state)


def shard(tree, mesh: Mesh, rules: Rules, kind: Kind = "param"):
    """Move an existing NNX object's Variables onto `mesh` by `rules`, in place; returns it."""
    nnx.update(tree, jax.device_put(nnx.state(tree), shardings(tree, mesh, rules, kind)))
    return tree


@dataclasses.dataclass(frozen=True)
class Report:
    """Per Variable: logical names -> spec -> bytes per device, and what looks wrong."""

    rules: Rules
    mesh_sizes: dict[str, int]
    kind: str
    rows: tuple[Placement, ...]
    warnings: tuple[str, ...] = ()  # what looks wrong beyond one Variable (the step's, from its program)

    @property
    def bytes_per_device(self) -> int:
        return sum(p.bytes_per_device for p in self.rows)

    @property
    def total_bytes(self) -> int:
        return sum(math.prod(p.shape) * p.dtype.itemsize for p in self.rows)

    @property
    def flagged(self) -> tuple[Placement, ...]:
        return tuple(p for p in self.rows if p.flags)

    def __str__(self) -> str:
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh_sizes.items())
        header = ("path", "logical names", "shape", "spec", "per device")
        table = [header] + [
            (p.path, _fmt_names(p.names), "×".join(map(str, p.shape)) or "()", _fmt_spec(p.spec), format_bytes(p.bytes_per_device))
            for p in self.rows
        ]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines = [f"{self.kind}s under {self.rules.name!r} (ZeRO stage {self.rules.zero}) on mesh {mesh}"]
        for row in table:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        lines.append(
            f"total {format_bytes(self.total_bytes)}, per device {format_bytes(self.bytes_per_device)} "
            f"({self.total_bytes / max(self.bytes_per_device, 1):.2f}× smaller)"
        )
        for p in self.flagged:
            lines.extend(f"! {p.path}: {flag}" for flag in p.flags)
        lines.extend(f"! {warning}" for warning in self.warnings)
        return "\n".join(lines)


def describe(tree, mesh: Mesh, rules: Rules, kind: Kind = "param") -> Report:
    """The placement of every Variable; `print()` it, or read `.rows` and `.flagged`."""
    rows = tuple(_place_checked(tree, mesh, rules, kind))
    return Report(rules, mesh_shape(mesh), kind, rows)


def _fmt_names(names) -> str:
    return "-" if names is None else "(" + ", ".join(str(n) for n in names) + ")"


def _fmt_spec(spec: jax.P) -> str:
    return "P(" + ", ".join("+".join(axes_of(e)) if e else "-" for e in spec) + ")"


def format_bytes(n: float, digits: int = 1) -> str:
    """1536 -> '1.5 KiB': binary units up to GiB, whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
