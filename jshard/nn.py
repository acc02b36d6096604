"""Layers that know the logical names of their inputs, weights and outputs.

A layer never names a mesh axis. It knows, say, that it maps (batch, seq, embed) to
(batch, seq, mlp) with a weight (embed, mlp), and asks the active rules where each name
lives. From that alone follow the collectives of every strategy (the scaling book's
sharded-matmul cases):

- a weight dim on a ZeRO axis (`fsdp`): all-gather the weight before use (`param`); its
  autodiff transpose is the gradient's reduce-scatter, and under ZeRO-3 the gathered
  weight is not kept for backward but gathered again (see `remat_policy`);
- an input dim laid out differently from what the output wants (sequence parallel's
  seq): all-gather it before the matmul;
- a contracting dim split over an axis (row-parallel): the product is a partial sum,
  reduced by `psum`, or by `psum_scatter` where the output wants that axis on a dim
  (sequence parallel);
- an output dim split like the weight's (column-parallel): no communication;
- an axis that should split another dim of an activation than it does (a mixture of
  experts' buffer, from its rows to its experts: `jshard.moe`): an all-to-all.

Outside a jshard step these are plain Flax layers: the same model runs on one device, or
under `jax.jit` with the compiler placing collectives (`jshard.constrain`).

Layouts here are specs as tuples, one tuple of mesh axes per dim: `((data, fsdp), (), (tensor,))`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jshard import vma
from jshard.rules import ShardingError, active_rules, constrain, layout_of, manual_axes, named

Layout = tuple[tuple[str, ...], ...]


# -- layouts and relayout -----------------------------------------------------------------


def layout(names: Sequence[str | None], kind: str = "activation") -> Layout:
    """Where the active rules put each dim of a tensor called `names`, inside a step."""
    spec = active_rules().spec(tuple(names), None, jax.sharding.get_abstract_mesh(), kind)
    return layout_of(spec)


def in_step() -> bool:
    return active_rules() is not None and bool(manual_axes())


def relayout_local(x: jax.Array, src: Layout, dst: Layout, partial: Sequence[str] = (), invariant: bool = False) -> jax.Array:
    """Move a local block from layout `src` to `dst` with the fewest collectives.

    `partial` are mesh axes over which `x` is a partial sum: each is reduced with
    `psum_scatter` onto the dim where `dst` wants it, or with `psum` if `dst` wants it
    nowhere. A dim whose axes change is all-gathered (axes `src` has, `dst` lacks) and
    then sliced locally (axes `dst` has, `src` lacks; slicing moves nothing).

    A gathered block is typed varying over the gathered axes, so that its transpose is
    a reduce-scatter; `invariant=True` types it replicated instead, for values that are
    not differentiated (updated params).
    """
    src = [tuple(a) for a in src]
    summed = []
    for axis in partial:  # reduce-scatters first: the all-reduces then move smaller blocks
        dims = [d for d, axes in enumerate(dst) if axis in axes and axis not in src[d]]
        if dims and src[dims[0]] + (axis,) == tuple(dst[dims[0]]):
            x = lax.psum_scatter(x, axis, scatter_dimension=dims[0], tiled=True)
            src[dims[0]] = src[dims[0]] + (axis,)
        else:
            summed.append(axis)
    if summed:
        x = lax.psum(x, tuple(summed))
    for a, b in _moves(src, dst):  # an axis leaving dim a for dim b: each device sends the others their parts
        axis = src[a][-1]
        x = lax.all_to_all(vma.vary(x, (axis,)), axis, split_axis=b, concat_axis=a, tiled=True)
        src[a], src[b] = src[a][:-1], src[b] + (axis,)
    for dim, (have, want) in enumerate(zip(src, dst)):
        want = tuple(want)
        if have == want:
            continue
        keep = 0  # the leading axes both share stay split; the rest is gathered
        while keep < min(len(have), len(want)) and have[keep] == want[keep]:
            keep += 1
        if have[keep:]:
            x = lax.all_gather(x, have[keep:], axis=dim, tiled=True, to="invarying" if invariant else "varying")
        if want[keep:]:
            n = lax.axis_size(want[keep:])
            size = x.shape[dim] // n
            # Each device keeps its own slice: varying over those axes, even if x was alike.
            x = vma.vary(x, want[keep:])
            x = lax.dynamic_slice_in_dim(x, lax.axis_index(want[keep:]) * size, size, axis=dim)
    return x


def _moves(src, dst) -> list[tuple[int, int]]:
    """(a, b) for each axis that is the innermost split of dim a in `src` and should be that of
    dim b in `dst`, all else on both dims equal: an all-to-all moves it ((n-1)/n of the block
    leaves each device) where a gather and a slice would move n-1 times the block."""
    return [(a, b) for a, have in enumerate(src) if have for b, want in enumerate(dst)
            if b != a and tuple(dst[a]) == have[:-1] and tuple(want) == tuple(src[b]) + (have[-1],)]


def relayout(x: jax.Array, src_names, dst_names, partial: Sequence[str] = ()) -> jax.Array:
    """x, laid out as the rules place `src_names`, laid out as they place `dst_names`.

    Inside a step this is explicit collectives (`relayout_local`); outside, a sharding
    constraint to `dst_names` for the compiler.
    """
    if not in_step():
        return constrain(x, dst_names)
    return relayout_local(x, layout(src_names), layout(dst_names), partial)


# -- params -------------------------------------------------------------------------------


def _whole(x: jax.Array, split: Layout, batch_axes: tuple[str, ...]) -> jax.Array:
    """A block laid out as `split` (one tuple of axes per trailing dim of `x`), gathered whole.

    Typed so that autodiff stays right: gathered over a batch axis (ZeRO's, where each
    device computes with other rows) it stays varying, its transpose a reduce-scatter
    that sums the devices' gradients; over another axis (tensor: every device computes
    the same thing with it) it becomes invariant, its transpose a slice.
    """
    split = split[len(split) - x.ndim:]  # a scanned layer sees one layer's slice of a stack
    for dim, axes in enumerate(split):
        for axis in reversed(axes):  # minor axis first: tiles land in the layout's order
            to = "varying" if axis in batch_axes else "invarying"
            x = lax.all_gather(x, axis, axis=dim, tiled=True, to=to)
    return x


class _SplitParam:
    """A split param's value inside a step, as the model holds it.

    `param` computes with it as the layer's names say (the collectives of `matmul`). Any
    other read, such as a plain Flax layer's `self.kernel[...]`, gets the whole param,
    gathered before use: the layer computes what it computes on one device, without
    tensor parallelism for this param (`ShardedStep.describe` lists it).
    """

    def whole(self) -> jax.Array:
        _note_whole_read(self.path, self.split)
        return _whole(self._local(), self.split, self.batch_axes)

    def __getitem__(self, index):
        return self.whole()[index]

    def __jax_array__(self):
        return self.whole()

    @property
    def shape(self):  # the whole param's, without gathering it
        held = self._held()
        split = self.split[len(self.split) - held.ndim:]
        return tuple(n * math.prod(lax.axis_size(a) for a in axes) for n, axes in zip(held.shape, split))

    @property
    def dtype(self):
        return self._held().dtype

    @property
    def ndim(self):
        return self._held().ndim

    def astype(self, dtype):
        return self.whole().astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LocalBlock(_SplitParam):
    """A split param's block on this device (`param` gathers its ZeRO axes)."""

    block: jax.Array
    split: Layout = dataclasses.field(metadata=dict(static=True))  # its layout, less a pipeline's stage axis
    batch_axes: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))
    path: str = dataclasses.field(metadata=dict(static=True))

    def _local(self):
        return self.block

    _held = _local


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ShardWithReplica(_SplitParam):
    """ZeRO-2's view of a param: its optimizer shard (differentiated) and the replica.

    The forward computes with the replica (no gather); the gradient is reduce-scattered
    onto the shard as soon as the layer's backward produces it, so the full gradients of
    all layers never coexist. `dim` counts from the end (a stacked layer loses its first).
    """

    shard: jax.Array
    replica: jax.Array
    dim: int = dataclasses.field(metadata=dict(static=True))  # negative: the split dim
    axes: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))  # the ZeRO axes of that dim
    vary: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))  # batch (and context) axes to leave unreduced
    split: Layout = dataclasses.field(metadata=dict(static=True))  # the replica's layout, as LocalBlock's
    batch_axes: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))
    path: str = dataclasses.field(metadata=dict(static=True))
    reduce: object = dataclasses.field(default=None, metadata=dict(static=True))  # the scatter's dtype (None: the gradient's)

    def _local(self):
        return _replica_with_scattered_grad(self.shard, self.replica, self.dim, self.axes, self.vary, self.reduce)

    def _held(self):  # what `_local` computes with, for its shape and dtype
        return self.replica


