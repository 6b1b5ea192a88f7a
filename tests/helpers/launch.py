"""Launching FreeScale the way users do: the CLI standalone or under torchrun, as real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"

# Small, fast settings on top of the quickstart config for multi-process tests.
FAST = [
    "--data.batch_size=16",
    "--data.max_uih_len=64",
    "--data.eval_samples=128",
    "--data.synthetic.tail_min_len=32",
    "--model.num_layers=1",
    "--run.log_every=1",
    "--train.eval_every=0",
    "--checkpoint.every=0",
]


MODEL_UNDER_TEST = os.environ.get("FREESCALE_TEST_MODEL", "")
"""``hstu``: every run these helpers launch trains HSTU (``--model.kind=hstu``) instead of the
configs' model, e.g. ``FREESCALE_TEST_MODEL=hstu scripts/stress_ft.sh 1`` for the replica layer."""
COMMANDS_WITH_A_MODEL = {"train", "local", "verify", "calibrate"}


def _model_args(args: tuple[str, ...]) -> tuple[str, ...]:
    if MODEL_UNDER_TEST and args and args[0] in COMMANDS_WITH_A_MODEL:
        if MODEL_UNDER_TEST != "hstu":
            raise ValueError(f"FREESCALE_TEST_MODEL: expected hstu, got {MODEL_UNDER_TEST!r}")
        return (*args, "--model.kind=hstu")
    return args


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def freescale(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``freescale ARGS`` in one process (``env``: variables added to the environment)."""
    return subprocess.run([sys.executable, "-m", "freescale", *_model_args(args)], cwd=REPO, env={**_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def start_freescale(*args: str) -> subprocess.Popen:
    """``freescale ARGS`` started in the background, its output discarded."""
    return subprocess.Popen([sys.executable, "-m", "freescale", *_model_args(args)], cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def freescale_without_torch(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``freescale ARGS`` in a process where torch cannot be imported: what a command can say
    before it needs torch (bad arguments, files) is said the same there."""
    code = ("import importlib.abc, sys\n"
            "class Blocked(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'torch':\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Blocked())\n"
            "from freescale.cli import main\n"
            f"main({list(args)!r})\n")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def ranks(nproc: int, command: str, *args: str, timeout: float = 300,
          cpus: set[int] | None = None) -> subprocess.CompletedProcess:
    """``freescale COMMAND --nproc N ARGS``: N ranks on this host, as a user starts them (on CPU,
    forked from the launcher once it has imported the trainer). ``cpus``: the cores it and its
    ranks run on."""
    return _ranks([sys.executable, "-m", "freescale", *_model_args((command, f"--nproc={nproc}", *args))], timeout, cpus)


def torchrun(nproc: int, *args: str, timeout: float = 300, cpus: set[int] | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=N -m freescale ARGS``: each rank a fresh process,
    as on a cluster (``cpus``: the cores it and its ranks run on)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "freescale", *_model_args(args)]
    return _ranks(cmd, timeout, cpus)


def _ranks(cmd: list[str], timeout: float, cpus: set[int] | None) -> subprocess.CompletedProcess:
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout, preexec_fn=pin)


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in metrics(run_dir) if "train/loss" in r}
