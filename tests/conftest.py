"""Every test runs on 8 fake CPU devices: JAX must hear that before it starts."""

import os

import jshard
from seed import describe_seed

# The suite compiles far more than it runs: XLA:CPU's LLVM optimisation of the generated code
# is most of a compile and changes no result (the HLO, its buffers and collectives are the
# same). Without it the suite takes a quarter less time. Subprocesses (launch tests) inherit it.
os.environ["XLA_FLAGS"] = " ".join(os.environ.get("XLA_FLAGS", "").split() + ["--xla_backend_optimization_level=0"])
jshard.use_fake_cpu_devices(8)


def pytest_report_header(config):
    return describe_seed()  # in every CI log, so that a failure can be replayed
