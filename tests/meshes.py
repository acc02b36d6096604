"""(preset, mesh sizes) pairs the tests run on 8 fake CPU devices: jshard's example meshes
(`jshard.rules.EXAMPLE_MESHES`), every strategy, and the combinations on one 2×2×2 mesh."""

from jshard.rules import EXAMPLE_MESHES

PLACEMENTS = list(EXAMPLE_MESHES.items())  # placement also covers `layers` over a stage axis
STRATEGIES = [(preset, sizes) for preset, sizes in PLACEMENTS if "stage" not in sizes]  # the steps without a pipeline
