"""The docs' transcripts are today's output: every fenced block in README.md and docs/*.md that
shows a `$ jshard plan ...` or `$ jshard pipeline show ...` command (deterministic, no devices,
seconds) is run, and its lines must be the command's output, line for line. Slower commands'
transcripts (train, bench, generate) are held by their own tests of the numbers they print."""

import re
import shlex
from pathlib import Path

import pytest

from jshard.cli import main

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("jshard plan ", "jshard pipeline show ")


def transcripts() -> list[tuple[str, str, list[str]]]:
    """(where, command, the lines shown after it) for every checked transcript."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for block in re.finditer(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
            lines = block.group(1).splitlines()
            if not lines or not lines[0].startswith("$ ") or not lines[0][2:].startswith(CHECKED):
                continue
            command = lines[0][2:]
            while command.endswith("\\"):  # a command continued over lines
                lines.pop(0)
                command = command[:-1] + lines[0].strip()
            line = text[:block.start()].count("\n") + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", command, lines[1:]))
    return found


TRANSCRIPTS = transcripts()


def test_the_docs_show_transcripts_of_the_checked_commands():
    assert len(TRANSCRIPTS) >= 8, TRANSCRIPTS  # the plan and pipeline transcripts of planning.md and pipeline.md


@pytest.mark.parametrize("where, command, shown", TRANSCRIPTS, ids=[t[0] for t in TRANSCRIPTS])
def test_a_transcript_is_the_commands_output(where, command, shown, capsys):
    if "--validate" in command:
        pytest.skip("the validation compiles every row (minutes): its figures are test_plan.py's")
    code = main(shlex.split(command)[1:])
    captured = capsys.readouterr()
    out = (captured.out + captured.err).rstrip("\n").splitlines()
    assert code in (0, 2), f"{where}: `{command}` exited {code}"
    assert out == shown, f"{where}: `{command}` now prints:\n" + "\n".join(out)
