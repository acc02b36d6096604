"""Every test runs on 8 fake CPU devices: JAX must hear that before it starts.

JSHARD_TEST_DEVICE=1 (`make gpu-check`, on a GPU machine): JAX starts on the device it finds and
only the device tier's files (DEVICE_FILES, their tests marked `device`) are collected."""

import os

import jshard
from seed import describe_seed

# The suite compiles far more than it runs: XLA:CPU's LLVM optimisation of the generated code
# is most of a compile and changes no result (the HLO, its buffers and collectives are the
# same). Without it the suite takes a quarter less time. Subprocesses (launch tests) inherit it.
# jshard's GPU flags too, for the gpu_compile tier's programs (`jshard compile` sets them);
# XLA:CPU ignores them.
ON_DEVICE = os.environ.get("JSHARD_TEST_DEVICE") == "1"
os.environ["XLA_FLAGS"] = " ".join(os.environ.get("XLA_FLAGS", "").split() + (
    [] if ON_DEVICE else ["--xla_backend_optimization_level=0"]) + list(jshard.mesh.GPU_XLA_FLAGS))
if not ON_DEVICE:
    jshard.use_fake_cpu_devices(8)


def pytest_report_header(config):
    return describe_seed()  # in every CI log, so that a failure can be replayed


# The fast tier (`make test-fast`, `pytest -m fast`): one case per strategy family against one
# device, the checks of bad input, the plan, the planner and the layout of the code. One table,
# by test id prefix, so the tier is read in one place; the full suite still runs every test.
FAST = (
    "tests/test_imports.py::", "tests/test_step_plan.py::", "tests/test_rules.py::", "tests/test_schedules.py::",
    "tests/test_plan.py::test_plan_cli_json_and_warnings", "tests/test_plan.py::test_plan_formulas_scale_as_the_textbook",
    "tests/test_plan.py::test_context_parallel_moe_is_refused",
    "tests/test_abstract_step.py::test_the_abstract_step_is_the_step_built_on_devices",
    *(f"tests/test_strategies.py::test_matches_one_device[{case}]" for case in (
        "dp-gpt", "zero1-gpt", "zero2-gpt", "zero3-gpt", "dp+tp+sp-gpt", "dp+cp-gpt0", "dp+ep-moe")),
    "tests/test_strategies.py::test_data_parallel_traffic_is_textbook",
    "tests/test_strategies.py::test_batch_not_divisible_by_batch_shards",
    "tests/test_pipeline.py::test_schedule_mlp[4-2-1f1b]",
    "tests/test_train.py::test_bad_flags_are_refused_before_device_work",
    "tests/test_hf.py::test_hf_logits_match_transformers", "tests/test_hf.py::test_hf_bad_configs_get_one_line",
)


# The files of the device tier: on a device only these are imported (the others build 8-device
# meshes as they load).
DEVICE_FILES = ("test_on_device.py",)


def pytest_ignore_collect(collection_path, config):
    if ON_DEVICE and collection_path.suffix == ".py" and collection_path.name not in DEVICE_FILES:
        return True
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        nodeid = item.nodeid if item.nodeid.startswith("tests/") else f"tests/{item.nodeid}"
        if nodeid.startswith(FAST):
            item.add_marker("fast")
