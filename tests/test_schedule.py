"""`planner.schedule`: a scheduled GPU program timed along its own order, on small HLO modules
written here, at a device of round numbers (1 TFLOP/s, 1 TB/s of HBM, 10 GB/s links) so that
every expected time is arithmetic on the page. The 8B program's reading is test_gpu_compile_8b's.
"""

import numpy as np
import pytest

from jshard import hlo
from jshard.parallel.tick_branches import TickBranches
from jshard.parallel.schedules import make_schedule
from jshard.planner import physics, schedule
from jshard.planner.hardware import Hardware

pytestmark = pytest.mark.fast

DEVICE = Hardware("round", peak_flops=1e12, hbm_bytes=80e9, hbm_bw=1e12, intra_bw=1e10, inter_bw=1e9,
                  gpus_per_node=8, matmul_efficiency=1.0, stream_share=1.0)
MESH = {"data": 8}
GROUP = "replica_groups={{0,1,2,3,4,5,6,7}}"
GEMM_MS = 2.0  # 1000 × 1000 @ 1000 × 1000: 2 GFLOP at 1 TFLOP/s (its 6 MB at 1 TB/s: 6 µs)
# An all-gather of 1000 × 1000 bf16 shards over 8 devices: 7 steps of the link's latency and 7/8
# of the 16 MB gathered at 10 GB/s.
GATHER_MS = (7 * physics.LINK_LATENCY["intra"] + 7 / 8 * 16e6 / 1e10) * 1e3


def gemm(name: str, lhs: str = "%p0", rhs: str = "%p1") -> str:
    dims = '"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],' \
           '"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}'
    return (f'  %{name} = (bf16[1000,1000]{{1,0}}, s8[0]{{0}}) custom-call({lhs}, {rhs}), '
            f'custom_call_target="__cublas$lt$matmul", backend_config={{"gemm_backend_config":{{{dims}}}}}')


def gather(name: str, shard: str = "%p0") -> list[str]:
    return [f"  %{name} = (bf16[1000,1000]{{1,0}}, bf16[8000,1000]{{1,0}}) all-gather-start({shard}), {GROUP}, "
            "dimensions={0}"]


def done(name: str, start: str) -> str:
    return f"  %{name} = bf16[8000,1000]{{1,0}} all-gather-done(%{start})"


# A fusion that reads a 1000 × 1000 f32 (4 MB) and writes it as bf16 (2 MB): 6 µs.
SCALE = ["%scaled (x: f32[1000,1000]) -> bf16[1000,1000] {",
         "  %x = f32[1000,1000]{1,0} parameter(0)",
         "  ROOT %c = bf16[1000,1000]{1,0} convert(%x)",
         "}"]
SCALE_MS = 6e6 / 1e12 * 1e3


def module(entry: list[str], *computations: list[str]) -> str:
    params = ["  %p0 = bf16[1000,1000]{1,0} parameter(0)", "  %p1 = bf16[1000,1000]{1,0} parameter(1)",
              "  %f = f32[1000,1000]{1,0} parameter(2)"]
    lines = ["HloModule step, num_partitions=8", ""]
    for c in computations:
        lines += c + [""]
    lines += ["ENTRY %main (p0: bf16[1000,1000], p1: bf16[1000,1000], f: f32[1000,1000]) -> bf16[1000,1000] {"]
    lines += params + entry + ["}"]
    return "\n".join(lines)


def timed(text: str) -> schedule.Timeline:
    return schedule.timeline(text, MESH, DEVICE)


def test_a_gather_beside_a_longer_matmul_is_hidden():
    t = timed(module(gather("ag") + [gemm("mm"), done("agd", "ag"), "  ROOT %r = bf16[1000,1000]{1,0} copy(%p0)"]))
    assert GATHER_MS < GEMM_MS
    assert t.collectives["ag"].seconds * 1e3 == pytest.approx(GATHER_MS)
    assert t.hidden() == {("all-gather", "data"): 1.0}
    # the step: the matmul, then the copy (2 MB read and written at 1 TB/s)
    assert t.seconds * 1e3 == pytest.approx(GEMM_MS + 4e6 / 1e12 * 1e3)
    assert t.compute == pytest.approx(t.seconds)


