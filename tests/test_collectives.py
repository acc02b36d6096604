"""jshard.collectives against the seeds' printed examples, against NumPy, and in gradients;
and `jshard bench collectives` run in-process."""

import json
import math
import runpy
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jshard
import jshard.bench.collective_bandwidth
import jshard.cli
from jshard import collectives as C
from seed import SEED, case_rng

# --- the lecture: collective_operations_main on 4 ranks ------------------------------------


def test_lecture_all_reduce_equals_reduce_scatter_then_all_gather():
    def main(rank, world_size):
        tensor = jnp.array([0.0, 1, 2, 3]) + rank
        reduce_scatter_in = jnp.arange(world_size, dtype=jnp.float32) + rank
        reduce_scatter_out = C.reduce_scatter(reduce_scatter_in, "ranks")
        return tensor, C.all_reduce(tensor, "ranks"), reduce_scatter_out, C.all_gather(reduce_scatter_out, "ranks")

    before, all_reduced, scattered, gathered = C.run(main, world_size=4)
    np.testing.assert_array_equal(before, [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 6]])
    np.testing.assert_array_equal(all_reduced, [[6, 10, 14, 18]] * 4)
    np.testing.assert_array_equal(scattered, [[6], [10], [14], [18]])
    np.testing.assert_array_equal(gathered, all_reduced)


# --- the playbook's examples on 3 ranks --------------------------------------------------------


def playbook(op, **kwargs):
    """Run one playbook example: every rank holds [rank + 1] * 5 (the playbook's tensor)."""
    return C.run(lambda rank, _: op(jnp.full((5,), rank + 1.0), "ranks", **kwargs), world_size=3)


def test_playbook_broadcast():
    # Rank 0 holds [1..5], the others zeros; afterwards every rank holds [1..5].
    def main(rank, _):
        tensor = jnp.where(rank == 0, jnp.array([1.0, 2, 3, 4, 5]), jnp.zeros(5))
        return C.broadcast(tensor, "ranks", root=0)

    np.testing.assert_array_equal(C.run(main, world_size=3), [[1, 2, 3, 4, 5]] * 3)


def test_playbook_reduce_leaves_non_roots_as_they_were():
    np.testing.assert_array_equal(playbook(C.reduce, root=0), [[6] * 5, [2] * 5, [3] * 5])


def test_playbook_all_reduce():
    np.testing.assert_array_equal(playbook(C.all_reduce), [[6] * 5] * 3)


def test_playbook_gather_fills_the_root_and_zeros_elsewhere():
    gathered = playbook(C.gather, root=0).reshape(3, 3, 5)  # rank, source rank, element
    np.testing.assert_array_equal(gathered[0], [[1] * 5, [2] * 5, [3] * 5])
    np.testing.assert_array_equal(gathered[1:], 0)


def test_playbook_all_gather():
    gathered = playbook(C.all_gather).reshape(3, 3, 5)
    np.testing.assert_array_equal(gathered, [[[1] * 5, [2] * 5, [3] * 5]] * 3)


def test_playbook_scatter():
    # Rank 0 scatters [[1]*5, [2]*5, [3]*5]; the other ranks' inputs must not matter.
    def main(rank, world_size):
        rows = jnp.arange(1.0, world_size + 1)[:, None] * jnp.ones(5)
        return C.scatter(jnp.where(rank == 0, rows, -7.0), "ranks", root=0)

    np.testing.assert_array_equal(C.run(main, world_size=3), [[[1] * 5], [[2] * 5], [[3] * 5]])


def test_playbook_reduce_scatter():
    # Rank r's list holds ([(r+1)*i for i in (1, 2)]) ** (j+1) for j = 0, 1, 2; rank j gets the sum of item j.
    def main(rank, world_size):
        base = (rank + 1.0) * jnp.array([1.0, 2.0])
        return C.reduce_scatter(jnp.concatenate([base ** (j + 1) for j in range(world_size)]), "ranks")

    np.testing.assert_array_equal(C.run(main, world_size=3), [[6, 12], [14, 56], [36, 288]])


def test_barrier_counts_every_rank_and_is_compiled_in():
    np.testing.assert_array_equal(C.run(lambda rank, _: C.barrier("ranks"), world_size=3), [3, 3, 3])
    mesh = jshard.make_mesh(data=2, fsdp=2, tensor=2)
    body = jax.shard_map(lambda x: C.barrier("tensor", x), mesh=mesh, in_specs=jax.P("tensor"), out_specs=jax.P("tensor"))
    assert "all-reduce" in jax.jit(body).lower(jnp.zeros(4)).compile().as_text()