# Params a step's trace read whole (path -> the axes gathered), while a step records them.
_whole_reads: dict[str, tuple[str, ...]] | None = None


def _note_whole_read(path: str, split: Layout) -> None:
    if _whole_reads is not None:
        _whole_reads[path] = tuple(a for axes in split for a in axes)


@contextlib.contextmanager
def recording_whole_reads(into: dict[str, tuple[str, ...]]):
    """Record, into `into`, each split param that a plain read gathers whole while tracing."""
    global _whole_reads
    outer, _whole_reads = _whole_reads, into
    try:
        yield into
    finally:
        _whole_reads = outer


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _replica_with_scattered_grad(shard, replica, dim, axes, vary, reduce):
    # Varying over the batch (and context) axes, so autodiff hands backward this device's own gradient.
    return vma.vary(replica, vary)


def _replica_fwd(shard, replica, dim, axes, vary, reduce):
    # The shard is kept only for its type (a param: alive anyway).
    return _replica_with_scattered_grad(shard, replica, dim, axes, vary, reduce), shard


def _replica_bwd(dim, axes, vary, reduce, shard, cotangent):
    grad = lax.psum_scatter(cotangent.astype(reduce or cotangent.dtype), axes,
                            scatter_dimension=dim % cotangent.ndim, tiled=True)
    # Typed as the shard, which may vary where the replica does not (a pipeline's stage axis),
    # in its dtype (the master's, where the shard is the fp32 master of a bf16 replica).
    # The replica is not differentiated (None: a zero cotangent, never materialised).
    return vma.vary(grad.astype(shard.dtype), vma.varying_axes(shard)), None


_replica_with_scattered_grad.defvjp(_replica_fwd, _replica_bwd)