def test_a_gather_beside_a_short_fusion_waits_for_the_rest():
    t = timed(module(gather("ag") + ["  %s = bf16[1000,1000]{1,0} fusion(%f), kind=kLoop, calls=%scaled",
                                     done("agd", "ag"), "  ROOT %r = bf16[1000,1000]{1,0} bitcast(%s)"], SCALE))
    row = t.collectives["ag"]
    assert row.exposed * 1e3 == pytest.approx(GATHER_MS - SCALE_MS)
    assert t.seconds * 1e3 == pytest.approx(GATHER_MS)
    assert t.hidden()[("all-gather", "data")] == pytest.approx(SCALE_MS / GATHER_MS)


def test_a_loop_runs_its_body_each_trip_and_a_transfer_across_it_hides_behind_them():
    body = ["%body (t: (s32[], bf16[1000,1000])) -> (s32[], bf16[1000,1000]) {",
            "  %t = (s32[], bf16[1000,1000]{1,0}) parameter(0)",
            "  %b0 = bf16[1000,1000]{1,0} get-tuple-element(%t), index=1",
            *gather("inner", "%b0"), gemm("inner_mm", "%b0", "%b0"), done("inner_done", "inner"),
            "  %i = s32[] get-tuple-element(%t), index=0",
            "  ROOT %out = (s32[], bf16[1000,1000]{1,0}) tuple(%i, %inner_mm)",
            "}"]
    cond = ["%cond (c: (s32[], bf16[1000,1000])) -> pred[] {",
            "  %c = (s32[], bf16[1000,1000]{1,0}) parameter(0)",
            "  ROOT %k = pred[] constant(true)",
            "}"]
    entry = gather("outer") + [
        "  %zero = s32[] constant(0)",
        "  %init = (s32[], bf16[1000,1000]{1,0}) tuple(%zero, %p0)",
        '  %loop = (s32[], bf16[1000,1000]{1,0}) while(%init), condition=%cond, body=%body, '
        'backend_config={"known_trip_count":{"n":"3"}}',
        done("outer_done", "outer"), "  ROOT %r = bf16[1000,1000]{1,0} bitcast(%p0)"]
    t = timed(module(entry, body, cond))
    assert t.collectives["inner"].executions == 3 and t.collectives["outer"].executions == 1
    # the outer gather and the first trip's share the link: the first inner one begins when the
    # outer one ends, and its done waits for that; every later trip's is hidden
    assert t.collectives["outer"].exposed == 0.0
    assert t.collectives["inner"].exposed * 1e3 == pytest.approx(2 * GATHER_MS - GEMM_MS)
    assert t.seconds * 1e3 == pytest.approx(3 * GEMM_MS + 2 * GATHER_MS - GEMM_MS)


def test_transfers_run_one_after_another_and_a_synchronous_one_is_waited_for_whole():
    entry = gather("a") + gather("b") + [
        done("bd", "b"), done("ad", "a"),
        f"  %sum = bf16[1000,1000]{{1,0}} all-reduce(%p1), {GROUP}, to_apply=%add",
        "  ROOT %r = bf16[1000,1000]{1,0} bitcast(%sum)"]
    add = ["%add (x: bf16[], y: bf16[]) -> bf16[] {", "  %x = bf16[] parameter(0)", "  %y = bf16[] parameter(1)",
           "  ROOT %z = bf16[] add(%x, %y)", "}"]
    t = timed(module(entry, add))
    # b's done waits for a's transfer and its own: each is charged the part of the wait it ran,
    # so a's done, later, waits no more
    assert t.collectives["b"].exposed * 1e3 == pytest.approx(GATHER_MS)
    assert t.collectives["a"].exposed * 1e3 == pytest.approx(GATHER_MS)
    reduce_ms = (14 * physics.LINK_LATENCY["intra"] + 2 * 7 / 8 * 2e6 / 1e10) * 1e3  # ring: 2(n-1) steps
    assert t.collectives["sum"].exposed * 1e3 == pytest.approx(reduce_ms)
    assert t.seconds * 1e3 == pytest.approx(2 * GATHER_MS + reduce_ms)
    assert t.compute == 0.0


