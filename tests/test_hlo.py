"""jshard.hlo on fixed HLO text: every form of replica groups XLA prints, loops, async pairs.

The fixtures are lines as JAX 0.10 (lists, iotas) and JAX >= 0.11 (mesh axes) print them for
the same program, so the reader is tested on both whatever JAX runs the suite.
"""

import pytest

from jshard import hlo

MESH = "mesh['data'=2,'stage'=1,'fsdp'=2,'tensor'=2]"


def module(*lines: str, partitions: int = 8) -> str:
    body = "\n".join(f"  {line}" for line in lines)
    return (
        f"HloModule jit_f, is_scheduled=true, num_partitions={partitions}\n\n"
        f"ENTRY %main.1 (param.1: f32[16,4]) -> f32[16,4] {{\n  %param.1 = f32[16,4]{{1,0}} parameter(0)\n"
        f"{body}\n}}\n"
    )


# (the same collective as JAX 0.10 prints it, as JAX >= 0.11 prints it, kind, group, bytes)
SAME_COLLECTIVE = [
    (
        "%rs = f32[8,4]{1,0} reduce-scatter(%param.1), channel_id=1, replica_groups={{0,2},{1,3},{4,6},{5,7}}, "
        "use_global_device_ids=true, dimensions={0}, to_apply=%add",
        f"%rs = f32[8,4]{{1,0}} reduce-scatter(%param.1), channel_id=1, replica_groups={MESH} {{'fsdp'}}, "
        "use_global_device_ids=true, dimensions={0}, to_apply=%add",
        "reduce-scatter", 2, 16 * 4 * 4,  # K is the input: 8 rows kept × group 2
    ),
    (
        "%ag = f32[32,4]{1,0} all-gather(%rs), channel_id=1, replica_groups={{0,1,4,5},{2,3,6,7}}, "
        "dimensions={0}, use_global_device_ids=true",
        f"%ag = f32[32,4]{{1,0}} all-gather(%rs), channel_id=1, replica_groups={MESH} {{'data','tensor'}}, "
        "dimensions={0}, use_global_device_ids=true",
        "all-gather", 4, 32 * 4 * 4,
    ),
    (
        "%ar = f32[32,4]{1,0} all-reduce(%ag), channel_id=1, replica_groups=[2,4]<=[8], "
        "use_global_device_ids=true, to_apply=%add",
        f"%ar = f32[32,4]{{1,0}} all-reduce(%ag), channel_id=1, replica_groups={MESH} {{'fsdp','tensor'}}, "
        "use_global_device_ids=true, to_apply=%add",
        "all-reduce", 4, 32 * 4 * 4,
    ),
    (
        "%a2a = (f32[16,4]{1,0}, f32[16,4]{1,0}) all-to-all(%x, %y), channel_id=1, "
        "replica_groups=[4,2]<=[2,2,2]T(1,0,2)",
        f"%a2a = (f32[16,4]{{1,0}}, f32[16,4]{{1,0}}) all-to-all(%x, %y), channel_id=1, "
        f"replica_groups={MESH} {{'tensor'}}",
        "all-to-all", 2, 2 * 16 * 4 * 4,
    ),
]


@pytest.mark.parametrize("old, new, kind, group, nbytes", SAME_COLLECTIVE, ids=[c[2] for c in SAME_COLLECTIVE])
def test_both_replica_group_forms_read_alike(old, new, kind, group, nbytes):
    for line in (old, new):
        (found,) = hlo.collectives(module(line))
        assert (found.kind, found.group, found.bytes, found.count) == (kind, group, nbytes, 1)


@pytest.mark.parametrize(
    "groups, size",
    [
        ("{}", 8),  # an empty list: every device of the program
        ("{{0,1,2,3,4,5,6,7}}", 8),
        ("[1,8]<=[8]", 8),
        ("mesh['x'=8] {}", 1),  # no axes: a group of one
        ("mesh['x'=8] {'x':(1)2}", 2),  # a sub-axis: pre-size 1, size 2
        ("mesh['x'=8] {'x':(2)4}", 4),
        ("mesh['a'=2,'b'=4], device_ids=([0,2,4,6,1,3,5,7]) {'a','b':(2)2}", 4),
        ("mesh[a=2,b=4] {b}", 4),  # names unquoted
    ],
)
def test_group_size_of_every_form(groups, size):
    line = f"%ar = f32[64]{{0}} all-reduce(%param.1), channel_id=1, replica_groups={groups}, to_apply=%add"
    (found,) = hlo.collectives(module(line))
    assert found.group == size


