"""The step's split-param protocol: what a layer computes with when a step hands it a block.

Inside a step a split param reaches the model as its block (`LocalBlock`) or, under ZeRO-2,
as its optimizer shard paired with the replica the forward uses (`ShardWithReplica`).
`param` computes with it as the layer's names say: cast to the compute dtype, then gathered
over the ZeRO axes (ZeRO-3). Any other read gets the param whole, gathered so that autodiff
stays right, and recorded in the step context (`whole_reads`, for `ShardedStep.describe`).
`remat_policy` is ZeRO's: backward gathers a weight again instead of keeping it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.experimental.layout import Layout as MemoryLayout
from jax.experimental.layout import with_layout_constraint

from jshard import vma
from jshard.nn.layouts import Layout, layout, relayout_local
from jshard.nn.step_context import current_step, in_step
from jshard.rules import active_rules


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

    @property
    def size(self):
        return math.prod(self.shape)

    def __len__(self):  # without gathering, as `shape`
        return self.shape[0]

    def __iter__(self):
        return iter(self.whole())

    def __getattr__(self, name):  # any other array attribute or method (.T, .reshape, .sum, ...): the whole's
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.whole(), name)


def _on_whole(op: str):
    def method(self, *args):
        return getattr(self.whole(), op)(*args)
    method.__name__ = op
    return method


# Every operator Flax's Variable forwards to its value, and the unary ones: on the whole param.
# (Not == and !=: a split param compares as the dataclass it is.)
for _op in ("add sub mul matmul truediv floordiv mod pow lshift rshift and xor or radd rsub rmul rmatmul rtruediv "
            "rfloordiv rmod rpow rlshift rrshift rand rxor ror lt le gt ge neg pos abs invert").split():
    setattr(_SplitParam, f"__{_op}__", _on_whole(f"__{_op}__"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LocalBlock(_SplitParam):
    """A split param's block on this device (`param` gathers its ZeRO axes).

    With `summed` axes (a ZeRO-3 layer's weight, `Plan.summed_in_backward`), its gradient is
    summed over them where the backward produces it, just after the gather's reduce-scatter:
    layer by layer inside the backward loop, where a step's end would sum every layer at once
    with nothing left to hide behind. The sum runs in `reduce` (fp32 under `mixed`) and its
    result is the block's gradient, in the block's dtype (bf16 under `mixed`, as the
    reduce-scatter's: an fp32 gradient here would hold the whole stack's in fp32).
    """

    block: jax.Array
    split: Layout = dataclasses.field(metadata=dict(static=True))  # its layout, less a pipeline's stage axis
    batch_axes: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))
    path: str = dataclasses.field(metadata=dict(static=True))
    summed: tuple[str, ...] = dataclasses.field(default=(), metadata=dict(static=True))
    reduce: object = dataclasses.field(default=None, metadata=dict(static=True))  # the sum's dtype (None: the gradient's)

    def _local(self):
        if not self.summed:
            return self.block
        return _with_reduced_grad(self.block, self.block, None, (), self.summed, self.summed, self.reduce)

    def _held(self):
        return self.block


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
        return _with_reduced_grad(self.shard, self.replica, self.dim, self.axes, (), self.vary, self.reduce)

    def _held(self):  # what `_local` computes with, for its shape and dtype
        return self.replica


def _note_whole_read(path: str, split: Layout) -> None:
    """Record, in the step context, a split param that a plain read gathers whole (path -> the axes gathered)."""
    whole_reads = current_step().whole_reads
    if whole_reads is not None:
        whole_reads[path] = tuple(a for axes in split for a in axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _with_reduced_grad(source, value, dim, scattered, summed, vary, reduce):
    """`value`, whose gradient goes to `source` reduced: reduce-scattered over `scattered` onto
    `dim` (ZeRO-2's shard of a replica), then summed over `summed` (ZeRO-3's batch axes), in
    `reduce`. Varying over `vary` (the batch and context axes), so that autodiff hands the
    backward this device's own gradient."""
    return vma.vary(value, vary)


def _reduced_grad_fwd(source, value, dim, scattered, summed, vary, reduce):
    # The source is kept only for its type (a param or its master: alive anyway).
    return _with_reduced_grad(source, value, dim, scattered, summed, vary, reduce), source


def _reduced_grad_bwd(dim, scattered, summed, vary, reduce, source, cotangent):
    grad = cotangent.astype(reduce or cotangent.dtype)
    if scattered:
        grad = lax.psum_scatter(grad, scattered, scatter_dimension=dim % cotangent.ndim, tiled=True)
    if summed:
        grad = lax.psum(grad, summed)
    # Typed as the source, which may vary where the value does not (a pipeline's stage axis),
    # in its dtype (the master's, where the source is the fp32 master of a bf16 value).
    # The value is not differentiated (None: a zero cotangent, never materialised).
    return vma.vary(grad.astype(source.dtype), vma.varying_axes(source)), None


_with_reduced_grad.defvjp(_reduced_grad_fwd, _reduced_grad_bwd)


def gathered_layout(names) -> Layout:
    """A weight's layout once `param` has gathered its ZeRO axes."""
    zero = set(active_rules().zero_axes)
    return tuple(tuple(a for a in axes if a not in zero) for axes in layout(names, "param"))


def held(variable: nnx.Variable, dtype=None) -> jax.Array:
    """The param as this device holds it, in `dtype` (None: the param's): inside a ZeRO-3 step
    its block, not gathered (`param` gathers it; an FP8 matmul gathers it in FP8, `fp8.dot`)."""
    value = variable.get_value()
    if isinstance(value, ShardWithReplica):
        return value._local().astype(dtype or value.dtype)
    if isinstance(value, LocalBlock):
        value = value._local()
    return value if dtype is None else value.astype(dtype)


def param(variable: nnx.Variable, dtype=None) -> jax.Array:
    """The value a layer computes with, in `dtype` (the layer's compute dtype; None: the
    param's): inside a step, gathered over the ZeRO axes.

    The cast comes first, so ZeRO-3 gathers bf16 weights under bf16 compute (half the bytes
    of fp32 params, as FSDP2's param dtype), and its remat policy, which drops gathered
    values, drops the weight it computes with, not just the wider copy before the cast.
    """
    return gathered(variable, held(variable, dtype))


def gathered(variable: nnx.Variable, value: jax.Array) -> jax.Array:
    """`param`'s gather of `value`, `variable`'s held value (cast) or a value standing for it."""
    if not in_step() or isinstance(variable.get_value(), ShardWithReplica):
        return value
    names = variable.get_metadata()["out_sharding"]
    # A scan over a stack (a user's lax.scan, not scan_layers) hands each layer its slice with
    # the stack's names still on: the leading names are the dims the scan took away.
    names = tuple(names)[len(names) - value.ndim:]
    have, want = layout(names, "param"), gathered_layout(names)
    if want == have:
        return value
    # Row-major, as the param is held (`Plan.pins_weight_layouts` says where and why).
    if current_step().pin_layouts and have[1:] != want[1:]:
        value = with_layout_constraint(value, MemoryLayout(major_to_minor=tuple(range(value.ndim))))
    return relayout_local(value, have, want)


@jax.custom_vjp
def released_together(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`x` and `w` unchanged; in the backward their gradients come out together (an optimization
    barrier), so that neither is used before both are computed: given a layer's input and its
    held weight, the weight's gradient is computed and reduce-scattered before the input's
    gradient goes on to the layers below (`Plan.head_backward_first`)."""
    return x, w


def _released_forward(x, w):
    return (x, w), None


def _released_backward(_, gradients):
    return lax.optimization_barrier(gradients)


released_together.defvjp(_released_forward, _released_backward)


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
    if str(primitive) == "bitcast_convert_type" and jnp.dtype(params["new_dtype"]).itemsize == 1 \
            and jnp.issubdtype(params["new_dtype"], jnp.floating):  # FP8 from its bytes: keep the bytes (`fp8.as_bytes`)
        return False
    if str(primitive) != "all_gather":
        return True
    axes = params.get("axis_name", ())
    rules = active_rules()
    zero = set(rules.zero_axes) if rules is not None else None
    return zero is not None and not zero.intersection(axes if isinstance(axes, tuple) else (axes,))
