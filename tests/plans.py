"""(preset, mesh sizes) pairs the tests run on 8 fake CPU devices: every strategy, and the
combinations on one 2×2×2 mesh."""

STRATEGIES = [
    ("dp", dict(data=8)),
    ("zero1", dict(fsdp=8)),
    ("zero2", dict(fsdp=8)),
    ("zero3", dict(fsdp=8)),
    ("dp+tp", dict(data=2, tensor=4)),
    ("dp+tp+sp", dict(data=2, tensor=4)),
    ("dp+fsdp", dict(data=2, fsdp=4)),
    ("fsdp+tp", dict(fsdp=4, tensor=2)),
    ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2)),
    ("dp+fsdp+tp+sp", dict(data=2, fsdp=2, tensor=2)),
]

# Placement also covers the pipeline's `layers` over `stage` (its step is another issue's).
PLACEMENTS = STRATEGIES + [("dp+pp", dict(data=2, stage=4)), ("fsdp+tp+pp", dict(fsdp=2, tensor=2, stage=2))]