def _gathered_layout(names) -> Layout:
    """A weight's layout once `param` has gathered its ZeRO axes."""
    zero = set(active_rules().zero_axes)
    return tuple(tuple(a for a in axes if a not in zero) for axes in layout(names, "param"))


def param(variable: nnx.Variable, dtype=None) -> jax.Array:
    """The value a layer computes with, in `dtype` (the layer's compute dtype; None: the
    param's): inside a step, gathered over the ZeRO axes.

    The cast comes first, so ZeRO-3 gathers bf16 weights under bf16 compute (half the bytes
    of fp32 params, as FSDP2's param dtype), and its remat policy, which drops gathered
    values, drops the weight it computes with, not just the wider copy before the cast.
    """
    value = variable.get_value()
    if isinstance(value, ShardWithReplica):
        return value._local().astype(dtype or value.dtype)
    if isinstance(value, LocalBlock):
        value = value.block
    if dtype is not None:
        value = value.astype(dtype)
    if not in_step():
        return value
    names = variable.get_metadata()["out_sharding"]
    have, want = layout(names, "param"), _gathered_layout(names)
    if want == have:
        return value
    return relayout_local(value, have, want)


def gathers_weights() -> bool:
    """Inside a step whose params are split over ZeRO axes (ZeRO-3)."""
    rules = active_rules()
    return in_step() and rules.zero == 3 and any(lax.axis_size(a) > 1 for a in rules.zero_axes)


def holds_replicas() -> bool:
    """Inside a step whose params are replicas with sharded gradients (ZeRO-2)."""
    rules = active_rules()
    return in_step() and rules.zero == 2 and any(lax.axis_size(a) > 1 for a in rules.zero_axes)


_CASTS = {"pvary", "pcast"}  # type casts that move no data (JAX < 0.11 names the cast pvary)


def _only_casts(params) -> bool:
    jaxpr = params.get("call_jaxpr")
    return jaxpr is not None and all(str(e.primitive) in _CASTS for e in jaxpr.jaxpr.eqns)


def remat_policy(primitive, *_, **params) -> bool:
    """Inside a ZeRO-2 or ZeRO-3 step: save everything for backward except weights gathered
    over ZeRO axes, and except a param's mere type cast.

    The JAX shard_map tutorial's "FSDP as a remat policy": backward gathers each weight
    again instead of keeping every layer's gathered copy alive until then. Activations
    gathered over other axes (sequence parallelism's, over `tensor`) are kept: gathering
    them again would cost as much traffic as they save memory.

    ZeRO-2's weight, the replica typed varying (`ShardWithReplica`), costs nothing to
    recompute; saved, a layer scan would stack a copy of every layer's weights for backward.
    (A dtype conversion is not such a cast: it is saved, or its wider input would be.)
    """
    if str(primitive) in _CASTS or (str(primitive) == "custom_vjp_call" and _only_casts(params)):
        return False
    if str(primitive) != "all_gather":
        return True
    axes = params.get("axis_name", ())
    rules = active_rules()
    zero = set(rules.zero_axes) if rules is not None else None
    return zero is not None and not zero.intersection(axes if isinstance(axes, tuple) else (axes,))


def matmul(x: jax.Array, x_names, w: jax.Array, w_names) -> jax.Array:
    """Contract x's trailing dims with the dims of `w` that have the same names.

    The result has x's leading names, then w's other names, in order. Inside a step, the
    input is first laid out as the result wants its leading dims and as `w` has the
    contracted dims (gathering sequence-parallel activations before a column-parallel
    weight); a contracted dim split over an axis leaves a partial sum, reduced onto the
    result's layout (a psum, or a reduce-scatter along seq under sequence parallelism).
    Names leading both x and w are batch dims of the product, laid out as the weight has them
    (a stack of experts' weights, each meeting its expert's rows).
    """
    x_names, w_names = tuple(x_names), tuple(w_names)
    shared = [name for name in x_names if name is not None and name in w_names]
    # x's trailing names that w has are contracted; shared names leading both x and w are batch
    # dims of the product (a stack of experts' weights, one per expert's rows).
    trailing = 0
    while trailing < len(x_names) and x_names[-1 - trailing] is not None and x_names[-1 - trailing] in w_names:
        trailing += 1
    contracted = list(x_names[len(x_names) - trailing:])
    batched = 0
    while batched < len(shared) - trailing and x_names[batched] == w_names[batched]:
        batched += 1
    lead = x_names[batched: len(x_names) - trailing]
    if len(shared) != batched + trailing:
        raise ValueError(f"matmul: the names shared by x {x_names} and w {w_names} must lead both (batch dims) "
                         "or trail x (contracted)")
    w_contracted = [w_names.index(name) for name in contracted]
    w_free = [i for i in range(batched, len(w_names)) if i not in w_contracted]
    y_names = x_names[:batched] + lead + tuple(w_names[i] for i in w_free)
    dims = ((tuple(range(len(x_names) - len(contracted), len(x_names))), tuple(w_contracted)),
            (tuple(range(batched)), tuple(range(batched))))
    if not in_step():  # (inside a plain shard_map, x may vary where w does not)
        return constrain(lax.dot_general(*vma.match(x, w), dims), y_names)
    w_layout = _gathered_layout(w_names)
    # Leading dims as the result wants them, less the axes the weight holds: those reach
    # the result only when a partial sum is reduce-scattered (row-parallel, sequence parallel).
    w_axes = {a for axes in w_layout for a in axes}
    y_lead = tuple(tuple(a for a in axes if a not in w_axes) for axes in layout(y_names)[batched: batched + len(lead)])
    x_want = w_layout[:batched] + y_lead + tuple(w_layout[i] for i in w_contracted)
    x = relayout_local(x, layout(x_names), x_want)
    partial = [a for i in w_contracted for a in w_layout[i]]
    y_have = w_layout[:batched] + y_lead + tuple(w_layout[i] for i in w_free)
    x, w = vma.match(x, w)  # a weight alike on every device of a batch axis meets this device's rows
    return relayout_local(lax.dot_general(x, w, dims), y_have, layout(y_names), partial)


