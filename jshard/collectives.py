"""The torch.distributed collectives, over named mesh axes, for use inside `jax.shard_map`.

In torch.distributed each rank is a process that calls `dist.all_reduce(tensor)` on its
own tensor. In JAX one program runs on every device of a mesh: inside `jax.shard_map`
each device sees its own block of the data, and a collective over a mesh axis combines
the blocks of the devices that differ only in their position along that axis. Those
devices are the *ranks* of the collective, numbered 0..N-1 by their position on the axis.
`axis` is one mesh axis name, or a tuple of names whose devices then form one group,
ranked row-major in the order the tuple gives (as `jax.lax.axis_index` ranks them).

Each rank contributes its own x, as in torch, even where JAX types x as the same on every
rank (invariant): the ops cast it to varying first (`jshard.vma`). Every op returns a new
array (JAX arrays are immutable); where torch writes into an
output buffer, here the buffer is the return value. Arguments are checked while the
function is traced, so a bad `op`, `dim` or `root` fails before any device work.

Rooted ops (broadcast, scatter, gather, reduce) have one root rank. XLA has no rooted
collectives, so each is built from an all-rank one, and what a non-root rank ends up
holding is defined to match torch.distributed, where a rooted op writes only the root's
buffer: after `reduce` a non-root keeps its own input (the playbook's printed output shows
exactly this); after `gather` a non-root, which torch gives nothing, holds zeros, what a
`torch.zeros` buffer holds when nothing is written. `broadcast` and `scatter` give every
rank its share, as in torch.

`run(fn, world_size)` is the lectures' `spawn(fn, world_size)`: it runs a per-rank function
on a mesh of `world_size` devices and hands back every rank's result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jshard import vma
from jshard.mesh import make_mesh

REDUCE_OPS = ("sum", "mean", "max", "min")

# One reduction, two ways: across the ranks of an axis, and along a local array dimension.
_ACROSS_RANKS = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax, "min": lax.pmin}
_ALONG_DIM = {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max, "min": jnp.min}


class CollectiveError(ValueError):
    """A collective called with arguments that cannot work (found while tracing)."""


# --- argument checks, all at trace time ------------------------------------------------


def _axes(axis) -> tuple[str, ...]:
    """`axis` as a tuple of mesh axis names, each of which must be bound by a shard_map."""
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    if not axes or not all(isinstance(a, str) for a in axes):
        raise CollectiveError(f"axis must be a mesh axis name or a tuple of names, got {axis!r}")
    for name in axes:
        try:
            lax.axis_size(name)
        except NameError:
            raise CollectiveError(
                f"mesh axis {name!r} is not bound here: jshard collectives run inside "
                f"jax.shard_map over a mesh that has an axis {name!r} (or use jshard.collectives.run)"
            ) from None
    return axes


def _size(axes: tuple[str, ...]) -> int:
    return lax.axis_size(axes)


def _op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise CollectiveError(f"unknown reduction op {op!r}; choose one of {', '.join(REDUCE_OPS)}")
    return op


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _dim(x, dim: int, what: str) -> int:
    """`dim` as a non-negative index into x's dimensions."""
    ndim = jnp.ndim(x)
    if not _is_int(dim) or not -ndim <= dim < ndim:
        raise CollectiveError(f"{what}={dim!r} is not a dimension of an array of shape {jnp.shape(x)}")
    return int(dim) % ndim


def _split_dim(x, dim: int, axes: tuple[str, ...], what: str) -> int:
    """`dim` checked to split evenly into one chunk per rank."""
    dim = _dim(x, dim, what)
    n, length = _size(axes), jnp.shape(x)[dim]
    if length % n:
        raise CollectiveError(
            f"{what}={dim} of shape {jnp.shape(x)} has length {length}, which does not split into "
            f"{n} equal chunks, one per rank of axis {_name(axes)} (size {n}). "
            f"Fix: make that length a multiple of {n}, or pick another dim."
        )
    return dim


def _root(root: int, axes: tuple[str, ...]) -> int:
    n = _size(axes)
    if not _is_int(root) or not 0 <= root < n:
        raise CollectiveError(f"root={root!r} is not a rank of axis {_name(axes)}, whose ranks are 0..{n - 1}")
    return int(root)


def _name(axes: tuple[str, ...]) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(axes)


def _is_root(axes: tuple[str, ...], root: int):
    return lax.axis_index(axes) == root


# --- all-rank collectives ------------------------------------------------------------------


