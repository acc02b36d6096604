"""The device start-up `jshard train` and `jshard generate` share."""

from __future__ import annotations

from jshard.distributed import initialize
from jshard.mesh import fake_device_count, use_fake_cpu_devices_unless_accelerated, use_gpu_xla_flags


def start_devices(fake_devices: int | None, default: int) -> None:
    """Before JAX starts its backends: jshard's GPU XLA flags (beside the user's XLA_FLAGS, theirs
    win), joining a multi-process run (jshard launch, srun, mpirun; one process: nothing), and
    `fake_devices` CPU devices (None: XLA_FLAGS's count, else `default`) where no accelerator is."""
    use_gpu_xla_flags()
    initialize()
    use_fake_cpu_devices_unless_accelerated(fake_device_count(fake_devices, default))
