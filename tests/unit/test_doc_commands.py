"""The commands the README and docs/ show run as written from a fresh clone after the README's
set-up: each names an executable that set-up leaves (``.venv/bin/...``, a script of the
repository) rather than one only an activated venv has, and each ``freescale`` subcommand,
option and config override it passes is one the program accepts (its argument parser and
config tree, read here), as each script's options are the ones its parser declares.

What is checked: lines of ``bash`` blocks, and lines of any block shown with a ``$ `` prompt
(other blocks are synopses and output), but for a command shown failing on purpose (the line
after it is ``freescale: error: ...``). Continuation lines (ending ``\\``) are joined and
``&&`` chains split."""

import argparse
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from freescale.cli import _parser
from freescale.config import ExperimentConfig, TOP_LEVEL_KEYS, describe

ROOT = Path(__file__).resolve().parents[2]
VENV_EXECUTABLES = {"python", "freescale", "torchrun", "tensorboard", "torchx", "pip"}
"""What ``scripts/setup.sh`` leaves under ``.venv/bin`` that the docs run."""


def doc_commands(root: Path = ROOT) -> list[tuple[str, str]]:
    """(where, command) of every command the README and docs/ show, as written."""
    found = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        block, pending, start = None, "", 0
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("```"):
                block = line[3:].strip() if block is None else None
                pending = ""
                continue
            if block is None:
                continue
            text = line.strip()
            if text.startswith("freescale: error:") and found and found[-1][0] == f"{path.relative_to(root)}:{start}":
                found.pop()  # (the command before it is shown failing on purpose)
                continue
            prompted = text.startswith("$ ")
            if not pending:
                if prompted:
                    text = text[2:]
                elif block not in ("bash", "sh"):
                    continue
                start = number
            if pending or not text.startswith("#"):
                pending += " " + text
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            if pending.strip():
                for command in re.split(r"\s&&\s|;\s", re.sub(r"\s+", " ", pending.strip())):
                    found.append((f"{path.relative_to(root)}:{start}", command.strip()))
            pending = ""
    return found


def _words(command: str) -> list[str]:
    words = shlex.split(command, comments=True)
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value before the command
        words = words[1:]
    return words


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


CONFIG_KEYS = {key for key, _, _ in describe(ExperimentConfig())}


def _check_freescale(words: list[str]) -> str:
    """Why ``freescale WORDS`` would not run as written ("" if it would)."""
    subs = _subparsers()
    if not words or words[0] not in subs:
        return f"no subcommand {words[0] if words else '(none)'!r} (freescale has {', '.join(sorted(subs))})"
    options = _options(subs[words[0]])
    for word in words[1:]:
        if word == "--":
            break
        if not word.startswith("--"):
            continue
        name = word.split("=", 1)[0]
        if name in options:
            continue
        key = name[2:]
        if "." in key or key in TOP_LEVEL_KEYS:
            if key not in CONFIG_KEYS and key not in TOP_LEVEL_KEYS and not key.startswith("synthetic."):
                return f"no config key {key!r}"
            continue
        return f"freescale {words[0]} has no option {name}"
    return ""


def _script_options(script: Path) -> set[str]:
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", script.read_text(encoding="utf-8")))


def why_not(command: str, root: Path = ROOT) -> str:
    """Why ``command`` would not run as written after the README's set-up ("" if it would)."""
    words = _words(command)
    if not words:
        return ""
    exe, args = words[0], words[1:]
    if exe in VENV_EXECUTABLES or exe in ("python3", "pytest"):
        return f"{exe} runs only in an activated venv: write .venv/bin/{'python' if exe == 'python3' else exe}"
    if exe.startswith(".venv/bin/"):
        name = exe[len(".venv/bin/"):]
        if name not in VENV_EXECUTABLES:
            return f"{exe}: scripts/setup.sh installs no {name}"
        if name == "freescale":
            return _check_freescale(args)
        if name == "torchrun":
            if "-m" in args and args[args.index("-m") + 1:args.index("-m") + 2] == ["freescale"]:
                return _check_freescale(args[args.index("-m") + 2:])
            return ""
        if name == "python":
            if args[:2] == ["-m", "freescale"]:
                return _check_freescale(args[2:])
            if args[:1] == ["-m"] and len(args) > 1:
                return "" if importlib.util.find_spec(args[1]) else f"no module {args[1]}"
            if args and args[0].endswith(".py"):
                script = root / args[0]
                if not script.exists():
                    return f"no script {args[0]}"
                unknown = [w.split("=", 1)[0] for w in args[1:] if w.startswith("--")
                           and w.split("=", 1)[0] not in _script_options(script)]
                return f"{args[0]} has no option {unknown[0]}" if unknown else ""
        return ""
    if exe.startswith(("./scripts/", "scripts/")) or exe.startswith("freescale/"):
        return "" if (root / exe.removeprefix("./").split(":")[0]).exists() else f"no file {exe}"
    return ""


@pytest.mark.parametrize("where, command", doc_commands(), ids=lambda v: v if ":" in str(v)[:40] else "")
def test_every_command_in_the_docs_runs_as_written(where, command):
    assert why_not(command) == "", f"{where}: {command}"


def test_the_check_says_no_to_what_would_not_run():
    assert "activated venv" in why_not("freescale train --config configs/quickstart.yaml")
    assert "activated venv" in why_not("python -m freescale.data.ml100k")
    assert why_not(".venv/bin/freescale trian --config x.yaml").startswith("no subcommand 'trian'")
    assert why_not(".venv/bin/freescale train --config x.yaml --nprocs 2") == "freescale train has no option --nprocs"
    assert why_not(".venv/bin/freescale train --config x.yaml --train.stpes=3") == "no config key 'train.stpes'"
    assert why_not(".venv/bin/python -m freescale local --config x --replicas 2 --nproc 1 --kil 1@5") == \
        "freescale local has no option --kil"
    assert why_not(".venv/bin/python scripts/bench_balance.py --quick") == "scripts/bench_balance.py has no option --quick"
    assert why_not(".venv/bin/python scripts/bench_nothing.py") == "no script scripts/bench_nothing.py"
    assert why_not(".venv/bin/python -m freescale.nothing_here") == "no module freescale.nothing_here"
    assert why_not("./scripts/nothing.sh 3") == "no file ./scripts/nothing.sh"
    # and yes to what would
    assert why_not(".venv/bin/freescale train --nproc 2 --config configs/quickstart.yaml --train.steps=3") == ""
    assert why_not("OMP_NUM_THREADS=1 .venv/bin/python -m freescale config --keys") == ""
    assert why_not(".venv/bin/python scripts/bench_balance.py --skip-training") == ""


def test_the_extraction_reads_bash_blocks_and_prompted_lines_and_joins_continuations(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "```bash\n# a comment\n./scripts/setup.sh && .venv/bin/freescale train \\\n    --config a.yaml\n```\n"
        "```\nfreescale train --config PATH      a synopsis\n$ .venv/bin/freescale report runs/x\nits output\n"
        "$ .venv/bin/freescale train --config nope.yaml\nfreescale: error: config file not found: nope.yaml\n```\n")
    assert doc_commands(tmp_path) == [("README.md:3", "./scripts/setup.sh"),
                                      ("README.md:3", ".venv/bin/freescale train --config a.yaml"),
                                      ("README.md:8", ".venv/bin/freescale report runs/x")]
