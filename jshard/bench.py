"""Benchmarks: `jshard bench <what>`."""

from __future__ import annotations


def add_parser(commands) -> None:
    parser = commands.add_parser("bench", help="benchmark collectives and steps")
    parser.add_subparsers(dest="bench", required=True)