# --- every op against NumPy, on random shapes, axis sizes and meshes -----------------------

MESH_3D = dict(data=2, fsdp=2, tensor=2)
# (mesh sizes or None for a 1-D "ranks" mesh of random size, axis)
GROUPINGS = [
    (None, "ranks"),
    (MESH_3D, "tensor"),
    (MESH_3D, ("fsdp", "tensor")),
    (MESH_3D, ("tensor", "data")),  # against mesh order: rank = tensor * 2 + data
]
NP_REDUCE = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}
OPS = ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "scatter", "gather", "reduce",
       "send_recv", "barrier"]
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
# Each op once, and those that reduce once per reduction: the others take none, so rerunning them
# per reduction would only redraw shapes.
OP_REDUCTIONS = [(op, r) for op in OPS for r in (C.REDUCE_OPS if op in REDUCING else (None,))]


def draw(op, n, reduction, rng):
    """A random per-rank shape, the op as jshard calls it, and the same op in NumPy.

    The NumPy side maps the ranks' inputs stacked on axis 0 to their outputs stacked likewise.
    """
    shape = [int(length) for length in rng.integers(1, 4, size=rng.integers(1, 4))]
    dim, other = int(rng.integers(len(shape))), int(rng.integers(len(shape)))
    root, shift = int(rng.integers(n)), int(rng.integers(-n, 2 * n))
    if op in ("reduce_scatter", "scatter", "all_to_all"):
        shape[dim] *= n  # splits into one chunk per rank

    def chunks(x):
        return np.split(x, n, axis=dim)

    cases = {
        "all_reduce": (lambda x, a: C.all_reduce(x, a, reduction),
                       lambda xs: np.broadcast_to(NP_REDUCE[reduction](xs, 0), xs.shape)),
        "reduce_scatter": (lambda x, a: C.reduce_scatter(x, a, dim, reduction),
                           lambda xs: np.stack(chunks(NP_REDUCE[reduction](xs, 0)))),
        "all_gather": (lambda x, a: C.all_gather(x, a, dim),
                       lambda xs: np.stack([np.concatenate(xs, dim)] * n)),
        "all_to_all": (lambda x, a: C.all_to_all(x, a, dim, other),
                       lambda xs: np.stack([np.concatenate([chunks(x)[r] for x in xs], other) for r in range(n)])),
        "broadcast": (lambda x, a: C.broadcast(x, a, root), lambda xs: np.stack([xs[root]] * n)),
        "scatter": (lambda x, a: C.scatter(x, a, root, dim), lambda xs: np.stack(chunks(xs[root]))),
        "gather": (lambda x, a: C.gather(x, a, root, dim),
                   lambda xs: np.stack([np.concatenate(xs, dim) * (r == root) for r in range(n)])),
        "reduce": (lambda x, a: C.reduce(x, a, root, reduction),
                   lambda xs: np.concatenate([xs[:root], NP_REDUCE[reduction](xs, 0)[None], xs[root + 1:]])),
        "send_recv": (lambda x, a: C.send_recv(x, a, shift), lambda xs: np.roll(xs, shift, axis=0)),
        "barrier": (lambda x, a: C.barrier(a), lambda xs: np.full(n, n)),
    }
    return tuple(shape), *cases[op]


def per_group(mesh, axes, xs, reference):
    """Apply `reference` to each group of devices that a collective over `axes` joins.

    xs holds one entry per device, in mesh order; each group's entries are stacked in rank
    order (row-major over `axes`, as jax.lax.axis_index ranks them) for `reference`.
    """
    sizes = mesh.devices.shape
    on_axes = [mesh.axis_names.index(a) for a in axes]
    others = [i for i in range(len(sizes)) if i not in on_axes]
    order = on_axes + others
    grouped = np.moveaxis(xs.reshape(sizes + xs.shape[1:]), order, range(len(sizes)))
    n, groups = math.prod(sizes[i] for i in on_axes), math.prod(sizes[i] for i in others)
    flat = grouped.reshape((n, groups) + xs.shape[1:])
    out = np.stack([reference(flat[:, g]) for g in range(groups)], axis=1)
    out = np.moveaxis(out.reshape(grouped.shape[: len(sizes)] + out.shape[2:]), range(len(sizes)), order)
    return out.reshape((-1,) + out.shape[len(sizes):])


