"""Every example runs at small sizes, and what it prints says what the lecture claims.

The examples are imported from examples/ and their `main(argv)` called in this process (the
8 fake CPU devices of conftest); one also runs as a script, in a fresh process, the way the
docs tell users to run it.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parity import TOLERANCE  # fp32 against one device

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MLP = ["--dim", "64", "--layers", "4", "--batch-size", "16"]


def run_example(name: str, argv: list[str], capsys) -> str:
    """Import examples/<name>.py and run its main(argv); return what it printed."""
    sys.path.insert(0, str(EXAMPLES))  # the examples import their helper, _common
    try:
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        capsys.readouterr()
        module.main(argv)
    finally:
        sys.path.remove(str(EXAMPLES))
    return capsys.readouterr().out


def numbers(pattern: str, text: str) -> list[tuple[float, ...]]:
    """Every match of `pattern` in `text`, its groups as floats."""
    return [tuple(map(float, m)) if isinstance(m, tuple) else (float(m),) for m in re.findall(pattern, text)]


def assert_parity(out: str, what: str) -> None:
    (loss_err, err), = numbers(rf"parity vs one device: loss rel err (\S+), {what} rel err (\S+)", out)
    assert loss_err <= TOLERANCE and err <= TOLERANCE, out


def test_data_parallel_losses_differ_params_equal(capsys):
    out = run_example("mlp_data_parallel", MLP + ["--steps", "2"], capsys)
    for step in (0, 1):
        losses = [loss for (loss,) in numbers(rf"Rank \d: step = {step}, loss = (\S+),", out)]
        assert len(losses) == 8 and len(set(losses)) == 8, out  # each rank its own slice
        (mean, loss), = numbers(rf"step {step}: .* their mean (\S+) is the step's loss (\S+)", out)
        assert abs(sum(losses) / 8 - mean) < 1e-5 and abs(mean - loss) < 1e-5, out
    params = re.findall(r"Rank \d: step = 1, .*params = (.*)", out)
    assert len(params) == 8 and len(set(params)) == 1, out
    (spread,), = numbers(r"max \|difference\| between ranks' copies = (\S+)", out)
    assert spread == 0.0, out
    assert_parity(out, "params")


def test_tensor_parallel_forward_and_backward(capsys):
    out = run_example("mlp_tensor_parallel", MLP, capsys)
    activations = re.findall(r"Rank \d: forward pass produced activations (.*)", out)
    assert len(activations) == 8 and set(activations) == {activations[0]} and activations[0].startswith("16x64["), out
    (spread, err), = numbers(r"forward: max \|difference\| between ranks (\S+), rel err vs one device (\S+)", out)
    assert spread == 0.0 and err <= TOLERANCE, out
    columns = re.findall(r"Rank (\d): backward pass produced gradients 4x64x8\[.*\] \(columns (\d+):(\d+)\)", out)
    assert [(int(r), int(a), int(b)) for r, a, b in columns] == [(r, 8 * r, 8 * r + 8) for r in range(8)], out
    assert_parity(out, "grads")
    activation = 16 * 64 * 4
    assert f"4 x all-gather of {activation} B" in out and f"4 x reduce-scatter of {activation} B" in out, out


@pytest.mark.parametrize(
    "stages, microbatches, schedule",
    [(2, 4, "gpipe"), (4, 4, "1f1b"), (2, 4, "interleaved"), (2, 4, "zb-h1")],
)
def test_pipeline_forward_backward_and_grid(capsys, stages, microbatches, schedule):
    argv = MLP + ["--stages", str(stages), "--microbatches", str(microbatches), "--schedule", schedule]
    out = run_example("mlp_pipeline_parallel", argv, capsys)
    sends = re.findall(r"Rank (\d): sending (\d+)x64\[.*\] to rank (\d)", out)
    assert len(sends) == (stages - 1) * microbatches, out
    assert all(int(dst) == int(src) + 1 and int(rows) == 16 // microbatches for src, rows, dst in sends), out
    (err,), = numbers(r"forward: the last rank's output, rel err vs one device (\S+)", out)
    assert err <= TOLERANCE, out
    virtual = 2 if schedule == "interleaved" else 1
    kinds = {"zb-h1": ["F", "B", "W"]}.get(schedule, ["F", "BW"])
    grid = re.findall(r"^stage (\d) +(.*)$", out, re.M)  # every micro-batch once per kind and chunk on every stage
    assert len(grid) == stages, out
    for _, row in grid:
        done = [re.sub(r"\d", "", cell.split(".")[0]) for cell in row.split() if cell != "."]
        assert sorted(done) == sorted(kinds * microbatches * virtual), out
    assert re.search(rf"^{schedule}: p={stages} stages, m={microbatches} micro-batches, v={virtual}", out, re.M), out
    per_chunk = 4 // (stages * virtual)
    held = re.findall(r"Rank (\d): backward pass produced gradients \S+ \(layers (.*)\)", out)
    positions = [[c * stages + r for c in range(virtual)] for r in range(stages)]  # chunk c of rank r
    expected = [(str(r), ", ".join(f"{k * per_chunk}:{(k + 1) * per_chunk}" for k in at)) for r, at in enumerate(positions)]
    assert held == expected, out
    assert_parity(out, "grads")


def test_zero_stages_memory_falls_as_the_textbook_says(capsys):
    out = run_example("zero_stages", MLP, capsys)
    lines = [line.split("|")[:2] for line in out.splitlines() if re.match(r"(dp|zero\d) ", line)]
    rows = {state.split()[0]: state.split()[1:] + compiled.split()[:4] for state, compiled in lines}
    assert list(rows) == ["dp", "zero1", "zero2", "zero3"], out
    n = 8
    expected = {"dp": 4, "zero1": 2 + 2 / n, "zero2": 1 + 3 / n, "zero3": 4 / n}
    compiled = []
    for preset, row in rows.items():
        params, grads, opt, total, textbook, in_psi, kept, temp, nbytes = map(float, row)
        assert abs(textbook - expected[preset]) < 1e-3 and abs(total - textbook) < 1e-3, out
        assert abs(kept - (params + opt)) < 0.05 and temp >= grads, out  # the batch is kept too; temps hold grads
        compiled.append(nbytes)
    assert compiled == sorted(compiled, reverse=True) and len(set(compiled)) == 4, out
    assert "all-reduce 1.00 | 1 all-reduce" in out, out
    zero3 = r"^zero3 .* all-gather 2\.00, reduce-scatter 1\.00 \| 1 reduce-scatter \+ 2 all-gathers$"
    assert re.search(zero3, out, re.M), out


def test_context_parallel_memory_falls_with_cp_at_seq_4096(capsys):
    """One 4096-token row on 1, 2, 4 and 8 devices: the ring keeps no scores, so the compiled
    temporaries per device fall faster than 1/cp; all-gathered K/V keeps each local query's
    scores over the whole sequence, about 1/cp. The attention's bytes are the planner's."""
    out = run_example("context_parallel", [], capsys)
    rows = {(m[0], int(m[1])): tuple(map(float, m[2:])) for m in
            re.findall(r"^(dp|cp|cp-gather) +(\d) +(\d+) +(\S+) +(\S+) +(\d+) +(\d+) +(\d+)$", out, re.M)}
    assert sorted(rows) == [("cp", 2), ("cp", 4), ("cp", 8), ("cp-gather", 2), ("cp-gather", 4), ("cp-gather", 8),
                            ("dp", 1)], out
    for (preset, cp), (temp, ratio, inverse, _, moved, planned) in rows.items():
        assert moved == planned, out
        assert ratio < inverse if preset == "cp" else ratio < 1.1 * inverse, out
    assert rows["cp", 8][0] < rows["cp", 4][0] < rows["cp", 2][0], out


def test_train_gpt_loss_falls(capsys):
    out = run_example("train_gpt", ["--steps", "12", "--embed", "32", "--layers", "2", "--seq-len", "16",
                                    "--batch-size", "8"], capsys)
    assert "params under 'dp+zero3+tp' (ZeRO stage 3) on mesh data=2 stage=1 fsdp=2 context=1 expert=1 tensor=2" in out, out
    (first, last), = numbers(r"loss (\S+) -> (\S+) in 12 steps", out)
    assert last < first - 0.05, out


def test_train_gpt_stays_short():
    assert len((EXAMPLES / "train_gpt.py").read_text().splitlines()) <= 40


def test_an_example_runs_as_a_script():
    """As users run it: a fresh process, fake CPU devices asked for by the example itself."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(EXAMPLES / "mlp_data_parallel.py"), "--dim", "32", "--batch-size", "16"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "8 ranks, batch 16 -> 2 rows per rank" in done.stdout and "Rank 7: step = 0" in done.stdout, done.stdout


@pytest.mark.parametrize("preset, mesh", [("dp+fsdp", "data=2,fsdp=4"), ("dp+tp", "data=2,tensor=4")])
def test_flax_docs_cnn_learns_under_jshard(capsys, preset, mesh):
    out = run_example("train_flax_cnn", ["--preset", preset, "--mesh", mesh, "--steps", "21", "--batch-size", "32"],
                      capsys)
    losses, accuracies = zip(*numbers(r"step +\d+  loss (\S+)  accuracy (\S+)", out))  # the loss's own metric
    (accuracy,), = numbers(r"held-out accuracy (\S+)", out)
    assert losses[-1] < 0.2 * losses[0] and accuracy > 0.9 and accuracies[-1] > accuracies[0], out  # chance: 0.1
    assert ("read whole by a plain layer" in out) == ("tp" in preset), out  # describe says what tp leaves whole