# -- layers ---------------------------------------------------------------------------------


def _as_tuple(x) -> tuple:
    return (x,) if isinstance(x, (int, str)) or x is None else tuple(x)


class Linear(nnx.Module):
    """y = x · W over named dims: W is `in_names + out_names`, no bias."""

    def __init__(self, in_features, out_features, *, in_names, out_names, rngs: nnx.Rngs,
                 kernel_init=nnx.initializers.lecun_normal(), dtype=jnp.float32, param_dtype=jnp.float32):
        self.names = _as_tuple(in_names) + _as_tuple(out_names)
        self.dtype = dtype
        shape = _as_tuple(in_features) + _as_tuple(out_features)
        self.kernel = nnx.Param(kernel_init(rngs.params(), shape, param_dtype), **named(*self.names))

    def __call__(self, x: jax.Array, x_names: Sequence[str | None]) -> jax.Array:
        """`x` has dims `x_names`; its trailing ones are this layer's input names."""
        return matmul(x.astype(self.dtype), x_names, param(self.kernel, self.dtype), self.names)


class Embed(nnx.Module):
    """Rows of a (vocab, embed)-named table; vocab-parallel where the rules split the vocab."""

    def __init__(self, num_embeddings: int, features: int, *, names=("vocab", "embed"), rngs: nnx.Rngs,
                 embedding_init=nnx.initializers.normal(0.02), dtype=jnp.float32, param_dtype=jnp.float32):
        self.names, self.dtype = tuple(names), dtype
        self.embedding = nnx.Param(
            embedding_init(rngs.params(), (num_embeddings, features), param_dtype), **named(*self.names)
        )

    def __call__(self, ids: jax.Array, ids_names: Sequence[str | None], out_names: Sequence[str | None]) -> jax.Array:
        """Rows for int `ids`; inside a step `ids` arrive split over the batch axes only."""
        table = param(self.embedding, self.dtype)
        if not in_step():
            return constrain(jnp.take(table, ids, axis=0), out_names)
        ids = split_input(ids, ids_names)
        vocab_axes, embed_axes = _gathered_layout(self.names)
        rows = table.shape[0]  # this device holds rows [first, first + rows)
        local = ids - (lax.axis_index(vocab_axes) * rows if vocab_axes else 0)
        inside = (local >= 0) & (local < rows)
        table, local = vma.match(table, local)
        out = vma.where(inside[..., None], jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0), 0)
        return relayout_local(out, _input_layout(ids_names) + (embed_axes,), layout(out_names), vocab_axes)

    def attend(self, x: jax.Array, x_names: Sequence[str | None]) -> jax.Array:
        """Logits x · tableᵀ, a head tied to this table: (..., embed) -> (..., vocab)."""
        return matmul(x.astype(self.dtype), x_names, param(self.embedding, self.dtype), self.names)