def all_reduce(x, axis, op: str = "sum"):
    """Every rank gets op(x of rank 0, ..., x of rank N-1), elementwise.

    The result is the same on every rank (JAX types it as invariant over `axis`).
    """
    axes, op = _axes(axis), _op(op)
    return _ACROSS_RANKS[op](vma.vary(x, axes), axes)


def reduce_scatter(x, axis, dim: int = 0, op: str = "sum"):
    """Reduce like `all_reduce`, then rank r keeps only chunk r of the result along `dim`.

    x's length along `dim` must divide by N; the result is N times shorter there.
    sum and mean use XLA's reduce-scatter. XLA has no max/min reduce-scatter, so those
    send chunk j of every rank to rank j with an all-to-all, which moves the same bytes,
    and reduce the N received chunks locally.
    """
    axes, op = _axes(axis), _op(op)
    dim = _split_dim(x, dim, axes, "dim")
    if op in ("sum", "mean"):
        total = lax.psum_scatter(vma.vary(x, axes), axes, scatter_dimension=dim, tiled=True)
        return total / _size(axes) if op == "mean" else total
    n = _size(axes)
    shape = jnp.shape(x)
    chunks = jnp.reshape(x, shape[:dim] + (n, shape[dim] // n) + shape[dim + 1 :])
    received = lax.all_to_all(vma.vary(chunks, axes), axes, dim, dim, tiled=True)  # [..., source rank, chunk, ...]
    return _ALONG_DIM[op](received, axis=dim)


def all_gather(x, axis, dim: int = 0):
    """Every rank gets the ranks' x concatenated along `dim`, in rank order.

    JAX types the result as varying over `axis`, so that its transpose (the gradient) is
    `reduce_scatter` of the cotangent: each rank's gradient contributions are summed.
    """
    axes = _axes(axis)
    dim = _dim(x, dim, "dim")
    return lax.all_gather(vma.vary(x, axes), axes, axis=dim, tiled=True)


def all_to_all(x, axis, split_dim: int, concat_dim: int):
    """Rank r splits x into N chunks along `split_dim` and sends chunk j to rank j; each rank
    concatenates the chunks it receives along `concat_dim`, in the order of the sending rank."""
    axes = _axes(axis)
    split_dim = _split_dim(x, split_dim, axes, "split_dim")
    concat_dim = _dim(x, concat_dim, "concat_dim")
    return lax.all_to_all(vma.vary(x, axes), axes, split_dim, concat_dim, tiled=True)


def send_recv(x, axis, shift: int = 1):
    """Ring exchange: rank r sends x to rank (r + shift) mod N and receives from (r - shift) mod N.

    torch's paired `send`/`recv` between two processes becomes one `ppermute` in which every
    rank sends and receives at once; a pipeline passes activations to the next stage this way.
    """
    axes = _axes(axis)
    if not _is_int(shift):
        raise CollectiveError(f"shift must be an int, got {shift!r}")
    n = _size(axes)
    # ppermute numbers a group of several axes in the mesh's axis order (JAX 0.10 by sorting
    # device ids; JAX >= 0.11 raises on any other order), whereas axis_index, all_gather and
    # all_to_all rank it in the tuple's order. So name the axes in mesh order and translate.
    in_mesh_order = tuple(a for a in jax.sharding.get_abstract_mesh().axis_names if a in axes)
    ring = [(r, (r + int(shift)) % n) for r in range(n)]
    perm = [(_reorder_rank(src, axes, in_mesh_order), _reorder_rank(dst, axes, in_mesh_order)) for src, dst in ring]
    return lax.ppermute(vma.vary(x, axes), in_mesh_order, perm=perm)


def _reorder_rank(rank: int, axes: tuple[str, ...], order: tuple[str, ...]) -> int:
    """The rank a device has over `axes` (row-major in that order), as its rank over `order`,
    the same axes in another order."""
    position = dict(zip(axes, np.unravel_index(rank, [lax.axis_size(a) for a in axes])))
    return int(np.ravel_multi_index([position[a] for a in order], [lax.axis_size(a) for a in order]))


def barrier(axis, x=None):
    """Return `x` (any pytree) once every rank of `axis` has reached this point.

    Inside one compiled program XLA orders work by data alone, so a bare "wait here" does
    not exist: the barrier is an all-reduce of a token that every rank contributes, and
    the returned `x` is selected by the token's value, so whatever uses it waits for all
    the ranks. (`lax.optimization_barrier` would not do: the compiler drops a token that
    only passes through it.) Without `x` it returns the number of ranks that arrived (N);
    a result nobody uses is compiled away, as every unused value is.
    """
    axes = _axes(axis)
    # A token that depends on the rank, so the compiler cannot fold the sum to a constant.
    arrived = lax.psum((lax.axis_index(axes) >= 0).astype(jnp.int32), axes)
    if x is None:
        return arrived
    return jax.tree.map(lambda leaf: vma.where(arrived > 0, leaf, vma.zeros_like(leaf)), x)


# --- rooted collectives ---------------------------------------------------------------------


def broadcast(x, axis, root: int = 0):
    """Every rank gets the root's x.

    Built as an all-reduce of x masked to zero off the root (XLA has no one-to-all
    collective): the result is exact, and costs an all-reduce rather than a broadcast.
    """
    axes = _axes(axis)
    root = _root(root, axes)
    return lax.psum(vma.where(_is_root(axes, root), x, vma.zeros_like(x)), axes)


def scatter(x, axis, root: int = 0, dim: int = 0):
    """Rank r gets chunk r (along `dim`) of the root's x; the other ranks' x are ignored.

    Built as a reduce-scatter of x masked to zero off the root, which moves the same bytes
    per rank as a scatter from the root.
    """
    axes = _axes(axis)
    root = _root(root, axes)
    dim = _split_dim(x, dim, axes, "dim")
    from_root = vma.where(_is_root(axes, root), x, vma.zeros_like(x))
    return lax.psum_scatter(from_root, axes, scatter_dimension=dim, tiled=True)


def gather(x, axis, root: int = 0, dim: int = 0):
    """The root gets the ranks' x concatenated along `dim`, in rank order; the others get zeros.

    Built as an all-gather (every rank receives the data) whose result is then zeroed off
    the root: a non-root gets nothing in torch, and zeros say so unmistakably.
    """
    axes = _axes(axis)
    root = _root(root, axes)
    gathered = all_gather(x, axes, dim)
    return vma.where(_is_root(axes, root), gathered, vma.zeros_like(gathered))


def reduce(x, axis, root: int = 0, op: str = "sum"):
    """The root gets op over the ranks' x; every other rank keeps its own x, as in torch.

    Built as an all-reduce whose result only the root keeps.
    """
    axes = _axes(axis)
    root = _root(root, axes)
    return vma.where(_is_root(axes, root), all_reduce(x, axes, op), x)


# --- the lectures' spawn ----------------------------------------------------------------------


def run(fn, world_size: int, *args, axis: str = "ranks", **kwargs):
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return every rank's result.

    The lectures' `spawn(fn, world_size)` starts one process per rank; here the ranks are
    the first `world_size` devices, on a mesh whose axis `axis` has size `world_size`, and
    `fn` is traced once for all of them inside `jax.jit(jax.shard_map(...))`. So `rank` is
    a traced scalar: branch on it with `jnp.where(rank == 0, ...)`, not `if rank == 0`.
    `args` and `kwargs` reach every rank unchanged, as spawn's do (they are compiled in as
    constants). Collectives inside `fn` name `axis`.

    Returns `fn`'s result with every array leaf stacked over the ranks, as NumPy arrays:
    `result[r]` is rank r's value. The call returns once every rank has finished, which is
    what the lectures' barriers before each print were for.
    """
    devices = jax.devices()
    if not isinstance(world_size, int) or not 1 <= world_size <= len(devices):
        raise CollectiveError(
            f"world_size={world_size!r}: JAX sees {len(devices)} {devices[0].platform} device(s), one per "
            f"rank. On CPU, ask for more with jshard.use_fake_cpu_devices(n) before JAX starts."
        )
    mesh = make_mesh(devices=devices[:world_size], **{axis: world_size})

    def per_rank():
        out = fn(lax.axis_index(axis), world_size, *args, **kwargs)
        return jax.tree.map(lambda leaf: jnp.asarray(leaf)[None], out)  # a leading rank dim

    ranks = jax.shard_map(per_rank, mesh=mesh, in_specs=(), out_specs=jax.P(axis), check_vma=True)
    # `fn` is written as for torch, where every value is its rank's own (`tensor + rank`):
    # JAX's automatic casts to varying stay on for it, whatever `jax_auto_pcast` defaults to.
    with jax.auto_pcast(True):
        return jax.device_get(jax.jit(ranks)())