@pytest.mark.parametrize("fused, read, written", [
    # a stacked buffer only sliced: its slice is read, not the stack
    (["  %stack = f32[8,1000,1000]{2,1,0} parameter(0)", "  %i = s32[] parameter(1)", "  %z = s32[] constant(0)",
      "  %one = f32[1,1000,1000]{2,1,0} dynamic-slice(%stack, %i, %z, %z), dynamic_slice_sizes={1,1000,1000}",
      "  ROOT %b = bf16[1,1000,1000]{2,1,0} convert(%one)"], 4e6, 2e6),
    # a stacked buffer updated in place (through a bitcast): only the update is written
    (["  %stack = f32[8,1000,1000]{2,1,0} parameter(0)", "  %i = s32[] parameter(1)", "  %z = s32[] constant(0)",
      "  %u = f32[1,1000,1000]{2,1,0} parameter(2)",
      "  %same = f32[8,1000,1000]{2,1,0} bitcast(%stack)",
      "  ROOT %d = f32[8,1000,1000]{2,1,0} dynamic-update-slice(%same, %u, %i, %z, %z)"], 4e6, 4e6),
    # a slot read back and written in place (a pipeline's residual buffer): the slot and the update
    (["  %stack = f32[8,1000,1000]{2,1,0} parameter(0)", "  %i = s32[] parameter(1)", "  %z = s32[] constant(0)",
      "  %u = f32[1,1000,1000]{2,1,0} parameter(2)",
      "  %old = f32[1,1000,1000]{2,1,0} dynamic-slice(%stack, %i, %z, %z), dynamic_slice_sizes={1,1000,1000}",
      "  %new = f32[1,1000,1000]{2,1,0} add(%old, %u)",
      "  ROOT %d = f32[8,1000,1000]{2,1,0} dynamic-update-slice(%stack, %new, %i, %z, %z)"], 8e6, 4e6),
])
def test_a_fusion_moves_what_it_reads_and_writes(fused, read, written):
    result = fused[-1].split("=")[1].split()[0]
    operands = ["%stack", "%i", "%u"][:sum("parameter(" in line for line in fused)]
    kernel = [f"%kernel (stack: f32[8,1000,1000], i: s32[], u: f32[1,1000,1000]) -> {result} {{", *fused, "}"]
    entry = ["  %stack = f32[8,1000,1000]{2,1,0} parameter(3)", "  %i = s32[] parameter(4)",
             "  %u = f32[1,1000,1000]{2,1,0} parameter(5)",
             f"  %k = {result} fusion({', '.join(operands)}), kind=kLoop, calls=%kernel",
             "  ROOT %r = bf16[1000,1000]{1,0} bitcast(%p0)"]
    t = timed(module(entry, kernel))
    index = 4  # the s32 index: 4 bytes read
    assert t.seconds == pytest.approx((read + written + index) / 1e12)


def test_a_gemm_fused_with_the_slice_it_reads_is_timed_as_the_gemm():
    """XLA:GPU's dynamic_slice_fusion: a cuBLAS call on a layer's slice of a stacked buffer, read
    in place (the backward loop's GEMM on a saved residual). Timed by the bytes it moves it would
    take 6 µs where its 2 GFLOP take 2 ms (as `planner.schedule` read the 8B's before 2026-11-29)."""
    kernel = ["%sliced_gemm (stack: bf16[8,1000,1000], i: s32[], w: bf16[1000,1000]) -> (bf16[1000,1000], s8[0]) {",
              "  %stack = bf16[8,1000,1000]{2,1,0} parameter(0)", "  %i = s32[] parameter(1)",
              "  %w = bf16[1000,1000]{1,0} parameter(2)", "  %z = s32[] constant(0)",
              "  %one = bf16[1,1000,1000]{2,1,0} dynamic-slice(%stack, %i, %z, %z), dynamic_slice_sizes={1,1000,1000}",
              "  %x = bf16[1000,1000]{1,0} bitcast(%one)",
              gemm("mm", "%x", "%w").replace("  %mm", "  ROOT %mm"), "}"]
    entry = ["  %stack = bf16[8,1000,1000]{2,1,0} parameter(3)", "  %i = s32[] parameter(4)",
             "  %k = (bf16[1000,1000]{1,0}, s8[0]{0}) fusion(%stack, %i, %p1), kind=kCustom, calls=%sliced_gemm",
             "  ROOT %r = bf16[1000,1000]{1,0} bitcast(%p0)"]
    assert timed(module(entry, kernel)).seconds * 1e3 == pytest.approx(GEMM_MS)