class LayerNorm(nnx.Module):
    """Layer norm over the last dim (named `name`), with scale and bias."""

    def __init__(self, features: int, *, name: str = "embed", epsilon: float = 1e-6, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.epsilon, self.dtype = epsilon, dtype
        self.scale = nnx.Param(jnp.ones((features,), param_dtype), **named(name))
        self.bias = nnx.Param(jnp.zeros((features,), param_dtype), **named(name))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        variance = jnp.square(x - mean).mean(-1, keepdims=True)
        y = (x - mean) * lax.rsqrt(variance + self.epsilon)
        return (y * param(self.scale) + param(self.bias)).astype(self.dtype)


# -- attention ----------------------------------------------------------------------------

ATTENTION = ("auto", "xla", "cudnn")


def attention_implementation(choice: str, dtype, head_dim: int, platform: str | None = None) -> str:
    """Which kernel `attention` runs: "xla" (XLA's: keeps the seq × seq scores for backward)
    or "cudnn" (cuDNN's fused flash kernel: no scores kept). cuDNN needs a GPU, bf16 or fp16,
    and a head dim <= 128 and a multiple of 8; "auto" takes it where those hold (JAX's own
    default is XLA everywhere). `platform`: the default backend's unless given (the planner
    gives its hardware profile's)."""
    platform = platform or jax.default_backend()
    fits = platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim <= 128 and head_dim % 8 == 0
    if choice not in ATTENTION:
        raise ValueError(f"attention {choice!r}: choose one of {', '.join(ATTENTION)}")
    if choice == "cudnn" and not fits:
        raise ValueError(
            f"attention 'cudnn' needs a GPU, bf16 or fp16 and a head dim <= 128 and a multiple of 8; here: "
            f"{platform}, {jnp.dtype(dtype).name}, head dim {head_dim}. Fix: attention 'auto' or 'xla'.")
    return "cudnn" if choice == "auto" and fits else "xla" if choice == "auto" else choice


def attention(q: jax.Array, k: jax.Array, v: jax.Array, choice: str = "auto") -> jax.Array:
    """Causal attention of (batch, seq, heads, head_dim) queries over (batch, seq, kv_heads,
    head_dim) keys and values (kv_heads dividing heads: grouped-query), by `choice`'s kernel.

    Inside a step whose rules split attention's `seq` (context parallelism), each device holds
    its load-balanced chunks of the sequence and attends over every device's keys and values:
    `context_attention`."""
    if context_axes():
        return context_attention(q, k, v)
    implementation = attention_implementation(choice, q.dtype, q.shape[-1])
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


# -- context parallelism ----------------------------------------------------------------------
#
# Rules that put attention's `seq` on mesh axes (the `cp` preset: `context`) split every
# sequence over them. Causal attention gives later tokens more work, so the split is load-
# balanced, as Megatron's CP: over n devices the sequence is cut into 2n chunks and device i
# holds chunks i and 2n-1-i, one early and one late. Inside a step a sequence is held in that
# order throughout; it is applied where the step's inputs (token ids, labels) are split
# (`split_input`) and read back where positions matter (`positions`), and nothing between
# (the residual stream, the MLP, the loss) cares about the order of the tokens.

def context_axes() -> tuple[str, ...]:
    """Inside a step: the mesh axes (of size > 1) the rules split attention's `seq` over, context
    parallelism's (`Rules.context_axes`). () elsewhere, and where only the residual stream's seq
    is split (sequence parallelism gathers it before attention)."""
    if not in_step():
        return ()
    return active_rules().context_axes(jax.sharding.get_abstract_mesh())


def check_context_length(length: int, n: int) -> None:
    """Context parallelism over n devices cuts each sequence into 2n equal chunks."""
    if n > 1 and length % (2 * n):
        raise ShardingError(f"context parallelism over {n} devices cuts a sequence into {2 * n} equal chunks; "
                            f"{length} tokens do not divide by {2 * n}. Fix: a seq-len that is a multiple of {2 * n}.")


def balanced_order(length: int, n: int) -> jax.Array:
    """The positions of a `length`-token sequence in the load-balanced order over n devices:
    device i's block (the i-th of n) holds chunks i and 2n-1-i of 2n."""
    check_context_length(length, n)
    chunks = jnp.arange(length).reshape(2 * n, length // (2 * n))
    return jnp.stack([chunks[:n], chunks[::-1][:n]], axis=1).reshape(length)


def _input_layout(names) -> Layout:
    """A step input (token ids, labels) once split: over the batch axes, and its seq over the context axes."""
    context = set(context_axes())
    return tuple(axes if name == "batch" else tuple(a for a in axes if a in context)
                 for name, axes in zip(names, layout(names)))


# Inputs split over the context axes while a step traces (None: not recording).
_context_splits: list | None = None


@contextlib.contextmanager
def recording_context_splits(into: list):
    """Record, into `into`, the names of each step input that `split_input` splits over context axes."""
    global _context_splits
    outer, _context_splits = _context_splits, into
    try:
        yield into
    finally:
        _context_splits = outer


def split_input(x: jax.Array, names) -> jax.Array:
    """A step input, which arrives split over the batch axes only, as this device's share under
    context parallelism: each seq dim's load-balanced chunks (`_input_layout`). The identity
    outside a step and without context parallelism."""
    if not in_step():
        return x
    for dim, axes in enumerate(_input_layout(names)):
        if axes and names[dim] != "batch":
            if _context_splits is not None:
                _context_splits.append(tuple(names))
            n = lax.axis_size(axes)
            mine = balanced_order(x.shape[dim], n).reshape(n, -1)[lax.axis_index(axes)]
            x = jnp.take(vma.vary(x, axes), mine, axis=dim)
    return x


def laid_out_input(x: jax.Array, names, dst: Layout) -> jax.Array:
    """A step input (split over the batch axes only) as layout `dst`: its context chunks taken
    (`split_input`), then moved like any block (sequence parallelism's slice, say)."""
    return relayout_local(split_input(x, names), _input_layout(names), dst)


def positions(x: jax.Array, names, dim: int = 1) -> jax.Array:
    """The sequence positions of dim `dim` of activation `x` (named `names`) on this device: in
    a step, of its share of the sequence (context parallelism's chunks, sequence parallelism's
    slice), else 0, 1, ...; int32."""
    if not in_step():
        return jnp.arange(x.shape[dim])
    have = layout(names)[dim]
    whole = x.shape[dim] * math.prod(lax.axis_size(a) for a in have)
    return laid_out_input(jnp.arange(whole), ("seq",), (have,))  # positions as a step input would be


def context_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention under context parallelism, as the active rules choose (`Rules.context_attention`):
    "ring" passes each device's keys and values round the context axes (`ring_attention`);
    "gather" all-gathers them (Llama 3's choice: one collective, the whole K/V held at once)."""
    axes = context_axes()
    if active_rules().context_attention == "gather":
        return gathered_kv_attention(q, k, v, axes)
    return ring_attention(q, k, v, axes)


def _scores(q, k, mask):
    """fp32 scores (batch, kv_heads, group, q_len, k_len) of grouped queries over keys; -inf
    where the (q_len, k_len) `mask` is False (None: nowhere)."""
    b, sq, h, d = q.shape
    g = h // k.shape[2]
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q.reshape(b, sq, h // g, g, d), k,
                   preferred_element_type=jnp.float32) / math.sqrt(d)
    return s if mask is None else vma.where(mask, s, -jnp.inf)


def _ungroup(x):
    """(batch, kv_heads, group, q, ...) -> (batch, q, heads, ...)."""
    b, hk, g, sq = x.shape[:4]
    return jnp.moveaxis(x.reshape(b, hk * g, sq, *x.shape[4:]), 2, 1)


def gathered_kv_attention(q, k, v, axes):
    """Queries of this device's chunks over every device's keys and values, all-gathered (their
    transpose in backward: a reduce-scatter of dK, dV), masked by the positions both hold."""
    k, v = (lax.all_gather(t, axes, axis=1, tiled=True) for t in (k, v))
    n = lax.axis_size(axes)
    whole = balanced_order(k.shape[1], n)
    mine = whole.reshape(n, -1)[lax.axis_index(axes)]
    s = _scores(q, k, mine[:, None] >= whole[None, :])
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return _ungroup(out).astype(q.dtype)


# Ring attention. Device i holds queries Q_i and keys / values (K_i, V_i) of chunks (i, 2n-1-i).
# In ring step t it attends with the block of device j = i - t (mod n), then passes the block on
# (`ppermute` to i + 1). Over the chunk order, causality is a pattern of halves: j = i is
# causal within the block; j < i, both query chunks see key chunk j whole and chunk 2n-1-j not
# at all; j > i, only query chunk 2n-1-i sees anything, the block whole. So each step after the
# first costs every device half a block's work, the same on all: no device idles. Each block's
# softmax is merged into the running one by its log-sum-exp (the online softmax); backward is a
# second ring in which the keys and values travel with their gradients and arrive home with
# every device's contribution.


def _grouped(x, kv_heads):
    """(batch, q, heads, d) -> (batch, q, kv_heads, group, d)."""
    b, sq, h, d = x.shape
    return x.reshape(b, sq, kv_heads, h // kv_heads, d)


# Queries per tile within a block: a block's attention runs tile by tile (a loop), so its working
# set is one tile's scores over the block's keys, not all its queries' (a flash kernel's idea,
# at the granularity of XLA ops).
QUERY_TILE = 512


def query_tile(length: int) -> int:
    """Queries per tile for a block of `length`: the largest divisor of it up to QUERY_TILE."""
    return max(d for d in range(1, min(length, QUERY_TILE) + 1) if length % d == 0)


def _split_rows(x, dim: int, tile: int):
    """x with dim `dim` cut into tiles, the tiles leading: (..., n·tile, ...) -> (n, ..., tile, ...)."""
    x = jnp.moveaxis(x, dim, 0)
    return jnp.moveaxis(x.reshape(x.shape[0] // tile, tile, *x.shape[1:]), 1, dim + 1)


def _join_rows(x, dim: int):
    """The inverse of `_split_rows`."""
    x = jnp.moveaxis(x, dim + 1, 1)
    return jnp.moveaxis(x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), 0, dim)


def _block_forward(q, k, v, mask):
    """One block: output (batch, q, heads, d) in fp32, and log-sum-exp (batch, kv_heads, group, q),
    of queries over keys where `mask` (q, k) allows (None: everywhere), a tile of queries at a time."""
    tile = query_tile(q.shape[1])

    def one_tile(tiles):
        q, mask = tiles
        s = _scores(q, k, mask)
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.exp(s - lse[..., None])
        return _ungroup(jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)), lse

    masks = None if mask is None else _split_rows(mask, 0, tile)
    out, lse = lax.map(one_tile, (_split_rows(q, 1, tile), masks))
    return _join_rows(out, 1), _join_rows(lse, 3)


def _block_backward(q, k, v, d_out, lse, delta, mask):
    """One block's dq (batch, q, heads, d), dk, dv (batch, k, kv_heads, d), fp32, from the
    output's gradient, the rows' log-sum-exp over every block and delta = rowsum(dO · O), a tile
    of queries at a time (dk and dv summed over the tiles)."""
    hk, tile = k.shape[2], query_tile(q.shape[1])
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)

    def one_tile(dkv, tiles):
        q, d_out, lse, delta, mask = tiles
        p = jnp.exp(_scores(q, k, mask) - lse[..., None])  # the softmax's share of this block
        do = _grouped(d_out, hk).astype(jnp.float32)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", do, v32)
        ds = p * (dp - delta[..., None]) / math.sqrt(q.shape[-1])
        dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k32).reshape(q.shape)
        dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, _grouped(q, hk).astype(jnp.float32))
        return (dkv[0] + dk, dkv[1] + jnp.einsum("bhgqk,bqhgd->bkhd", p, do)), dq

    tiles = (_split_rows(q, 1, tile), _split_rows(d_out, 1, tile), _split_rows(lse, 3, tile),
             _split_rows(delta, 3, tile), None if mask is None else _split_rows(mask, 0, tile))
    varying = frozenset().union(*map(vma.varying_axes, (q, k, v, d_out)))
    zero = vma.vary(jnp.zeros(k.shape, jnp.float32), varying)
    (dk, dv), dq = lax.scan(one_tile, (zero, zero), tiles)
    return _join_rows(dq, 1), dk, dv


def _own_block_mask(c: int) -> jax.Array:
    """Causality within a device's own block of chunks (i, 2n-1-i), c tokens each: each chunk
    causal over itself; the late chunk sees the early one whole, the early one nothing of the late."""
    tril = jnp.tril(jnp.ones((c, c), bool))
    return jnp.block([[tril, jnp.zeros((c, c), bool)], [jnp.ones((c, c), bool), tril]])


def _from_earlier(axes, t):
    """Whether ring step t's block comes from a device j < i (else j > i; t = 0: j = i)."""
    i = lax.axis_index(axes)
    return (i - t) % lax.axis_size(axes) < i


def _half(x, dim, second: bool, empty: float):
    """x (the length of one chunk along `dim`) placed in the first or second half of a
    twice-as-long value whose other half is `empty`."""
    fill = vma.zeros_like(x) + empty
    return jnp.concatenate([fill, x] if second else [x, fill], axis=dim)


def _ring_forward_step(q, k, v, t, axes):
    c = q.shape[1] // 2
    if t == 0:
        return _block_forward(q, k, v, _own_block_mask(c))

    def earlier(q, k, v):  # both query chunks over key chunk j
        return _block_forward(q, k[:, :c], v[:, :c], None)

    def later(q, k, v):  # query chunk 2n-1-i over both of j's
        out, lse = _block_forward(q[:, c:], k, v, None)
        return _half(out, 1, True, 0.0), _half(lse, 3, True, -jnp.inf)

    return lax.cond(_from_earlier(axes, t), earlier, later, q, k, v)


def _ring_backward_step(q, k, v, d_out, lse, delta, t, axes):
    c = q.shape[1] // 2
    if t == 0:
        return _block_backward(q, k, v, d_out, lse, delta, _own_block_mask(c))

    def earlier(q, k, v, d_out, lse, delta):
        dq, dk, dv = _block_backward(q, k[:, :c], v[:, :c], d_out, lse, delta, None)
        return dq, _half(dk, 1, False, 0.0), _half(dv, 1, False, 0.0)

    def later(q, k, v, d_out, lse, delta):
        dq, dk, dv = _block_backward(q[:, c:], k, v, d_out[:, c:], lse[..., c:], delta[..., c:], None)
        return _half(dq, 1, True, 0.0), dk, dv

    return lax.cond(_from_earlier(axes, t), earlier, later, q, k, v, d_out, lse, delta)


def _pass_on(x, axes):
    """x sent one step round the ring of `axes`: device i's to device i + 1."""
    n = lax.axis_size(axes)
    return lax.ppermute(x, axes, [(i, (i + 1) % n) for i in range(n)])


def _ring_attention_fwd(q, k, v, axes):
    n = lax.axis_size(axes)
    kv, out, lse = (k, v), None, None
    for t in range(n):
        following = _pass_on(kv, axes) if t < n - 1 else None  # the next block travels while this one computes
        block_out, block_lse = _ring_forward_step(q, *kv, t, axes)
        if out is None:
            out, lse = block_out, block_lse
        else:  # the online softmax: both weighted by their share of the merged normaliser
            merged = jnp.logaddexp(lse, block_lse)
            scale_old, scale_new = (_ungroup(jnp.exp(x - merged)[..., None]) for x in (lse, block_lse))
            out, lse = out * scale_old + block_out * scale_new, merged
        kv = following
    out = out.astype(q.dtype)
    return out, (q, k, v, out, lse)


def _ring_attention_bwd(axes, residuals, d_out):
    q, k, v, out, lse = residuals
    n = lax.axis_size(axes)
    hk = k.shape[2]
    grouped = [_grouped(x, hk).astype(jnp.float32) for x in (d_out, out)]
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", *grouped)  # rowsum(dO · O): the softmax's backward term
    kv, dq, dkv = (k, v), None, None
    for t in range(n):
        following = _pass_on(kv, axes) if t < n - 1 else None
        block_dq, dk, dv = _ring_backward_step(q, *kv, d_out, lse, delta, t, axes)
        dq = block_dq if dq is None else dq + block_dq
        dkv = (dk, dv) if dkv is None else (dkv[0] + dk, dkv[1] + dv)
        dkv = _pass_on(dkv, axes)  # with its block: after n steps, home with every device's share
        kv = following
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Causal attention of this device's load-balanced chunks of queries over every device's
    keys and values, passed round the ring of mesh `axes` (see above); inside a step."""
    return _ring_attention_fwd(q, k, v, axes)[0]


ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last dim (named `name`), with a scale and no bias (Llama's)."""

    def __init__(self, features: int, *, name: str = "embed", epsilon: float = 1e-6, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.epsilon, self.dtype = epsilon, dtype
        self.scale = nnx.Param(jnp.ones((features,), param_dtype), **named(name))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        y = x * lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + self.epsilon)
        return (y * param(self.scale)).astype(self.dtype)


# -- decoding with a KV cache -------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """The keys and values of the positions a decoder has seen, so that each new token costs
    one token's work: (batch, length, kv heads, head_dim) each for one attention layer, with
    a leading `layers` dim for a stack of them (scanned with the layers). Laid out by the
    rules as `names` say (one layer's names: batch, seq, the heads' name, kv), so a tensor-
    parallel model keeps each device's heads' keys and values on that device. Positions not
    yet written hold zeros; `cached_attention` masks them."""

    k: jax.Array
    v: jax.Array
    names: tuple = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def zeros(cls, layers: int, batch: int, length: int, heads: int, head_dim: int, names, dtype) -> KVCache:
        def empty():
            return constrain(jnp.zeros((layers, batch, length, heads, head_dim), dtype), ("layers", *names))

        return cls(empty(), empty(), tuple(names))

    def write(self, k: jax.Array, v: jax.Array, position: jax.Array) -> KVCache:
        """With the keys and values (batch, new, heads, head_dim) of new tokens stored at
        positions position, position + 1, ... (one layer's cache)."""

        def put(cache, new):
            cache = lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), position, axis=1)
            return constrain(cache, self.names)

        return KVCache(put(self.k, k), put(self.v, v), self.names)


