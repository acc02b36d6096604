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

from jshard import models, nn
from jshard.distributed import initialize
from jshard.layout import Layout
from jshard.mesh import MeshError, make_mesh, mesh_shape, use_fake_cpu_devices
from jshard.parallel import build_step, summed
from jshard.placement import describe, init, shard, shardings, specs
from jshard.rules import Rules, ShardingError, activate, constrain, named, preset, use_rules

# jshard places every Variable from its rules. Flax's eager sharding would instead read the
# logical names (`out_sharding`) as mesh axes the moment a Variable is created.
_nnx.use_eager_sharding(False)

# What a user writes, each name once: devices and a mesh, rules and the logical names, a model
# placed by them, a step, and the model packages (`jshard.nn` layers, `jshard.models`). Everything
# else lives, documented, in its own module (`jshard.mesh.STANDARD_AXES`, `jshard.rules.PRESET_PARTS`,
# `jshard.placement.Report`, `jshard.collectives`, `jshard.planner`, the app in `jshard.app`, ...).
__all__ = [
    "Layout", "MeshError", "Rules", "ShardingError", "activate", "build_step", "constrain", "describe", "init",
    "initialize", "make_mesh", "mesh_shape", "models", "named", "nn", "preset", "shard", "shardings", "specs",
    "summed", "use_fake_cpu_devices", "use_rules",
]