def test_reduce_scatter_bytes_follow_the_group_in_the_mesh_form():
    """The ZeRO-3 reduce-scatter the issue found miscounted (8192 for 65536) under JAX 0.12."""
    line = (
        "%rs = f32[2048]{0} reduce-scatter(%g), channel_id=3, "
        "replica_groups=mesh['data'=1,'stage'=1,'fsdp'=8,'tensor'=1] {'fsdp'}, dimensions={0}, to_apply=%add"
    )
    assert hlo.bytes_by_kind(module(line)) == {"reduce-scatter": 65536}


@pytest.mark.parametrize("groups", ["{{0},{1},{2},{3}}", "mesh['data'=1,'tensor'=4] {'data'}"])
def test_a_group_of_one_device_moves_nothing(groups):
    """XLA:CPU keeps a psum over an axis of size 1 (the gradient's over data=1): no bytes move."""
    line = f"%ar = f32[64]{{0}} all-reduce(%g), channel_id=1, replica_groups={groups}, to_apply=%add"
    (found,) = hlo.collectives(module(line))
    assert (found.group, found.bytes) == (1, 0) and hlo.bytes_by_kind(module(line)) == {}


def test_loop_trips_and_async_pairs():
    text = (
        "HloModule m, num_partitions=4\n\n"
        "%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {\n"
        "  %ags = (f32[16]{0}, f32[64]{0}) all-gather-start(%x), channel_id=2, "
        "replica_groups=mesh['fsdp'=4] {'fsdp'}, dimensions={0}\n"
        "  %agd = f32[64]{0} all-gather-done(%ags)\n"
        "}\n\n"
        "ENTRY %main (a: f32[64]) -> f32[64] {\n"
        '  %w = (s32[], f32[64]) while(%t), condition=%cond, body=%body, '
        'backend_config={"known_trip_count":{"n":"6"}}\n'
        "  %cp = f32[64]{0} collective-permute(%a), channel_id=1, source_target_pairs={{0,1},{1,0}}\n"
        "}\n"
    )
    found = {c.kind: c for c in hlo.collectives(text)}
    assert (found["all-gather"].count, found["all-gather"].bytes, found["all-gather"].group) == (6, 256, 4)
    assert hlo.bytes_by_kind(text) == {"all-gather": 6 * 256, "collective-permute": 256}


def test_a_loop_xla_peeled_runs_its_body_as_often_as_its_condition_says():
    """XLA:GPU peels a gradient accumulation's first micro-batch off its loop and leaves the
    loop no known_trip_count: its trips are read from `i < 3` in its (fused) condition and i's
    start, 0 through copies, in the init tuple; with the peeled copy, 4 gathers."""
    gather = ("  %ag = f32[64]{0} all-gather(%x), channel_id=2, replica_groups=mesh['fsdp'=4] {'fsdp'}, "
              "dimensions={0}\n")
    text = (
        "HloModule m, num_partitions=4\n\n"
        "%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {\n" + gather + "}\n\n"
        "%fused_compare (param_0: s32[]) -> pred[] {\n"
        "  %param_0 = s32[] parameter(0)\n"
        "  %constant_3 = s32[] constant(3)\n"
        "  ROOT %compare = pred[] compare(%param_0, %constant_3), direction=LT\n"
        "}\n\n"
        "%cond (c: (s32[], f32[64])) -> pred[] {\n"
        "  %i = s32[] get-tuple-element(%c), index=0\n"
        "  ROOT %below = pred[] fusion(%i), kind=kLoop, calls=%fused_compare\n"
        "}\n\n"
        "ENTRY %main (a: f32[64]) -> f32[64] {\n" + gather +
        "  %zero = s32[] constant(0)\n"
        "  %copy.1 = s32[] copy(%zero)\n"
        "  %copy.2 = s32[] copy(%copy.1)\n"
        "  %t = (s32[], f32[64]) tuple(%copy.2, %a)\n"
        '  %w = (s32[], f32[64]) while(%t), condition=%cond, body=%body, '
        'backend_config={"known_induction_variable":{"tuple_index":"0"},"dynamic_variables":[]}\n'
        "}\n"
    )
    assert hlo.bytes_by_kind(text) == {"all-gather": 4 * 256}


