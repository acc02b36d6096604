"""(preset, mesh sizes) pairs the tests run on 8 fake CPU devices: jshard's example meshes
(`jshard.planner.validate.EXAMPLE_MESHES`), every strategy, and the combinations on one 2×2×2 mesh."""


from jshard.planner.validate import EXAMPLE_MESHES

PLACEMENTS = list(EXAMPLE_MESHES.items())  # placement also covers `layers` over a stage axis
# The steps without a pipeline; those splitting experts (a mixture of experts' models) apart.
STRATEGIES = [(preset, sizes) for preset, sizes in PLACEMENTS if "stage" not in sizes and "expert" not in sizes]
EXPERT_STRATEGIES = [(preset, sizes) for preset, sizes in PLACEMENTS if "expert" in sizes]
