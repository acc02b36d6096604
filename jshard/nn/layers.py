"""The layers: `matmul` over named dims, and `Linear`, `Embed`, `LayerNorm`, `RMSNorm` on it;
the elementwise work between them (`gelu`, `swiglu`, the norms) `recomputed` in backward.

A layer knows the names of its input, weight and output, never a mesh axis; inside a step
`matmul` derives its collectives from the layouts the rules give those names (gather a
sequence-parallel input, reduce a row-parallel partial sum), `Embed` is vocab-parallel
where the rules split the vocab. Outside a step these are plain Flax layers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jshard import vma
from jshard.nn.collective_matmul import gather_matmul, matmul_scatter, ring_step
from jshard.nn.context_parallel import input_layout, split_input
from jshard.nn.fp8 import dot as fp8_dot
from jshard.nn.layouts import layout, relayout_local
from jshard.nn.params import gathered, gathered_layout, held, param, released_together
from jshard.nn.step_context import compute_dtype, current_step, in_step
from jshard.rules import active_rules, constrain, named


def recomputed(f):
    """`f` keeping only its inputs for backward, which runs `f` again.

    For the elementwise work between matmuls: a norm's float32 intermediates and an
    activation's are several times its input's bytes per layer if kept (measured: a GPT layer
    under XLA:GPU keeps 76 bytes per token and embed element with them, 32 without, against
    Megatron's 34; docs/gpu-compile.md), and cost one cheap elementwise pass to recompute. A custom VJP,
    not `jax.checkpoint`: an enclosing checkpoint's policy (the stack's remat, ZeRO's) decides
    for everything inside it, a nested checkpoint's included; a custom VJP's residuals are its own.
    """

    @jax.custom_vjp
    def run(*args):
        return f(*args)

    def forward(*args):
        return f(*args), args

    def backward(args, dy):
        return jax.vjp(f, *args)[1](dy)

    run.defvjp(forward, backward)
    return functools.wraps(f)(run)


gelu = recomputed(jax.nn.gelu)  # the tanh approximation (GPT-2's)


@recomputed
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """Llama's gated activation, silu(gate) · up."""
    return jax.nn.silu(gate) * up


def matmul(x: jax.Array, x_names, w: jax.Array, w_names, fp8: bool = False) -> jax.Array:
    """Contract x's trailing dims with the dims of `w` that have the same names.

    The result has x's leading names, then w's other names, in order. Inside a step, the
    input is first laid out as the result wants its leading dims and as `w` has the
    contracted dims (gathering sequence-parallel activations before a column-parallel
    weight); a contracted dim split over an axis leaves a partial sum, reduced onto the
    result's layout (a psum, or a reduce-scatter along seq under sequence parallelism).
    Names leading both x and w are batch dims of the product, laid out as the weight has them
    (a stack of experts' weights, each meeting its expert's rows).

    `fp8`: the product in FP8 (`fp8.dot`); inside a step `w` is then the weight as this
    device holds it (`params.held`), which the FP8 product gathers in FP8 (ZeRO-3).
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
        return constrain((fp8_dot if fp8 else lax.dot_general)(*vma.match(x, w), dims), y_names)
    w_layout = gathered_layout(w_names)
    # Leading dims as the result wants them, less the axes the weight holds: those reach
    # the result only when a partial sum is reduce-scattered (row-parallel, sequence parallel).
    w_axes = {a for axes in w_layout for a in axes}
    y_lead = tuple(tuple(a for a in axes if a not in w_axes) for axes in layout(y_names)[batched: batched + len(lead)])
    x_want = w_layout[:batched] + y_lead + tuple(w_layout[i] for i in w_contracted)
    partial = [a for i in w_contracted for a in w_layout[i]]
    y_have = w_layout[:batched] + y_lead + tuple(w_layout[i] for i in w_free)
    x_have, y_want, leading = layout(x_names), layout(y_names), range(batched, batched + len(lead))
    if active_rules().collective_matmul and not fp8:  # a gather or a reduce-scatter along a leading dim: a ring
        # (an FP8 step with collective matmuls is refused: `parallel.plan.make_plan`)
        if not partial and (ring := ring_step(x_want, x_have, leading)) and y_have == y_want:
            return gather_matmul(*vma.match(x, w), dims, *ring)
        if ((ring := ring_step(y_have, y_want, leading)) and partial == [ring[1]] and x_have == x_want
                and x.shape[ring[0]] % lax.axis_size(ring[1]) == 0):
            return matmul_scatter(*vma.match(x, w), dims, *ring)
    x = relayout_local(x, x_have, x_want)
    x, w = vma.match(x, w)  # a weight alike on every device of a batch axis meets this device's rows
    y = fp8_dot(x, w, dims, layout(w_names, "param"), w_layout) if fp8 else lax.dot_general(x, w, dims)
    return relayout_local(y, y_have, y_want, partial)


def _as_tuple(x) -> tuple:
    return (x,) if isinstance(x, (int, str)) or x is None else tuple(x)


class Linear(nnx.Module):
    """y = x · W (+ b) over named dims: W is `in_names + out_names`, b (with `bias`) `out_names`.

    A projection: under the `fp8` precision policy its product runs in FP8 (`fp8.dot`), unless
    built with `fp8=False` (a head, a router: what FP8's rounding would hurt, or too small to
    gain). The kernel's metadata says which (`fp8`), for the step and the planner alike.
    """

    def __init__(self, in_features, out_features, *, in_names, out_names, rngs: nnx.Rngs,
                 kernel_init=nnx.initializers.lecun_normal(), bias: bool = False, dtype=None,
                 param_dtype=jnp.float32, fp8: bool = True):
        self.out_names = _as_tuple(out_names)
        self.names = _as_tuple(in_names) + self.out_names
        self.dtype = dtype
        shape = _as_tuple(in_features) + _as_tuple(out_features)
        self.kernel = nnx.Param(kernel_init(rngs.params(), shape, param_dtype), **named(*self.names), fp8=fp8)
        out_shape = _as_tuple(out_features)
        self.bias = nnx.Param(jnp.zeros(out_shape, param_dtype), **named(*self.out_names)) if bias else None

    def __call__(self, x: jax.Array, x_names: Sequence[str | None]) -> jax.Array:
        """`x` has dims `x_names`; its trailing ones are this layer's input names."""
        dtype = compute_dtype(self.dtype)
        if current_step().fp8 and self.kernel.get_metadata().get("fp8"):
            y = matmul(x.astype(dtype), x_names, held(self.kernel, dtype), self.names, fp8=True)
        elif current_step().head_first and "vocab" in self.names:  # the output head (`Plan.head_backward_first`)
            x, kernel = released_together(x.astype(dtype), held(self.kernel, dtype))
            y = matmul(x, x_names, gathered(self.kernel, kernel), self.names)
        else:
            y = matmul(x.astype(dtype), x_names, param(self.kernel, dtype), self.names)
        if self.bias is None:
            return y
        b = param(self.bias, dtype)
        if in_step():  # the bias as the output has its dims (after any partial sum was reduced)
            b = relayout_local(b, gathered_layout(self.out_names), layout(self.out_names))
            y, b = vma.match(y, b)
        return y + b


def lookup_axes(names, ids_names) -> tuple[str, ...]:
    """The ZeRO axes an embedding table (`names`: vocab, embed) of a step could be looked up over
    without gathering it (`Embed`): those that split its embed dim alone and the ids' batch;
    () where the table is gathered whole (ZeRO-1/2, or another layout)."""
    vocab, embed = layout(names, "param")
    kept_vocab, kept_embed = gathered_layout(names)
    zero = tuple(a for a in embed if a not in kept_embed)
    batch = input_layout(ids_names)[0]
    if not zero or vocab != kept_vocab or not set(zero) <= set(batch):
        return ()
    return zero


class Embed(nnx.Module):
    """Rows of a (vocab, embed)-named table; vocab-parallel where the rules split the vocab.
    `tied`: the table is a head's too (`attend`), which gathers it under ZeRO-3 anyway."""

    def __init__(self, num_embeddings: int, features: int, *, names=("vocab", "embed"), rngs: nnx.Rngs,
                 embedding_init=nnx.initializers.normal(0.02), dtype=None, param_dtype=jnp.float32, tied: bool = False):
        self.names, self.dtype, self.tied = tuple(names), dtype, tied
        self.embedding = nnx.Param(
            embedding_init(rngs.params(), (num_embeddings, features), param_dtype), **named(*self.names)
        )

    def __call__(self, ids: jax.Array, ids_names: Sequence[str | None], out_names: Sequence[str | None]) -> jax.Array:
        """Rows for int `ids`; inside a step `ids` arrive split over the batch axes only.

        Under ZeRO-3 the table is not gathered where its ZeRO axes split its embed dim and the
        batch (FSDP's) and this device has fewer tokens than table rows: the ids are gathered (4
        bytes a token), each device looks up every one of its group's tokens in its own columns,
        and an all-to-all hands each its own tokens' rows whole, (N-1)/N of tokens × embed, not
        (N-1)/N of the table; the all-to-all's transpose brings each device its columns' gradient
        of every token, summed where it lives (no reduce-scatter). Not a tied table: its lookup
        in its own columns aborted in XLA:CPU 0.10.2's rendezvous inside a pipeline's ticks
        (docs/gpu-compile.md), so it is gathered, as the head gathers it."""
        dtype = compute_dtype(self.dtype)
        if not in_step():
            return constrain(jnp.take(param(self.embedding, dtype), ids, axis=0), out_names)
        ids = split_input(ids, ids_names)
        vocab_axes, embed_axes = gathered_layout(self.names)
        columns = () if self.tied else lookup_axes(self.names, ids_names)
        table = held(self.embedding, dtype) if columns else param(self.embedding, dtype)
        if columns and ids.size >= table.shape[0]:  # as many tokens as rows: the table's gather moves less
            columns, table = (), param(self.embedding, dtype)
        if columns:  # the group's tokens, in the order the all-to-all below splits them back
            ids = lax.all_gather(ids, columns, axis=0, tiled=True)
        rows = table.shape[0]  # this device holds rows [first, first + rows)
        local = ids - (lax.axis_index(vocab_axes) * rows if vocab_axes else 0)
        inside = (local >= 0) & (local < rows)
        table, local = vma.match(table, local)
        out = vma.where(inside[..., None], jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0), 0)
        if columns:  # chunks exchanged whole, then put side by side: the rows keep their layout
            n = lax.axis_size(columns)
            out = lax.all_to_all(out.reshape(n, -1, *out.shape[1:]), columns, 0, 0, tiled=True)
            out = jnp.moveaxis(out, 0, -2).reshape(*out.shape[1:-1], -1)
        return relayout_local(out, input_layout(ids_names) + (embed_axes,), layout(out_names), vocab_axes)

    def attend(self, x: jax.Array, x_names: Sequence[str | None]) -> jax.Array:
        """Logits x · tableᵀ, a head tied to this table: (..., embed) -> (..., vocab)."""
        dtype = compute_dtype(self.dtype)
        return matmul(x.astype(dtype), x_names, param(self.embedding, dtype), self.names)


