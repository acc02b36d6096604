"""What a compiled step moves: bytes per kind of collective, counted from its HLO (`jshard.hlo`),
loop trips counted, each buffer in the dtype the program gave it (not XLA:CPU's widened one)."""

from jshard import hlo


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
