"""The flags every sub-command shares (`jshard.cli.flags`) and the meshes commands choose when
given none (`mesh.default_mesh`, `planner.validate.example_mesh`)."""

import argparse
import json

import jax
import pytest

from jshard import aot
from jshard import planner
from jshard.bench.strategies import strategies
from jshard.cli import build_parser, main
from jshard.cli.plan import plan_input
from jshard.mesh import default_mesh, mesh_shape
from jshard.planner.validate import EXAMPLE_MESHES, example_mesh
from jshard.rules import ShardingError, preset
from jshard.app.prepare import set_up
from jshard.app.train_config import TrainConfig


def subcommands(parser, prefix=()):
    """{('bench', 'step'): its parser, ...} for every leaf sub-command."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= subcommands(sub, prefix + (name,)) or {prefix + (name,): sub}
    return found


def options(parser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


COMMANDS = subcommands(build_parser())
MODEL = {"--model", "--layers", "--embed", "--heads", "--mlp", "--vocab", "--seq-len"}


@pytest.mark.parametrize("command, shared", [
    (("train",), MODEL | {"--mesh", "--strategy", "--precision", "--remat", "--schedule", "--microbatches",
                          "--virtual", "--fake-devices"}),
    (("plan",), MODEL | {"--mesh", "--strategy", "--precision", "--remat", "--schedule", "--microbatches",
                         "--virtual", "--fake-devices", "--json"}),
    (("bench", "step"), MODEL | {"--mesh", "--strategy", "--precision", "--json"}),
    (("bench", "strategies"), MODEL | {"--fake-devices", "--json"}),
    (("bench", "pipeline"), MODEL | {"--mesh", "--microbatches", "--virtual", "--fake-devices", "--json"}),
    (("bench", "collectives"), {"--mesh", "--fake-devices", "--json"}),
    (("pipeline", "show"), {"--schedule", "--microbatches", "--virtual", "--json"}),
    (("generate",), {"--mesh", "--strategy", "--fake-devices", "--json"}),
    (("compile",), MODEL | {"--mesh", "--strategy", "--precision", "--remat", "--schedule", "--microbatches",
                            "--virtual", "--micro-batch-size", "--json"}),
])
def test_every_command_names_the_shared_flags_alike(command, shared):
    assert shared <= options(COMMANDS[command]), shared - options(COMMANDS[command])


def test_no_command_keeps_an_old_spelling():
    old = {"--d-model", "--d-ff", "--plans", "--stages"}
    for command, parser in COMMANDS.items():
        if command != ("pipeline", "show"):  # its --stages is the schedule's p, with no mesh
            assert not old & options(parser), command


@pytest.mark.parametrize("strategy, devices, expected", [
    ("dp+fsdp+tp", 8, dict(data=2, fsdp=2, tensor=2)),  # jshard train's default
    ("dp+fsdp+tp", 1, dict(data=1, fsdp=1, tensor=1)),
    ("dp+fsdp+tp", 2, dict(data=1, fsdp=1, tensor=2)),
    ("dp+fsdp+tp", 6, dict(data=3, fsdp=1, tensor=2)),
    ("dp", 8, dict(data=8)),
    ("zero3", 4, dict(fsdp=4)),
    ("dp+tp", 8, dict(data=4, tensor=2)),
    ("dp+pp", 8, dict(data=4, stage=2)),
    ("fsdp+tp+pp", 8, dict(stage=2, fsdp=2, tensor=2)),
])
def test_default_mesh_gives_inner_axes_two_and_the_outermost_the_rest(strategy, devices, expected):
    assert default_mesh(preset(strategy), devices) == expected


def test_example_mesh_scales_its_outermost_axis():
    assert example_mesh("dp+tp", 8) == EXAMPLE_MESHES["dp+tp"] == dict(data=2, tensor=4)
    assert example_mesh("dp+tp", 16) == dict(data=4, tensor=4)
    assert example_mesh("zero3", 2) == dict(fsdp=2)
    with pytest.raises(ShardingError, match=r"needs a multiple of 4 devices, not 6"):
        example_mesh("dp+tp", 6)
    with pytest.raises(ShardingError, match="no example mesh for 'tp'"):
        example_mesh("tp", 8)


def test_train_without_mesh_takes_the_strategys_default():
    # Before the shared default, every strategy got data=2,fsdp=2,tensor=2, which dp refuses.
    for strategy, expected in (("dp", dict(data=8)), ("zero3", dict(fsdp=8)), ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2))):
        setup = set_up(TrainConfig.of(model="tiny", strategy=strategy, steps=1))
        assert {a: n for a, n in mesh_shape(setup.mesh).items() if n > 1} == expected


def test_train_model_size_flags_override_the_named_size():
    setup = set_up(TrainConfig.of(model="tiny", strategy="dp", layers=3, embed=96, heads=3, mlp=200, vocab=256, steps=1))
    assert (setup.model.layers, setup.model.embed, setup.model.heads, setup.model.mlp) == (3, 96, 3, 200)


@pytest.mark.parametrize("argv", [
    ["plan", "--embed", "100", "--heads", "3"],
    ["bench", "step", "--embed", "100", "--heads", "3"],
    ["train", "--embed", "100", "--heads", "3"],
])
def test_sizes_that_do_not_fit_are_one_error(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--embed 100 --heads 3" in err and "embed=100 must divide by heads=3" in err, err


@pytest.mark.parametrize("argv, message", [
    (["plan", "--layers", "0"], "'0' is not a positive int"),
    (["bench", "strategies", "--batch-size", "-2"], "'-2' is not a positive int"),
    (["bench", "search", "--seed", "-1"], "'-1' is not an int of 0 or more"),
])
def test_non_positive_sizes_are_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_plan_json_is_written_the_shared_way(tmp_path):
    out = tmp_path / "e.json"
    assert main(["plan", "--strategy", "zero3", "--devices", "4", "--json", str(out)]) == 0
    est = json.loads(out.read_text())
    assert est["mesh"]["fsdp"] == 4 and out.read_text().endswith("\n")


@pytest.mark.parametrize("command", ["plan", "compile"])
def test_plan_and_compile_take_trains_batch_size_or_a_micro_batch_not_both(command, capsys):
    args = build_parser().parse_args([command, "--batch-size", "16"])
    assert (args.batch_size, args.micro_batch_size) == (16, None)
    with pytest.raises(SystemExit) as exit:
        main([command, "--batch-size", "16", "--micro-batch-size", "2"])
    assert exit.value.code == 2 and "not allowed with argument --batch-size" in capsys.readouterr().err


@pytest.mark.parametrize("argv, rows", [([], 1), (["--batch-size", "16"], 2), (["--micro-batch-size", "3"], 3)])
def test_plan_batch_size_is_the_steps_rows_over_its_data_shards(tmp_path, argv, rows):
    out = tmp_path / "e.json"
    assert main(["plan", "--strategy", "dp+fsdp", "--mesh", "data=2,fsdp=4", *argv, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["micro_batch_size"] == rows


def test_plan_batch_size_that_does_not_split_gets_one_line(capsys):
    assert main(["plan", "--batch-size", "12"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "jshard plan: --batch-size 12 does not split over 8 batch shards (data) = 8. Fix: make --batch-size a multiple of 8."]


def test_a_pipeline_without_micro_batches_is_told_the_flag(capsys):
    assert main(["plan", "--strategy", "dp+pp", "--mesh", "data=2,stage=4"]) == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert "it needs --microbatches," in line and line.endswith("Fix: --microbatches=4 (or more, for a smaller bubble).")
    assert "Layout" not in line, line


def test_plan_says_which_of_its_defaults_differ_from_trains(capsys):
    assert main(["plan"]) == 0
    line, = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  defaults")]
    assert line.startswith("  defaults    strategy dp (train: dp+fsdp+tp), precision bf16 (train: fp32), seq 128 (train: "
                           "64 or the model's if shorter), batch 8 rows (train: 16): plan's are for the GPUs"), line
    assert main(["plan", "--strategy", "dp+fsdp+tp", "--precision", "fp32", "--seq-len", "64", "--batch-size", "16"]) == 0
    assert "defaults" not in capsys.readouterr().out


def test_plan_remat_selective_lies_between_none_and_full():
    def activations(remat):
        args = build_parser().parse_args(["plan", "--model", "gpt-125m", "--remat", remat])
        return planner.estimate(plan_input(args))["memory_bytes_per_device"]["activations"]

    assert activations("full") < activations("selective") < activations("none")


def test_validation_runs_on_fewer_devices():
    r = planner.validate_one("dp+tp", None, None, "none", devices=jax.devices()[:4])
    assert r["mesh"] == "tensor=4" and planner.within_tolerance(r), r


def test_bench_strategies_reads_presets_and_meshes():
    assert strategies("dp; zero3@data=2,fsdp=4", 8) == [("dp", dict(data=8)), ("zero3", dict(data=2, fsdp=4))]
    assert [p for p, _ in strategies(None, 8)] == [p for p, m in EXAMPLE_MESHES.items() if "stage" not in m]
    with pytest.raises(ShardingError, match="unknown strategy 'fast'"):
        strategies("dp+fast", 8)


@pytest.mark.parametrize("argv", [
    ["compile", "--strategy", "fsdp", "--mesh", "fsdp=4", "--target", "h100x8"],  # 4 devices for 8 GPUs
    ["plan", "--target", "h100x8"],  # --target without --validate
])
def test_compile_refusals_are_one_line(argv, capsys):
    """Without the CUDA plugin `jshard compile` says how to install it; with it, what is wrong."""
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    if argv[0] == "plan":
        assert "give --validate too" in line
    else:
        assert ("pip install jax-cuda13-plugin" in line) if aot.gpu_compiler_missing() else ("--mesh fsdp=4: 4 devices" in line)
