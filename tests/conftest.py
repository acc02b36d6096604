"""Every test runs on 8 fake CPU devices: JAX must hear that before it starts."""

import jshard

jshard.use_fake_cpu_devices(8)
