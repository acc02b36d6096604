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
