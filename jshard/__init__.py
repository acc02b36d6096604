"""jshard: name your axes; rules map names to mesh axes; everything else is derived.

    jshard.use_fake_cpu_devices(8)                      # only on a laptop, before JAX starts
    jshard.initialize()                                 # multi-process runs: join them (else a no-op)
    mesh = jshard.make_mesh(data=2, fsdp=2, tensor=2)
    rules = jshard.preset("dp+fsdp+tp")
    model = jshard.init(lambda: GPT(GPTConfig(), rngs=nnx.Rngs(0)), mesh, rules)
    print(jshard.describe(model, mesh, rules))
    step = jshard.build_step(model, optax.adamw(3e-4), jshard.models.gpt_loss, jshard.Layout.of(rules, mesh), mesh)
    # or the whole layout as one line, its mesh made over the devices:
    # jshard.build_step(model, tx, loss, "dp+fsdp+tp data=2,fsdp=2,tensor=2 precision=mixed accum=4")
"""

from flax import nnx as _nnx

from jshard import collectives, models, nn, parallel
from jshard.collectives import CollectiveError
from jshard.distributed import DistributedError, initialize
from jshard.layout import Layout
from jshard.mesh import (
    STANDARD_AXES,
    MeshError,
    make_mesh,
    mesh_shape,
    use_fake_cpu_devices,
    use_fake_cpu_devices_unless_accelerated,
)
from jshard.parallel import build_step, summed
from jshard.parallel.schedules import ScheduleError
from jshard.placement import Placement, Report, describe, init, shard, shardings, specs
from jshard.rules import (
    LOGICAL_NAMES,
    PRESET_PARTS,
    Rules,
    ShardingError,
    activate,
    constrain,
    named,
    preset,
)

# jshard places every Variable from its rules. Flax's eager sharding would instead read the
# logical names (`out_sharding`) as mesh axes the moment a Variable is created.
_nnx.use_eager_sharding(False)

# What a user needs: devices, a mesh, rules, a model placed by them, a step. The rest above stays
# importable here for existing callers (`jshard.specs`, `jshard.mesh_shape`, the other errors, ...)
# and lives, documented, in its own module.
__all__ = [
    "Layout", "MeshError", "Rules", "ShardingError", "activate", "build_step", "constrain", "describe", "init", "initialize",
    "make_mesh", "models", "named", "nn", "preset", "shard", "summed", "use_fake_cpu_devices",
]
