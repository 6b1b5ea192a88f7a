"""``freescale`` command line: each subcommand loads the config and calls one library function.

    freescale train  --config PATH [--section.key=value ...]
    freescale report RUN_DIR [RUN_DIR_B]                          bubble report (or B against A)
    freescale config [--config PATH] [--section.key=value ...]   print the resolved config

Bad input (unknown key, wrong type, out-of-range value, missing file, malformed YAML) exits
with status 2 and one line on stderr naming what was wrong.
"""

from __future__ import annotations

import argparse
import os
import sys

from freescale.config import ConfigError, describe, dump_yaml, load_config

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freescale", description="Distributed trainer for sequence recommendation models.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (standalone or under torchrun)",
                           epilog="Any config key can be overridden as --section.key=value; see `freescale config --keys`.")
    train.add_argument("--config", required=True, help="experiment YAML file")
    report = sub.add_parser("report", help="bubble report of a run folder, or two side by side (B against A)")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="one run folder, or two to compare")
    report.add_argument("--out", help="output folder (default: RUN/report, or RUN_B/report/compare-<A>)")
    report.add_argument("--warmup-steps", type=int, help="steps left out of the means (default: the run's profile.warmup_steps)")
    report.add_argument("--gantt-steps", type=int, default=6, help="steps shown in the Gantt chart")
    show = sub.add_parser("config", help="print the resolved config (or every key with its docs)")
    show.add_argument("--config", help="experiment YAML file")
    show.add_argument("--keys", action="store_true", help="list every key with its default and description")
    return parser


def _split_overrides(extra: list[str]) -> list[str]:
    """``--a.b=1`` and ``--a.b 1`` forms; anything else is a usage error."""
    overrides = []
    i = 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unrecognized argument '{arg}' (config overrides look like --section.key=value)")
        if "=" not in arg:
            if i + 1 >= len(extra):
                raise ConfigError(f"override '{arg}': expected a value (--section.key=value)")
            arg = f"{arg}={extra[i + 1]}"
            i += 1
        overrides.append(arg)
        i += 1
    return overrides


def _fail(message: str) -> None:
    print(f"freescale: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def _report(args) -> None:
    from freescale.profile.report import write_comparison, write_report

    if len(args.runs) > 2:
        _fail(f"report takes one run folder or two to compare, got {len(args.runs)}")
    for run in args.runs:
        if not os.path.isdir(run):
            _fail(f"run folder not found: {run}")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        _fail(f"--warmup-steps: expected a value >= 0, got {args.warmup_steps}")
    try:
        if len(args.runs) == 1:
            path = write_report(args.runs[0], warmup_steps=args.warmup_steps, gantt_steps=args.gantt_steps, out_dir=args.out)
        else:
            path = write_comparison(args.runs[0], args.runs[1], out_dir=args.out, warmup_steps=args.warmup_steps)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    args, extra = _parser().parse_known_args(argv)
    if args.command == "report":
        if extra:
            _fail(f"unrecognized argument '{extra[0]}'")
        _report(args)
        return
    try:
        cfg = load_config(args.config, _split_overrides(extra))
    except ConfigError as e:
        _fail(str(e))

    if args.command == "config":
        if args.keys:
            for key, value, doc in describe(cfg):
                print(f"{key} = {value!r}\n    {doc}")
        else:
            print(dump_yaml(cfg), end="")
        return

    from freescale.data.readers import DataError
    from freescale.train.checkpoint import CheckpointError
    from freescale.train.trainer import train

    try:
        train(cfg)
    except (DataError, CheckpointError) as e:
        _fail(str(e))


if __name__ == "__main__":
    main()