def test_a_permute_moves_its_buffer_once_along_its_axis():
    """A pipeline's send: one step of the link's latency and its 2 MB at 10 GB/s (a permute's
    group is the axis it moves along, not the one device its pairs name)."""
    pairs = "source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}"
    t = timed(module([f"  %sent = bf16[1000,1000]{{1,0}} collective-permute(%p0), {pairs}",
                      "  ROOT %r = bf16[1000,1000]{1,0} bitcast(%sent)"]))
    permute_ms = (physics.LINK_LATENCY["intra"] + 2e6 / 1e10) * 1e3
    assert t.collectives["sent"].seconds * 1e3 == pytest.approx(permute_ms)
    assert t.seconds * 1e3 == pytest.approx(permute_ms) and t.hidden() == {("collective-permute", "data"): 0.0}


def test_a_conditional_runs_its_longest_branch_and_a_wrapped_collective_runs_as_a_start():
    """A pipeline tick's branches: the step takes the longest (the matmul's), and counts the
    collectives of that branch only; a collective wrapped in XLA's `async-start` is timed as one."""
    short = ["%short (s: bf16[1000,1000]) -> bf16[1000,1000] {", "  %s = bf16[1000,1000]{1,0} parameter(0)",
             *gather("short_ag", "%s"), done("short_done", "short_ag"),
             "  ROOT %sr = bf16[1000,1000]{1,0} bitcast(%s)", "}"]
    long = ["%long (l: bf16[1000,1000]) -> bf16[1000,1000] {", "  %l = bf16[1000,1000]{1,0} parameter(0)",
            gemm("long_mm", "%l", "%l"), "  ROOT %lr = bf16[1000,1000]{1,0} get-tuple-element(%long_mm), index=0", "}"]
    wrapped = ["%wrapped (w: bf16[1000,1000]) -> bf16[8000,1000] {", "  %w = bf16[1000,1000]{1,0} parameter(0)",
               f"  ROOT %wag = bf16[8000,1000]{{1,0}} all-gather(%w), {GROUP}, dimensions={{0}}", "}"]
    entry = ["  %which = s32[] constant(1)",
             "  %branch = bf16[1000,1000]{1,0} conditional(%which, %p0, %p0), branch_computations={%short, %long}",
             "  %start = ((bf16[1000,1000]{1,0}), bf16[8000,1000]{1,0}) async-start(%p1), calls=%wrapped",
             "  %end = bf16[8000,1000]{1,0} async-done(%start)",
             "  ROOT %r = bf16[1000,1000]{1,0} bitcast(%branch)"]
    t = timed(module(entry, short, long, wrapped))
    assert "short_ag" not in t.collectives  # the shorter branch left no trace
    assert t.collectives["start"].exposed * 1e3 == pytest.approx(GATHER_MS)
    assert t.seconds * 1e3 == pytest.approx(GEMM_MS + GATHER_MS)


@pytest.mark.parametrize("kernel", ["forward", "dq", "dkv"])
def test_flash_kernels_are_timed_by_their_flops(kernel):
    """jshard's flash kernels (Triton calls): 4·b·h·s·s'·d FLOPs each, queries first, then keys,
    at the attention rate (`physics.ATTENTION_EFFICIENCY`)."""
    entry = ["  %q = bf16[1,128,4,32]{3,2,1,0} parameter(3)", "  %k = bf16[1,256,4,32]{3,2,1,0} parameter(4)",
             f'  %flash = f32[1,128,4,32]{{3,2,1,0}} custom-call(%q, %k, %k), custom_call_target="__gpu$xla.gpu.triton", '
             f'metadata={{op_name="jit(step)/jshard_flash_{kernel}/pallas_call"}}',
             "  ROOT %r = bf16[1000,1000]{1,0} bitcast(%p0)"]
    flops = 4 * 1 * 4 * 128 * 256 * 32
    assert timed(module(entry)).seconds == pytest.approx(flops / (1e12 * physics.ATTENTION_EFFICIENCY))


