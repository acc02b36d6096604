import jax
import pytest

import jshard
from jshard import MeshError


def test_standard_axes_always_present_in_order():
    mesh = jshard.make_mesh(data=2, fsdp=2, tensor=2)
    assert jshard.mesh_shape(mesh) == {"data": 2, "stage": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_minus_one_fills_the_rest():
    assert jshard.mesh_shape(jshard.make_mesh(data=-1, tensor=2))["data"] == 4
    assert jshard.mesh_shape(jshard.make_mesh(fsdp=-1))["fsdp"] == 8


def test_custom_axis_and_device_subset():
    mesh = jshard.make_mesh(ranks=4, devices=jax.devices()[:4])
    assert jshard.mesh_shape(mesh) == {"data": 1, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1, "ranks": 4}


def test_explicit_axis_type():
    mesh = jshard.make_mesh(data=8, axis_type=jax.sharding.AxisType.Explicit)
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}


def test_product_mismatch_says_count_product_and_fix():
    with pytest.raises(MeshError) as e:
        jshard.make_mesh(data=2, fsdp=2, tensor=4)
    msg = str(e.value)
    assert "needs 16 devices" in msg and "sees 8 cpu" in msg
    assert "use_fake_cpu_devices(16)" in msg and "xla_force_host_platform_device_count=16" in msg


@pytest.mark.parametrize(
    "sizes, fragment",
    [
        ({"data": -1, "fsdp": -1}, "only one mesh axis may be -1"),
        ({"data": 3, "fsdp": -1}, "does not divide the 8"),
        ({"data": 0}, "positive ints"),
        ({"data": 2.0}, "positive ints"),
    ],
)
def test_bad_sizes(sizes, fragment):
    with pytest.raises(MeshError, match=fragment):
        jshard.make_mesh(**sizes)


def test_fake_devices_after_start():
    jshard.use_fake_cpu_devices(8)  # same count: nothing to do
    with pytest.raises(MeshError, match="before any JAX computation"):
        jshard.use_fake_cpu_devices(4)
    with pytest.raises(MeshError, match="positive int"):
        jshard.use_fake_cpu_devices(0)


def test_parse_axis_sizes():
    assert jshard.mesh.parse_axis_sizes("data=2, fsdp=-1") == {"data": 2, "fsdp": -1}
    with pytest.raises(MeshError, match="'fsdp' is not name=size"):
        jshard.mesh.parse_axis_sizes("data=2,fsdp")
    with pytest.raises(MeshError, match="unknown mesh axis 'dta'; known: data, stage, fsdp, context, expert, tensor. "
                                        "Fix: data=8"):
        jshard.mesh.parse_axis_sizes("dta=8")


def test_cli_reports_bad_mesh_without_traceback(capsys):
    from jshard.cli import main

    assert main(["train", "--mesh", "data=3"]) == 2
    assert "jshard train: mesh data=3 needs 3 devices, but JAX sees 8" in capsys.readouterr().err


def test_fake_device_count_respects_xla_flags_unless_the_flag_is_given(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=4")
    assert jshard.mesh.fake_device_count(None, 8) == 4  # the environment's count over the command's default
    assert jshard.mesh.fake_device_count(2, 8) == 2  # --fake-devices over both
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert jshard.mesh.fake_device_count(None, 8) == 8