@pytest.mark.parametrize("grouping", GROUPINGS, ids=lambda g: str(g[1]))
@pytest.mark.parametrize("op, reduction", OP_REDUCTIONS,
                         ids=[op if r is None else f"{op}-{r}" for op, r in OP_REDUCTIONS])
def test_matches_numpy(op, reduction, grouping):
    rng = case_rng("test_matches_numpy", op, reduction, grouping)  # a mesh size and shapes of its own per case
    sizes, axis = grouping
    if sizes is None:
        n = int(rng.choice([2, 3, 5, 8]))
        mesh = jshard.make_mesh(ranks=n, devices=jax.devices()[:n])
    else:
        mesh = jshard.make_mesh(**sizes)
    axes = (axis,) if isinstance(axis, str) else axis
    n = math.prod(jshard.mesh_shape(mesh)[a] for a in axes)
    every_device = jax.P(mesh.axis_names)
    shape, ours, reference = draw(op, n, reduction, rng)
    xs = rng.standard_normal((mesh.size, *shape)).astype(np.float32)
    body = jax.shard_map(lambda block: ours(block[0], axis)[None], mesh=mesh,
                         in_specs=every_device, out_specs=every_device, check_vma=True)
    np.testing.assert_allclose(jax.jit(body)(xs), per_group(mesh, axes, xs, reference), rtol=1e-5, atol=1e-6,
                               err_msg=f"{op} ({reduction}) over {axis}, shape {shape}, seed {SEED}")


# Before 0.12, turning jax_auto_pcast off stops JAX's integer casts too, and its own
# lax.axis_index over several axes (an integer product) then fails.
BEFORE_JAX_0_12 = tuple(map(int, jax.__version__.split(".")[:2])) < (0, 12)
WITHOUT_AUTO_PCAST = pytest.param(False, id="no_auto_pcast", marks=pytest.mark.skipif(
    BEFORE_JAX_0_12, reason="JAX < 0.12's own axis_index over several axes needs jax_auto_pcast"))


@pytest.mark.parametrize("auto_pcast", [pytest.param(True, id="auto_pcast"), WITHOUT_AUTO_PCAST])
@pytest.mark.parametrize("op", OPS)
def test_an_input_alike_on_every_rank_is_each_ranks_own(op, auto_pcast):
    """x given whole to every device (in_specs P(): JAX types it invariant) takes part once per
    rank, as in torch, whether or not JAX casts it to varying itself (`jax_auto_pcast`, which
    JAX plans to turn off): jshard's collectives cast explicitly."""
    rng = case_rng("test_an_input_alike_on_every_rank_is_each_ranks_own", op)
    mesh, axes = jshard.make_mesh(**MESH_3D), ("fsdp", "tensor")
    shape, ours, reference = draw(op, 4, str(rng.choice(C.REDUCE_OPS)), rng)
    x = rng.standard_normal(shape).astype(np.float32)
    body = jax.shard_map(lambda x: ours(x, axes)[None], mesh=mesh, in_specs=jax.P(),
                         out_specs=jax.P(mesh.axis_names), check_vma=True)
    with jax.auto_pcast(auto_pcast):
        out = jax.jit(body)(x)
    expected = per_group(mesh, axes, np.stack([x] * mesh.size), reference)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6, err_msg=f"{op}, seed {SEED}")


# --- gradients: all_gather and reduce_scatter are each other's transpose ----------------------


@pytest.mark.parametrize("forward, transpose, chunked", [
    (C.all_gather, C.reduce_scatter, True),
    (C.reduce_scatter, C.all_gather, False),
])
def test_transpose(forward, transpose, chunked):
    mesh = jshard.make_mesh(**MESH_3D)
    axes, dim, n = ("fsdp", "tensor"), 1, 4
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((mesh.size, 3, 2 if chunked else 2 * n)).astype(np.float32)
    cotangent = rng.standard_normal((mesh.size, 3, 2 * n if chunked else 2)).astype(np.float32)

    def body(x, ct):
        _, pullback = jax.vjp(lambda x: forward(x, axes, dim), x[0])
        return pullback(ct[0])[0][None], transpose(ct[0], axes, dim)[None]

    every_device = jax.P(mesh.axis_names)
    pulled_back, transposed = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=every_device,
                                                     out_specs=every_device, check_vma=True))(x, cotangent)
    np.testing.assert_allclose(pulled_back, transposed, rtol=1e-6)


