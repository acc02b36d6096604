"""`jshard plot`: a training run's metrics file to a PNG; the drawing is `jshard.app.curves`'s."""

from __future__ import annotations

from pathlib import Path

from jshard.app import curves


def add_parser(commands) -> None:
    parser = commands.add_parser("plot", help="draw a training run's metrics file (loss, tokens/s, MFU over steps) to a PNG",
                                 description=curves.__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("metrics", metavar="METRICS.jsonl", help="the file jshard train --metrics FILE wrote")
    add("-o", "--output", metavar="FILE.png", help="the picture (default: METRICS with the suffix .png)")
    add("--title", help="the picture's title (default: the metrics file's name)")
    parser.set_defaults(run=run)


def run(args) -> int:
    output = args.output or str(Path(args.metrics).with_suffix(".png"))
    if Path(output).resolve() == Path(args.metrics).resolve():  # e.g. a metrics file named run.png
        raise curves.PlotError(f"{output} is the metrics file itself; give the picture another name with -o FILE.png")
    curves.metrics_png(args.metrics, output, args.title or Path(args.metrics).name)
    print(f"wrote {output}")
    return 0
