"""A call's backward, kept from its forward and split into B (input gradient) and W (weights).

A pipeline stage runs its forward at one tick and its backward ticks later. Recomputing the
forward then costs a third more work; zero-bubble schedules split the backward in two, B
(what the previous stage waits for: the input gradient) and W (the weight gradient,
deferred into idle ticks), and recomputing for each would cost more still. So:

    out, saved, backward = keep(fn, params, inputs, known)   # at F: the forward, once
    ... saved waits in a buffer ...
    input_grads, crossover = backward.b(known, saved, out_grad)   # at B
    param_grads = backward.w(known, saved, crossover)             # at W (BW: both)

`keep` takes `jax.vjp` of `fn` and traces its pull-back to a jaxpr. The pull-back's constants
are what the backward needs: the residuals of the forward (`saved`, to be buffered), values
available again at backward time (`known`: the params, the micro-batch; matched by identity,
so no weight is copied into a buffer), literals, and residuals that depend on nothing the
call is given (a causal mask, position ids: recomputed where needed, never buffered). B is
the slice of that jaxpr that the input gradient needs; W is the rest, fed by the values of B's slice it reads (`crossover`: a
linear layer's output gradient, mostly; Megatron's and the zero-bubble paper's (input, output
gradient) pairs, found from the program instead of hooked into each layer). B + W computes
exactly what the whole pull-back computes, so the split adds no FLOPs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
from jax.extend import core

Source = tuple  # ("known", i) | ("saved", i) | ("constant", i) | ("value", v)


def _needed(eqns, wanted) -> list[bool]:
    """Which of `eqns` the vars `wanted` depend on (a backward slice of the program)."""
    need = {v for v in wanted if isinstance(v, core.Var)}
    keep = [False] * len(eqns)
    for n in reversed(range(len(eqns))):
        if any(v in need for v in eqns[n].outvars if not isinstance(v, core.DropVar)):
            keep[n] = True
            need.update(v for v in eqns[n].invars if isinstance(v, core.Var))
    return keep


def _jaxpr(name, constvars, invars, outvars, eqns) -> core.Jaxpr:
    effects = frozenset().union(*(e.effects for e in eqns)) if eqns else frozenset()
    debug = core.DebugInfo("jshard.parallel.backward", name, tuple(f"in{i}" for i in range(len(invars))),
                           tuple(f"out{i}" for i in range(len(outvars))))
    return core.Jaxpr(constvars, invars, outvars, eqns, effects, debug)


def _depends(jaxpr: core.Jaxpr, var, inputs) -> bool:
    """Whether `var` of `jaxpr` depends on any of the vars `inputs`."""
    if not isinstance(var, core.Var):
        return False
    keep = _needed(jaxpr.eqns, [var])
    used = {v for e, k in zip(jaxpr.eqns, keep) if k for v in e.invars if isinstance(v, core.Var)}
    return var in inputs or bool(used & inputs)


def _constant(jaxpr: core.Jaxpr, var) -> bool:
    """Whether `var` depends on no input of `jaxpr` (a zero gradient the pull-back instantiated)."""
    return not _depends(jaxpr, var, set(jaxpr.constvars) | set(jaxpr.invars))


def _slice(name, closed: core.ClosedJaxpr, outvars) -> core.ClosedJaxpr:
    """The part of `closed` that computes `outvars`, with the constants it reads."""
    eqns = [e for e, k in zip(closed.jaxpr.eqns, _needed(closed.jaxpr.eqns, outvars)) if k]
    used = {v for e in eqns for v in e.invars if isinstance(v, core.Var)} | {v for v in outvars if isinstance(v, core.Var)}
    pairs = [(v, c) for v, c in zip(closed.jaxpr.constvars, closed.consts) if v in used]
    return core.ClosedJaxpr(_jaxpr(name, [v for v, _ in pairs], [], list(outvars), eqns), [c for _, c in pairs])


@dataclasses.dataclass(frozen=True, eq=False)
class Backward:
    """The pull-back of one traced call, as programs over (known, saved) values."""

    jaxpr: core.Jaxpr  # (constants; output gradients) -> (param grads, input grads), flat
    sources: tuple[Source, ...]  # per constvar of `jaxpr`
    constants: core.ClosedJaxpr | None  # () -> the residuals that depend on no input
    saved: tuple  # the avals (shape, dtype, vma) of what the forward hands over, in order
    params_tree: jax.tree_util.PyTreeDef
    inputs_tree: jax.tree_util.PyTreeDef
    b_jaxpr: core.Jaxpr  # (constants; output gradients) -> (input grads, crossover)
    w_jaxpr: core.Jaxpr  # (constants; crossover) -> param grads (the non-constant ones)
    w_outputs: tuple[int, ...]  # which param grads `w_jaxpr` returns; the others are zero
    crossover: tuple  # the avals of what B hands W

    @classmethod
    def of(cls, jaxpr: core.Jaxpr, sources, constants, saved, params_tree, inputs_tree) -> Backward:
        n_params = params_tree.num_leaves
        param_outs, input_outs = jaxpr.outvars[:n_params], jaxpr.outvars[n_params:]
        w_outputs = tuple(i for i, v in enumerate(param_outs) if not _constant(jaxpr, v))
        in_b = _needed(jaxpr.eqns, input_outs)
        b_eqns = [e for e, k in zip(jaxpr.eqns, in_b) if k]
        w_wanted = [param_outs[i] for i in w_outputs]
        w_eqns = [e for e, k, b in zip(jaxpr.eqns, _needed(jaxpr.eqns, w_wanted), in_b) if k and not b]
        # What W reads that B computed (or that arrived as an output gradient): handed over.
        from_b = {v for e in b_eqns for v in e.outvars if not isinstance(v, core.DropVar)} | set(jaxpr.invars)
        read = [v for e in w_eqns for v in e.invars] + w_wanted
        crossover = list(dict.fromkeys(v for v in read if isinstance(v, core.Var) and v in from_b))
        return cls(
            jaxpr, tuple(sources), constants, tuple(saved), params_tree, inputs_tree,
            b_jaxpr=_jaxpr("B", jaxpr.constvars, jaxpr.invars, list(input_outs) + crossover, b_eqns),
            w_jaxpr=_jaxpr("W", jaxpr.constvars, crossover, w_wanted, w_eqns),
            w_outputs=w_outputs,
            crossover=tuple(v.aval for v in crossover),
        )

    def _constants(self, known: Sequence, saved: Sequence) -> list:
        pick = {"known": known, "saved": saved}
        if self.constants is not None:
            pick["constant"] = core.jaxpr_as_fun(self.constants)()
        return [pick[kind][i] if kind in pick else i for kind, i in self.sources]

    def _param_grads(self, flat_w) -> list:
        grads = [None] * self.params_tree.num_leaves  # None: a zero gradient, never materialised
        for i, g in zip(self.w_outputs, flat_w):
            grads[i] = g
        return grads

    def b(self, known, saved, out_grads) -> tuple:
        """The input gradients (a tree like the inputs) and the crossover W needs."""
        flat = core.jaxpr_as_fun(core.ClosedJaxpr(self.b_jaxpr, self._constants(known, saved)))(
            *jax.tree.leaves(out_grads))
        n_inputs = self.inputs_tree.num_leaves
        return self.inputs_tree.unflatten(flat[:n_inputs]), list(flat[n_inputs:])

    def w(self, known, saved, crossover) -> list:
        """The params' gradients, flat (None where zero), from what B handed over."""
        flat = core.jaxpr_as_fun(core.ClosedJaxpr(self.w_jaxpr, self._constants(known, saved)))(*crossover)
        return self._param_grads(flat)


