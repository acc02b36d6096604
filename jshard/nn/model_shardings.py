"""The sharding requests a model's forward makes in JAX's own API, met inside jshard's steps.

A model written in JAX's explicit-sharding style asks for layouts over its author's mesh axes:
`out_sharding=P(...)` on `jnp` / `lax` / `jax.random` / Flax calls, `jax.sharding.reshard`,
`jax.lax.with_sharding_constraint`, `jax.sharding.auto_axes(f, out_sharding=...)`. Inside a jshard
step the mesh is jshard's (its axes renamed by `Rules.model_axes`) and JAX refuses those requests
with a raw ValueError (an axis it does not have; an axis that is Auto or Manual, not Explicit; a
NamedSharding on the author's mesh) or, for `auto_axes` from Manual axes, a NotImplementedError.
Where JAX refuses one inside a step, jshard meets it instead:

- the compiler-placed step (plain `jax.jit`, Auto axes): `reshard` and
  `with_sharding_constraint` become sharding constraints on the renamed axes, honoured by XLA;
  an `out_sharding=` on an op is left to XLA's propagation (Auto axes take no `out_sharding`),
  which places the op from its operands, whose layouts are the author's;
- the explicit step (`shard_map`, every axis manual): a request that restates the local layout
  (the only axes of size > 1 it names are the batch axes, on dim 0: the rows each device holds)
  is dropped; one that asks for another (a dim split over `tensor`, where the step computes
  plain layers on whole values) is one `ShardingError` naming the call site and the fix;
- `auto_axes`: its function runs as it is (locally, or placed by XLA), its `out_sharding` met as an
  `out_sharding=` on an op.

JAX binds these functions by name in many modules (`from ... import canonicalize_sharding`), so
`install` rebinds every such name to a wrapper that calls JAX's own first and steps in only on its
error inside a step: outside one, and for every request JAX accepts, nothing changes.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
import types

import jax

from jshard.rules import ShardingError, active_rules, axes_of, manual_axes

_OURS = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(jax.__file__))
_scanned: set[str] = set()  # modules whose bindings were rebound already
_wrappers: dict[int, object] = {}  # id(JAX's function) -> its wrapper
_jax_functions: dict[str, object] = {}  # JAX's own, by name, before `install` rebinds them


def _call_site() -> str:
    """file:line of the innermost frame outside JAX, Flax and jshard: the model's request."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_OURS) and "/flax/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}"
    return "the model's forward"


def _is_sharding(x) -> bool:
    return isinstance(x, (jax.P, jax.sharding.NamedSharding))


def _spec_of(sharding):
    return sharding.spec if isinstance(sharding, jax.sharding.NamedSharding) else sharding


def _translated(spec) -> jax.P:
    """`spec` over jshard's axes (the rules' `model_axes` renamed), axes the mesh lacks refused."""
    rename, sizes = dict(active_rules().model_axes), dict(jax.sharding.get_abstract_mesh().shape)
    entries = []
    for entry in spec:
        if entry is jax.P.UNCONSTRAINED:  # (with_sharding_constraint's "as XLA likes" for a dim)
            entries.append(entry)
            continue
        axes = tuple(rename.get(a, a) for a in axes_of(entry))
        unknown = [a for a, ours in zip(axes_of(entry), axes) if ours not in sizes]
        if unknown:
            raise ShardingError(
                f"{_call_site()}: the model asks for the layout {spec}, whose mesh axis {unknown[0]!r} is not one of "
                f"jshard's ({', '.join(sizes)}). Fix: rename the model's axes onto jshard's, e.g. "
                f"rules.with_mesh_axes({{{unknown[0]!r}: 'tensor'}}).")
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return jax.P(*entries)


def _check_local(sharding, what: str) -> None:
    """Inside the explicit step: refuse a request for another layout than the local one."""
    spec = _translated(_spec_of(sharding))
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    batch = set(active_rules().axes("batch", jax.sharding.get_abstract_mesh()))
    for dim, entry in enumerate(spec):
        for axis in () if entry is jax.P.UNCONSTRAINED else axes_of(entry):
            if sizes[axis] > 1 and not (dim == 0 and axis in batch):
                raise ShardingError(
                    f"{_call_site()}: {what} asks for the layout {_spec_of(sharding)} ({axis}={sizes[axis]} on dim "
                    f"{dim}), but jshard's explicit step holds this value whole on that dim (only the rows, dim 0, "
                    f"are split, over the batch axes). Fix: build_step(..., collectives=\"compiler\") (XLA lays the "
                    f"value out), drop the request, or use a mesh with {axis}=1.")


