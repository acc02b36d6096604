"""Every test runs on 8 fake CPU devices: JAX must hear that before it starts.

The tiers are markers at the tests (pyproject.toml lists them): `fast` (make test-fast), `slow`
(end to end: processes, the network, a benchmark command), `gpu_compile` (XLA:GPU, no GPU),
`device` (a real device under `make gpu-check`); the rest is the unmarked middle. Each test's
cost is counted as it runs (seconds and XLA compilations) and the run ends with the tiers'
totals and its slowest tests, so that the suite's budget stays in view.

JSHARD_TEST_DEVICE=1 (`make gpu-check`, on a GPU machine): JAX starts on the device it finds and
only the device tier's files (DEVICE_FILES, their tests marked `device`) are collected."""

import collections
import os

import jax
import pytest

import jshard
from compile_flags import CPU_COMPILE_FLAGS
from seed import describe_seed

# The suite's XLA:CPU flags (compile_flags.py says why), and jshard's GPU flags for the
# gpu_compile tier's programs, with no GPU here (`jshard compile` sets them; XLA:CPU ignores
# them). Subprocesses inherit them.
ON_DEVICE = os.environ.get("JSHARD_TEST_DEVICE") == "1"
os.environ["XLA_FLAGS"] = " ".join(os.environ.get("XLA_FLAGS", "").split() + (
    [] if ON_DEVICE else CPU_COMPILE_FLAGS + list(jshard.mesh.DEVICELESS_XLA_FLAGS)) + list(jshard.mesh.GPU_XLA_FLAGS))
if not ON_DEVICE:
    jshard.use_fake_cpu_devices(8)
# Tried once here, as every command tries a user's flags; child processes inherit the answer.
jshard.mesh.check_xla_flags()


def pytest_report_header(config):
    return describe_seed()  # in every CI log, so that a failure can be replayed


# The files of the device tier: on a device only these are imported (the others build 8-device
# meshes as they load).
DEVICE_FILES = ("test_on_device.py", "test_flash.py")


def pytest_ignore_collect(collection_path, config):
    if ON_DEVICE and collection_path.suffix == ".py" and collection_path.name not in DEVICE_FILES:
        return True
    return None


# -- what each test costs ------------------------------------------------------------------------

_compiles = 0  # XLA compilations in this process so far (eager operations' too)
_COMPILES_AT_START = pytest.StashKey[int]()


def _count_compiles(event, duration, **_):
    global _compiles
    _compiles += event == "/jax/core/compile/backend_compile_duration"


jax.monitoring.register_event_duration_secs_listener(_count_compiles)

TIERS = ("device", "gpu_compile", "slow", "fast")  # a test's tier: the first of its markers here
SLOWEST = 15  # tests listed at the end of a run


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_COMPILES_AT_START] = _compiles


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "call":  # setup's and the call's compilations; teardown compiles nothing
        item.user_properties.append(("compiles", _compiles - item.stash.get(_COMPILES_AT_START, _compiles)))
    yield


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Each tier's tests, seconds and compilations, then the slowest tests (with pytest-xdist the
    workers' reports arrive here with their user_properties)."""
    seconds, compiles, tier = collections.Counter(), collections.Counter(), {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if not isinstance(report, pytest.TestReport):
                continue
            seconds[report.nodeid] += report.duration
            if report.when == "call":  # the teardown's report carries the same count again
                compiles[report.nodeid] += dict(report.user_properties).get("compiles", 0)
            tier[report.nodeid] = next((t for t in TIERS if t in report.keywords), "unmarked")
    if not seconds:
        return
    write = terminalreporter.write_line
    terminalreporter.section("what the tests cost")
    for name in (*TIERS, "unmarked"):
        ids = [i for i in seconds if tier[i] == name]
        if ids:
            write(f"{name:>12}: {len(ids):5d} tests {sum(seconds[i] for i in ids):8.0f} s "
                  f"{sum(compiles[i] for i in ids):7d} XLA compilations")
    write(f"the {SLOWEST} slowest (s, compilations, tier):")
    for nodeid, s in seconds.most_common(SLOWEST):
        write(f"{s:8.1f} {compiles[nodeid]:5d}  {tier[nodeid]:<11} {nodeid}")