# -- XLA:GPU's forms: asynchronous starts, mesh axes, what the schedule puts beside them -------

AXES = {"data": 2, "stage": 1, "fsdp": 2, "tensor": 2}


@pytest.mark.parametrize("old, new, axes", [(old, new, axes) for (old, new, *_), axes in zip(
    SAME_COLLECTIVE, [("fsdp",), ("data", "tensor"), ("fsdp", "tensor"), ("tensor",)])], ids=[c[2] for c in SAME_COLLECTIVE])
def test_group_axes_of_every_form(old, new, axes):
    """Device i of the program is the i-th of the mesh: list and iota groups read as the axes they span."""
    assert hlo.group_axes(old, AXES) == hlo.group_axes(new, AXES) == axes


def test_permute_axes_are_the_axes_its_pairs_move_along():
    ring = "%cp = f32[4]{0} collective-permute(%a), channel_id=1, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}"
    stages = "%cp = f32[4]{0} collective-permute(%a), channel_id=1, source_target_pairs={{0,4},{4,0}}"
    assert hlo.group_axes(ring, AXES) == ("tensor",) and hlo.group_axes(stages, AXES) == ("data",)
    assert hlo.group_axes("%ar = f32[4]{0} all-reduce(%a), replica_groups={{0,3},{1,2}}", AXES | {"data": 1}) is None


# Async starts as XLA:GPU prints them (2025 on): (operands, results), combined ones with a tuple each.
GPU_STARTS = [
    ("%ags = ((bf16[96,64]{1,0}, bf16[96]{0}), (bf16[768,64]{1,0}, bf16[768]{0})) all-gather-start(%a, %b)",
     "all-gather", 8, 2 * (768 * 64 + 768)),
    ("%ars = ((f32[100]{0}), f32[100]{0}) all-reduce-start(%a)", "all-reduce", 8, 4 * 100),
    ("%ars = (bf16[10]{0}, bf16[30]{0}) all-reduce-start(%a, %b)", "all-reduce", 8, 2 * 40),  # results alone
    ("%rss = ((bf16[768,64]{1,0}), bf16[96,64]{1,0}) reduce-scatter-start(%a)", "reduce-scatter", 8, 2 * 768 * 64),
    ("%cps = (bf16[64]{0}, bf16[64]{0}, u32[], u32[]) collective-permute-start(%a), "
     "source_target_pairs={{0,1},{1,0}}", "collective-permute", 1, 2 * 64),
    # combined (the ring's K, V and a gradient sent at once): every operand is sent
    ("%cps = ((f32[8,32]{1,0}, f32[8,32]{1,0}, f32[8,32]{0,1}), (f32[8,32]{1,0}, f32[8,32]{1,0}, f32[8,32]{0,1})) "
     "collective-permute-start(%a, %b, %c), source_target_pairs={{0,1},{1,0}}", "collective-permute", 1, 3 * 4 * 256),
    ("%cps = ((f32[8,32]{1,0}), f32[8,32]{1,0}) collective-permute-start(%a), source_target_pairs={{0,1},{1,0}}",
     "collective-permute", 1, 4 * 256),
]


@pytest.mark.parametrize("line, kind, group, nbytes", GPU_STARTS, ids=[s[1] + str(i) for i, s in enumerate(GPU_STARTS)])
def test_async_starts_count_k_once(line, kind, group, nbytes):
    if kind != "collective-permute":
        line += ", channel_id=1, replica_groups=[1,8]<=[8], to_apply=%add"
    (found,) = hlo.collectives(module(line))
    assert (found.kind, found.bytes, found.asynchronous, found.name) == (kind, nbytes, True, line.split()[0][1:])
    assert set(found.dtypes) == {"f32" if "f32" in line else "bf16"}


def scheduled(*between: str) -> str:
    """A loop body whose all-gather starts, runs `between`, then is done, as a scheduled module."""
    return (
        "HloModule m, is_scheduled=true, num_partitions=8\n\n"
        "%gemm (p0: bf16[8,8], p1: bf16[8,8]) -> bf16[8,8] {\n"
        "  %d = bf16[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n}\n\n"
        "ENTRY %main (a: bf16[1,8]) -> bf16[8,8] {\n"
        "  %ags = ((bf16[1,8]{1,0}), bf16[8,8]{1,0}) all-gather-start(%a), channel_id=1, "
        "replica_groups=mesh['fsdp'=8] {'fsdp'}, dimensions={0}\n"
        + "".join(f"  {line}\n" for line in between)
        + "  %agd = bf16[8,8]{1,0} all-gather-done(%ags)\n}\n"
    )