def _canonicalize_sharding(original, _, sharding, api_name, *args, **kwargs):
    try:
        return original(sharding, api_name, *args, **kwargs)
    except ValueError:
        if active_rules() is None or sharding is None:
            raise
    if manual_axes():
        _check_local(sharding, f"out_sharding= of {api_name}")
    else:
        _translated(_spec_of(sharding))  # (an axis the mesh lacks refused here, not by XLA)
    return None  # the op as if no layout were asked for: local, or placed by XLA's propagation


def _constraint(original, name, x, shardings, *args, **kwargs):
    # (JAX's `reshard` to a NamedSharding on another mesh, the author's, moves the value onto it,
    # unrefused: inside a step that leaves a value no later op accepts, so jshard steps in first)
    if active_rules() is None or not _on_another_mesh(shardings):
        try:
            return original(x, shardings, *args, **kwargs)
        except ValueError:
            if active_rules() is None:
                raise
    if manual_axes():
        for sharding in jax.tree.leaves(shardings, is_leaf=_is_sharding):
            _check_local(sharding, name)
        return x
    return _jax_functions["with_sharding_constraint"](x, jax.tree.map(lambda s: _translated(_spec_of(s)), shardings,
                                                     is_leaf=_is_sharding))


def _on_another_mesh(shardings) -> bool:
    """Whether any of `shardings` is a NamedSharding on a mesh other than the current one (the author's)."""
    axes = jax.sharding.get_abstract_mesh().axis_names
    return any(isinstance(s, jax.sharding.NamedSharding) and s.mesh.axis_names != axes
               for s in jax.tree.leaves(shardings, is_leaf=_is_sharding))


def _auto_axes_mesh(original, _, axes, axis_type, api_name, *args, **kwargs):
    """`auto_axes`' switch to Auto axes for its function (JAX's `_get_new_mesh`): JAX refuses it from
    Manual axes and for a NamedSharding on the author's mesh. Inside a step jshard runs the function
    as it is (`None`: no switch) and treats its `out_sharding` as an `out_sharding=` on an op."""
    try:
        return original(axes, axis_type, api_name, *args, **kwargs)
    except (ValueError, KeyError, NotImplementedError):
        if active_rules() is None or api_name != "auto_axes":
            raise
    for sharding in jax.tree.leaves(kwargs.get("shardings", args[0] if args else None), is_leaf=_is_sharding):
        if manual_axes():
            _check_local(sharding, "out_sharding= of auto_axes")
        else:
            _translated(_spec_of(sharding))
    return None


def install() -> None:
    """Rebind JAX's sharding entry points to the wrappers in every module loaded since the last call
    (cheap: each module is scanned once)."""
    if not _wrappers:
        try:  # (private names: a JAX release that moves them leaves the requests to JAX, as before)
            from jax._src import pjit, sharding_impls
        except ImportError:
            return
        for name, original, handler in (
                ("canonicalize_sharding", sharding_impls.canonicalize_sharding, _canonicalize_sharding),
                ("reshard", pjit.reshard, _constraint),
                ("with_sharding_constraint", pjit.with_sharding_constraint, _constraint),
                ("_get_new_mesh", getattr(pjit, "_get_new_mesh", None), _auto_axes_mesh)):
            if original is None:
                continue
            _jax_functions[name] = original  # (JAX 0.12's canonicalize_sharding is a cache object: no __name__)
            _wrappers[id(original)] = functools.partial(handler, original, name)
    for name, module in list(sys.modules.items()):
        if name in _scanned:
            continue
        _scanned.add(name)
        if not isinstance(module, types.ModuleType) or name.startswith("jshard"):
            continue  # (jshard's own calls are valid ones: they stay JAX's)
        namespace = vars(module)  # (the dict itself: no module __getattr__ runs, nothing is imported)
        for attr, value in list(namespace.items()):
            if id(value) in _wrappers:  # (JAX's function itself: the wrapper keeps it alive, so its id is its own)
                namespace[attr] = _wrappers[id(value)]
