"""What a compiled step moves: bytes per kind of collective, counted from its HLO (`jshard.hlo`),
loop trips counted, each buffer in the dtype the program gave it (not XLA:CPU's widened one)."""

import numpy as np

from jshard import hlo
from jshard.bench.strategies import textbook_bytes


def collective_bytes(step, batch, min_bytes: int = 0, inside_loop_of: int | None = None) -> dict[str, int]:
    """Bytes per kind of every collective the step compiled for `batch` runs. Buffers of
    `min_bytes` or fewer are left out (8: the loss's scalar); with `inside_loop_of`, only the
    collectives run that many times (in the scan over layers)."""
    lowered = step.lower(step.state, step.shard_batch(batch))
    totals = {}
    for c in hlo.collectives(lowered.compile().as_text(), lowered.as_text()):
        moved = sum(b for b in c.buffers if b > min_bytes)
        if moved and (inside_loop_of is None or c.count == inside_loop_of):
            totals[c.kind] = totals.get(c.kind, 0) + moved * c.count
    return totals


def assert_context_bytes_are_the_planners(step, config, batch, preset, sizes):
    """A context-parallel step: every collective the compiled step runs, in bytes, is what the planner's formulas say
    (`plan.traffic`: the ring's sends, the gradient all-reduce over batch and context axes,
    TP/SP on the local chunks); and the ring's, counted by hand: per layer K and V
    (rows · seq/n · kv_heads/tensor · head_dim · 4 B each) sent on n-1 times forward and n-1
    times backward, their gradients n times; all-to-all's likewise (`context_traffic`)."""
    counted = collective_bytes(step, batch)
    assert sum(counted.values()) == textbook_bytes(step, config, batch.shape)
    n, tensor = sizes["context"], sizes.get("tensor", 1)
    kv_heads = getattr(config, "kv_heads", config.heads)
    rows = batch.shape[0] // sizes.get("data", 1) // sizes.get("fsdp", 1)
    block = rows * config.seq_len // n * kv_heads // tensor * config.head_dim * 4
    if "gather" in preset:
        assert "collective-permute" not in counted
    elif "a2a" in preset:  # Q, K, V, the output and their gradients each a share, (K, V repeated to a multiple of n)
        assert "collective-permute" not in counted
        heads, kv_heads = config.heads // tensor, kv_heads // tensor
        repeated = kv_heads * (n // np.gcd(kv_heads, n))
        passes = 3 if config.remat != "none" else 2
        assert counted["all-to-all"] == config.layers * passes * 2 * (heads + repeated) * block // kv_heads
    else:
        assert counted["collective-permute"] == config.layers * 2 * block * (2 * (n - 1) + n)