def cached_attention(q: jax.Array, cache: KVCache, position: jax.Array) -> jax.Array:
    """Causal attention of new queries (batch, new, heads, head_dim) at positions position, ...
    over a cache that holds their own keys and values and those of every earlier position;
    each query sees the positions up to its own (grouped-query as `attention`). XLA's kernel:
    the mask over the cache's fixed length keeps one compiled program for every position."""
    seen = (position + jnp.arange(q.shape[1]))[:, None] >= jnp.arange(cache.k.shape[1])
    return jax.nn.dot_product_attention(q, cache.k, cache.v, mask=seen[None, None], implementation="xla")


# -- losses a layer adds ------------------------------------------------------------------

_loss_scale: contextvars.ContextVar[float] = contextvars.ContextVar("jshard_loss_scale", default=1.0)


@contextlib.contextmanager
def scaled_losses(scale: float):
    """Within this block, losses added in backward (`with_loss_gradient`) are scaled by `scale`:
    a pipeline seeds each micro-batch's loss with 1/M in backward, so it scales theirs too."""
    token = _loss_scale.set(_loss_scale.get() * scale)
    try:
        yield
    finally:
        _loss_scale.reset(token)


def with_loss_gradient(y: jax.Array, loss: jax.Array, weight: float) -> jax.Array:
    """y, unchanged; in backward `loss` gets the cotangent `weight`: as if weight · loss were
    added to the loss being differentiated, though the loss reported does not show it (an
    auxiliary loss, such as a router's load balancing; Megatron's MoEAuxLossAutoScaler).

    Inside a step `loss` is this device's share, as a step's loss is: the mean over the batch
    shards is the whole. Where devices computed it alike (over tensor or context) it is averaged
    first, so that its gradient counts once."""
    if in_step():
        rules = active_rules()
        keep = {a for name, axes in rules.activations + rules.params if name in ("batch", "layers") for a in axes}
        spread = tuple(sorted(vma.varying_axes(loss) - keep))
        loss = lax.pmean(loss, spread) if spread else loss
    return _with_loss_gradient(y, loss, weight * _loss_scale.get())


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _with_loss_gradient(y, loss, weight):
    return y