def keep(fn: Callable, params, inputs, known: Sequence = ()) -> tuple:
    """`fn(params, inputs)`, and what its backward needs: (out, saved, Backward).

    `known` are values the caller can hand to the backward again (the micro-batch, say);
    params' leaves are known too. Anything else the backward reads is in `saved`, but for
    what depends on none of them, which the backward recomputes.
    """
    found = {}

    def forward(params, inputs):  # the output, and the traced values the pull-back reads
        out, pull = jax.vjp(fn, params, inputs)
        found["pull"] = jax.make_jaxpr(pull)(out)
        return out, [c for c in found["pull"].consts if isinstance(c, jax.core.Tracer)]

    # Traced once as a program of the call's inputs, then run: each residual is an output of
    # that program, so what it is follows from where it comes from. jnp's jitted helpers are
    # inlined: a multi-output call would hide which of its outputs depend on what.
    with jax.disable_jit():
        program, out_shape = jax.make_jaxpr(forward, return_shape=True)(params, inputs)
    outputs = core.jaxpr_as_fun(program)(*jax.tree.leaves((params, inputs)))
    out_tree = jax.tree.structure(out_shape[0])
    n_out = out_tree.num_leaves
    out, residuals = out_tree.unflatten(outputs[:n_out]), outputs[n_out:]
    jaxpr, n_params = program.jaxpr, len(jax.tree.leaves(params))
    known_of = {id(k): i for i, k in enumerate(known)}
    # A residual that is a param, or a closed-over value the caller knows (by its constvar)
    where_known = {v: i for i, v in enumerate(jaxpr.invars[:n_params])} | {
        v: n_params + known_of[id(c)] for v, c in zip(jaxpr.constvars, program.consts) if id(c) in known_of}
    given = set(jaxpr.invars) | {v for v, c in zip(jaxpr.constvars, program.consts) if isinstance(c, jax.core.Tracer)}
    pull, traced = found["pull"], iter(zip(jaxpr.outvars[n_out:], residuals))
    sources, saved, constant = [], [], []
    for c in pull.consts:
        if not isinstance(c, jax.core.Tracer):
            sources.append(("value", c))
            continue
        var, value = next(traced)
        if var in where_known:
            sources.append(("known", where_known[var]))
        elif not _depends(jaxpr, var, given):
            sources.append(("constant", len(constant)))
            constant.append(var)
        else:
            sources.append(("saved", len(saved)))
            saved.append(value)
    constants = _slice("constants", program, constant) if constant else None
    backward = Backward.of(pull.jaxpr, sources, constants, [jax.typeof(s) for s in saved],
                           jax.tree.structure(params), jax.tree.structure(inputs))
    return out, saved, backward
