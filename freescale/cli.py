"""``freescale`` command line: each subcommand loads the config and calls one library function.

    freescale train  --config PATH [--section.key=value ...]
    freescale config [--config PATH] [--section.key=value ...]   print the resolved config

Bad input (unknown key, wrong type, out-of-range value, missing file, malformed YAML) exits
with status 2 and one line on stderr naming what was wrong.
"""

from __future__ import annotations

import argparse
import sys

from freescale.config import ConfigError, describe, dump_yaml, load_config

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freescale", description="Distributed trainer for sequence recommendation models.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (standalone or under torchrun)",
                           epilog="Any config key can be overridden as --section.key=value; see `freescale config --keys`.")
    train.add_argument("--config", required=True, help="experiment YAML file")
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


def main(argv: list[str] | None = None) -> None:
    args, extra = _parser().parse_known_args(argv)
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
