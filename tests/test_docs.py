"""The docs' transcripts are today's output. Every `$ jshard plan ...` and `$ jshard pipeline
show ...` in a fenced block of README.md or docs/*.md (deterministic, no devices, seconds), and
every `$ jshard train ...` shown refused with its one line and needing no files, is run, and what
the block shows after it must be the command's output, line for line. Slower commands'
transcripts (training, benches, generation) are held by their own tests of the numbers they print."""

import re
import shlex
from pathlib import Path

import pytest

from jshard.cli import main

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("jshard plan ", "jshard pipeline show ")


def checked(command: str, shown: list[str]) -> bool:
    if command.startswith(CHECKED):
        return True
    refused = len(shown) == 1 and shown[0].startswith("jshard train: ")
    return command.startswith("jshard train ") and refused and "runs/" not in command  # (runs/: made by earlier runs)


def transcripts() -> list[tuple[str, str, list[str]]]:
    """(where, command, the lines shown after it) for every checked transcript."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for block in re.finditer(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
            first = text[:block.start()].count("\n") + 2
            lines = block.group(1).splitlines()
            starts = [i for i, line in enumerate(lines) if line.startswith("$ ")] + [len(lines)]
            for start, end in zip(starts, starts[1:]):
                command, at = lines[start][2:], start
                while command.endswith("\\"):  # a command continued over lines
                    at += 1
                    command = command[:-1] + lines[at].strip()
                shown = lines[at + 1:end]
                if checked(command, shown):
                    found.append((f"{path.relative_to(ROOT)}:{first + start}", command, shown))
    return found


TRANSCRIPTS = transcripts()


def test_the_docs_show_transcripts_of_the_checked_commands():
    assert len(TRANSCRIPTS) >= 14, TRANSCRIPTS  # planning.md's and pipeline.md's, training.md's refusals


@pytest.mark.parametrize("where, command, shown", TRANSCRIPTS, ids=[t[0] for t in TRANSCRIPTS])
def test_a_transcript_is_the_commands_output(where, command, shown, capsys):
    if "--validate" in command:
        pytest.skip("the validation compiles every row (minutes): its figures are test_planner.py's")
    code = main(shlex.split(command)[1:])
    captured = capsys.readouterr()
    out = (captured.out + captured.err).rstrip("\n").splitlines()
    assert code in (0, 2), f"{where}: `{command}` exited {code}"
    assert out == shown, f"{where}: `{command}` now prints:\n" + "\n".join(out)


def test_the_architecture_table_has_one_row_per_module():
    """docs/architecture.md's module tables stay true: a row for each module, none for a module gone."""
    rows = re.findall(r"^\| `(jshard/[\w/]+\.py)` \|", (ROOT / "docs" / "architecture.md").read_text(), re.M)
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "jshard").rglob("*.py"))
    assert len(rows) == len(set(rows))
    assert sorted(rows) == modules
