"""jshard: name your axes; rules map names to mesh axes; everything else is derived."""

from flax import nnx as _nnx

from jshard.mesh import STANDARD_AXES, MeshError, make_mesh, mesh_shape, use_fake_cpu_devices

# jshard places every param from its rules. Flax's eager sharding would instead read the
# logical names (`out_sharding`) as mesh axes the moment a Variable is created.
_nnx.use_eager_sharding(False)

__all__ = ["STANDARD_AXES", "MeshError", "make_mesh", "mesh_shape", "use_fake_cpu_devices"]