def test_a_pipeline_tick_takes_its_slowest_stage_and_sends_only_when_its_row_says():
    """The scan over a 1F1B pipeline's ticks, as the executor traces it: per tick a cond per
    kind of action (a forward: one matmul; a backward: two) and a cond around the send. Timed
    with the tick table (`TickBranches`), each tick runs each stage's own branches and lasts as
    long as its slowest stage; the send goes on the ticks that send. Without it, every tick would
    run a forward, a backward and a send."""
    s = make_schedule("1f1b", 2, 3)
    ticks = TickBranches.of(s)
    branch = lambda name, body: [f"%{name} (x: bf16[1000,1000]) -> bf16[1000,1000] {{",  # noqa: E731
                                 "  %x = bf16[1000,1000]{1,0} parameter(0)", *body, "}"]
    idle = branch("idle", ["  ROOT %same = bf16[1000,1000]{1,0} bitcast(%x)"])
    forward = branch("forward", [gemm("f_mm", "%x", "%x"), "  ROOT %f = bf16[1000,1000]{1,0} get-tuple-element(%f_mm), index=0"])
    backward = branch("backward", [gemm("b_mm", "%x", "%x"), gemm("w_mm", "%x", "%x"),
                                   "  ROOT %b = bf16[1000,1000]{1,0} get-tuple-element(%w_mm), index=0"])
    pairs = "source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}"
    send = branch("send", [f"  ROOT %sent = bf16[1000,1000]{{1,0}} collective-permute(%x), {pairs}"])

    def cond(name, scope, when):
        return (f"  %{name} = bf16[1000,1000]{{1,0}} conditional(%{name}_p, %b0, %b0), true_computation=%{when}, "
                f'false_computation=%idle, metadata={{op_name="jit(step)/while/body/{scope}/cond"}}')

    body = ["%body (t: (s32[], bf16[1000,1000])) -> (s32[], bf16[1000,1000]) {",
            "  %t = (s32[], bf16[1000,1000]{1,0}) parameter(0)",
            "  %b0 = bf16[1000,1000]{1,0} get-tuple-element(%t), index=1",
            *[f"  %{n}_p = pred[] constant(true)" for n in ("fw", "bw", "tx")],
            cond("fw", "pipeline_F", "forward"), cond("bw", "pipeline_BW", "backward"),
            cond("tx", "sends_forward", "send"),
            "  %i = s32[] get-tuple-element(%t), index=0",
            "  ROOT %out = (s32[], bf16[1000,1000]{1,0}) tuple(%i, %tx)", "}"]
    loop_cond = ["%cond (c: (s32[], bf16[1000,1000])) -> pred[] {", "  %c = (s32[], bf16[1000,1000]{1,0}) parameter(0)",
                 "  ROOT %k = pred[] constant(true)", "}"]
    entry = ["  %zero = s32[] constant(0)", "  %init = (s32[], bf16[1000,1000]{1,0}) tuple(%zero, %p0)",
             f'  %loop = (s32[], bf16[1000,1000]{{1,0}}) while(%init), condition=%cond, body=%body, '
             f'backend_config={{"known_trip_count":{{"n":"{s.ticks}"}}}}',
             "  ROOT %r = bf16[1000,1000]{1,0} bitcast(%p0)"]
    text = module(entry, idle, forward, backward, send, body, loop_cond)

    t = schedule.timeline(text, MESH, DEVICE, ticks)
    permute_ms = (physics.LINK_LATENCY["intra"] + 2e6 / 1e10) * 1e3
    cost = {"F": GEMM_MS, "BW": 2 * GEMM_MS, None: 0.0}
    slowest = sum(max(cost[a.kind if a else None] for a in row) for row in s.table())
    sends = int(ticks.program.sends_forward.sum())
    assert 0 < sends < s.ticks and t.collectives["sent"].executions == sends
    trips = s.ticks * physics.loop_seconds(1, DEVICE) * 1e3
    assert t.seconds * 1e3 == pytest.approx(slowest + sends * permute_ms + trips)
    # every branch on every tick, without the table; the bytes likewise
    assert schedule.timeline(text, MESH, DEVICE).seconds * 1e3 == pytest.approx(
        s.ticks * (3 * GEMM_MS + permute_ms) + trips)
    assert hlo.bytes_by_kind(text, branch_weights=ticks.weights) == {"collective-permute": sends * 2_000_000}
    assert hlo.bytes_by_kind(text) == {"collective-permute": s.ticks * 2_000_000}
    assert np.allclose(ticks.weights(cond("tx", "sends_forward", "send")), [1 - sends / s.ticks, sends / s.ticks])