class LayerNorm(nnx.Module):
    """Layer norm over the last dim (named `name`), with scale and bias."""

    def __init__(self, features: int, *, name: str = "embed", epsilon: float = 1e-6, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.epsilon, self.dtype = epsilon, dtype
        self.scale = nnx.Param(jnp.ones((features,), param_dtype), **named(name))
        self.bias = nnx.Param(jnp.zeros((features,), param_dtype), **named(name))

    def __call__(self, x: jax.Array) -> jax.Array:
        epsilon, dtype = self.epsilon, compute_dtype(self.dtype)

        def normalize(x, scale):
            x = x.astype(jnp.float32)
            mean = x.mean(-1, keepdims=True)
            variance = jnp.square(x - mean).mean(-1, keepdims=True)
            return (x - mean) * lax.rsqrt(variance + epsilon) * scale

        # The bias outside: backward does not need it (under ZeRO-3, not gathered again).
        return (recomputed(normalize)(x, param(self.scale)) + param(self.bias)).astype(dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last dim (named `name`), with a scale and no bias (Llama's)."""

    def __init__(self, features: int, *, name: str = "embed", epsilon: float = 1e-6, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.epsilon, self.dtype = epsilon, dtype
        self.scale = nnx.Param(jnp.ones((features,), param_dtype), **named(name))

    def __call__(self, x: jax.Array) -> jax.Array:
        epsilon, dtype = self.epsilon, compute_dtype(self.dtype)

        def normalize(x, scale):
            x = x.astype(jnp.float32)
            return (x * lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + epsilon) * scale).astype(dtype)

        return recomputed(normalize)(x, param(self.scale))
