"""Declare a mesh and rules, place a GPT by them, and read the report.

    python examples/place_gpt.py            # on 8 fake CPU devices
"""

import jshard
from flax import nnx
from jshard.models import GPT, GPTConfig

jshard.use_fake_cpu_devices(8)  # only without an accelerator; before JAX starts
mesh = jshard.make_mesh(data=2, fsdp=2, tensor=2)
rules = jshard.preset("dp+fsdp+tp")
model = jshard.init(lambda: GPT(GPTConfig(), rngs=nnx.Rngs(0)), mesh, rules)
print(rules)
print(jshard.describe(model, mesh, rules))