def _with_loss_fwd(y, loss, weight):
    return y, loss


def _with_loss_bwd(weight, loss, g):
    return g, vma.zeros_like(loss) + jnp.asarray(weight, loss.dtype)


_with_loss_gradient.defvjp(_with_loss_fwd, _with_loss_bwd)


# -- loss -------------------------------------------------------------------------------------


def cross_entropy(logits: jax.Array, labels: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Mean next-token cross-entropy; vocab-parallel where the rules split the last dim.

    Inside a step, `labels` arrive split over the batch axes only and the mean is over
    this device's share of the batch (the step averages over the batch axes).
    """
    logits = logits.astype(jnp.float32)
    if not in_step():
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1))
    logits_layout = layout(names)
    vocab_axes = logits_layout[-1]
    # Labels have the logits' layout on their dims (sequence-parallel logits split seq).
    labels = laid_out_input(labels, names[:-1], logits_layout[:-1])
    peak = lax.stop_gradient(logits.max(-1))
    if vocab_axes:
        peak = lax.pmax(peak, vocab_axes)
    total = jnp.exp(logits - peak[..., None]).sum(-1)
    rows = logits.shape[-1]
    local = labels - (lax.axis_index(vocab_axes) * rows if vocab_axes else 0)
    inside = (local >= 0) & (local < rows)
    picked = vma.where(inside, jnp.take_along_axis(logits, jnp.clip(local, 0, rows - 1)[..., None], -1)[..., 0], 0.0)
    if vocab_axes:
        total, picked = lax.psum(total, vocab_axes), lax.psum(picked, vocab_axes)
    losses = jnp.log(total) + peak - picked
    # Sequence-parallel logits: this device holds a slice of the sequence; average over all.
    split = [a for d, axes in enumerate(logits_layout[:-1]) if names[d] != "batch" for a in axes]
    mean = losses.mean()
    return lax.pmean(mean, split) if split else mean