def test_grad_across_shard_map_sums_over_the_group():
    # loss = Σ_devices <w_d, all_gather(x_d)>: the gradient of a rank's shard is the sum over
    # its group of the matching chunk of w, i.e. reduce_scatter of w.
    mesh = jshard.make_mesh(**MESH_3D)
    every_device = jax.P(mesh.axis_names)
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((mesh.size, 3)).astype(np.float32)
    w = rng.standard_normal((mesh.size, 6)).astype(np.float32)

    def loss(x, w):
        gathered = jax.shard_map(lambda x: C.all_gather(x[0], "tensor")[None], mesh=mesh, in_specs=every_device,
                                 out_specs=every_device, check_vma=True)(x)
        return jnp.sum(gathered * w)

    expected = per_group(mesh, ("tensor",), w, lambda ws: np.stack(np.split(ws.sum(0), 2)))
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(x, w), expected, rtol=1e-6)


# --- bad input fails while tracing, with the fix in the message ----------------------------


@pytest.mark.parametrize("call, message", [
    (lambda x: C.all_reduce(x, "ranks", op="prod"), "unknown reduction op 'prod'"),
    (lambda x: C.reduce_scatter(x, "ranks", dim=0), "does not split into 4 equal chunks"),
    (lambda x: C.all_to_all(x, "ranks", split_dim=2, concat_dim=0), "split_dim=2 is not a dimension"),
    (lambda x: C.broadcast(x, "ranks", root=4), "root=4 is not a rank of axis 'ranks', whose ranks are 0..3"),
    (lambda x: C.gather(x, ("ranks", "tensor"), root=-1), "root=-1 is not a rank"),
    (lambda x: C.all_gather(x, "model"), "mesh axis 'model' is not bound here"),
])
def test_bad_arguments(call, message):
    with pytest.raises(C.CollectiveError, match=message):
        C.run(lambda rank, _: call(jnp.zeros((6, 4)) + rank), world_size=4)


def test_outside_shard_map_and_too_many_ranks():
    with pytest.raises(C.CollectiveError, match="inside jax.shard_map"):
        C.all_reduce(jnp.ones(3), "data")
    with pytest.raises(C.CollectiveError, match="JAX sees 8 cpu device"):
        C.run(lambda rank, _: rank, world_size=9)


# --- the benchmark and the example, in-process on the session's 8 fake devices -----------------------------


def test_bench_collectives(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "collectives", "--mesh", "fsdp=4,tensor=2", "--axis", "fsdp", "--ops", "all_reduce,all_gather,broadcast",
            "--sizes", "1K,4K", "--warmup", "1", "--repeats", "2", "--json", str(out)]
    assert jshard.cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "fake CPU devices" in printed and "axis fsdp (N=4)" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [(r["op"], r["bytes"]) for r in rows] == [(op, size) for op in ("all_reduce", "all_gather", "broadcast")
                                                     for size in (1024, 4096)]
    for row in rows:
        assert f"{row['op']:<15}{row['bytes']:>12}" in printed
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)
        factor = {"all_reduce": 2 * 3 / 4, "all_gather": 3 / 4, "broadcast": 1}[row["op"]]
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factor)


@pytest.mark.parametrize("platform, kind, peak", [
    ("gpu", "NVIDIA H100 80GB HBM3", 450),
    ("gpu", "NVIDIA H200", 450),
    ("gpu", "NVIDIA A100-SXM4-80GB", 300),
    ("gpu", "NVIDIA A100-PCIE-40GB", None),
    ("gpu", "NVIDIA H100 NVL", None),
    ("gpu", "Tesla T4", None),
    ("cpu", "cpu", None),
])
def test_link_peak(platform, kind, peak):
    assert jshard.bench.collective_bandwidth._link_peak(SimpleNamespace(platform=platform, device_kind=kind), process_count=1) == peak


def test_bench_rejects_bad_input_before_timing(capsys):
    with pytest.raises(SystemExit, match="tensor"):
        jshard.cli.main(["bench", "collectives", "--mesh", "data=8", "--axis", "tensor"])
    with pytest.raises(SystemExit):
        jshard.cli.main(["bench", "collectives", "--ops", "all_reduce,allreduce"])
    assert "unknown op(s) allreduce" in capsys.readouterr().err


def test_example_prints_the_lecture_output(capsys):
    runpy.run_path(str(Path(__file__).parent.parent / "examples" / "collectives.py"))["main"]()
    printed = capsys.readouterr().out
    assert "Rank 1 [after all-reduce]: [ 6. 10. 14. 18.]" in printed
    assert "Rank 3 [after all-gather]: input = [18.], output = [ 6. 10. 14. 18.]" in printed