@pytest.mark.parametrize("between, hidden", [
    (["%f = bf16[8,8]{1,0} fusion(%x, %y), kind=kCustom, calls=%gemm"], True),  # a Triton GEMM fusion
    (['%c = bf16[8,8]{1,0} custom-call(%x, %y), custom_call_target="__cublas$gemm"'], True),
    (["%e = bf16[8,8]{1,0} add(%x, %y)"], False),  # elementwise work only
    ([], False),
])
def test_overlapped_means_a_matmul_between_start_and_done(between, hidden):
    assert hlo.overlapped(scheduled(*between)) == {"ags": hidden}


def test_a_combined_gather_of_bf16_and_fp8_weights_counts_each_in_its_dtype():
    """ZeRO-3 under `fp8`: XLA:GPU combines a layer's e4m3 projections and bf16 norm scales."""
    line = ("%ags = ((bf16[256]{0}, f8e4m3fn[256,64]{1,0}), (bf16[2048]{0}, f8e4m3fn[2048,64]{1,0})) "
            "all-gather-start(%a, %b), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}")
    (found,) = hlo.collectives(module(line))
    assert found.dtypes == ("bf16", "f8e4m3fn") and found.buffers == (2048 * 2, 2048 * 64)


def test_xla_cpus_widened_buffers_take_the_programs_dtype_they_were_widened_from():
    """XLA:CPU widens bf16 collectives to f32 and FP8 ones to f16: where the program has buffers
    of one size in both, the compiled dtype says which a buffer was."""
    program = "\n".join(
        f'%{n} = "stablehlo.all_gather"(%x) : (tensor<64x{t}>) -> tensor<512x{t}>' for n, t in (("0", "bf16"), ("1", "f8E4M3FN")))
    compiled = module("%ag.1 = f32[512]{0} all-gather(%a), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}",
                      "%ag.2 = f16[512]{0} all-gather(%b), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}")
    assert [c.bytes for c in hlo.collectives(compiled, program)] == [512 * 2, 512]


# An all-reduce's groups over `tensor` and over `data` of MESH, as each JAX prints them:
# (the program's, the compiled program's) for JAX <= 0.10, then for JAX >= 0.11.
TENSOR_AND_DATA_GROUPS = [
    (("dense<[[0, 1], [2, 3], [4, 5], [6, 7]]> : tensor<4x2xi64>", "{{0,1},{2,3},{4,5},{6,7}}"),
     ("dense<[[0, 4], [1, 5], [2, 6], [3, 7]]> : tensor<4x2xi64>", "{{0,4},{1,5},{2,6},{3,7}}")),
    (('#stablehlo.replica_group_mesh_axes<mesh = @mesh_0, axes = [#stablehlo.axis_ref<name = "tensor">]>',
      f"{MESH} {{'tensor'}}"),
     ('#stablehlo.replica_group_mesh_axes<mesh = @mesh_0, axes = [#stablehlo.axis_ref<name = "data">]>',
      f"{MESH} {{'data'}}")),
]


@pytest.mark.parametrize("over_tensor, over_data", TENSOR_AND_DATA_GROUPS, ids=["ids", "mesh-axes"])
def test_buffers_of_one_size_over_other_groups_take_their_own_groups_dtype(over_tensor, over_data):
    """A bf16 activation's all-reduce over `tensor` and an fp32 gradient's over `data`, of one
    size: XLA:CPU widens the first to f32, and the program's replica groups (device ids, or the
    mesh axes they name) say which is which."""
    program = "\n".join(
        f'%{n} = "stablehlo.all_reduce"(%x) <{{replica_groups = {groups[0]}}}> ({{\n'
        f'}}) : (tensor<512x{t}>) -> tensor<512x{t}>'
        for n, t, groups in (("0", "bf16", over_tensor), ("1", "f32", over_data)))
    compiled = module(f"%ar.1 = f32[512]{{0}} all-reduce(%a), channel_id=1, replica_groups={over_tensor[1]}, to_apply=%add",
                      f"%ar.2 = f32[512]{{0}} all-reduce(%b), channel_id=2, replica_groups={over_data[1]}, to_apply=%add")
    assert [c.bytes for c in hlo.collectives(compiled, program)] == [512 * 2, 512 * 4]
