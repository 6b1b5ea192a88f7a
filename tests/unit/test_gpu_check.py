"""The GPU check's script on CPU (``scripts/gpu_check.sh``): the dry run of each tier names its
steps and finds what they run, and fails naming what is missing; the torch tier imports only
what a stock CUDA torch has (its test files are read for their imports, and its rehearsal runs
with TorchRec, fbgemm-gpu and torchft unimportable); the wheels it needs are listed with the
command that downloads them; the full tier's rehearsal runs every step."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
TORCH_TIER_TESTS = sorted((ROOT / "tests" / "gpu").glob("test_torch_*.py"))
TEST_HELPERS = [ROOT / "tests" / "helpers" / name for name in ("spawn.py", "cuda.py", "syncs.py")]

# What the torch tier may import: a CUDA build of torch has these, or they are small wheels
# (scripts/requirements-gpu-torch.txt), or they are FreeScale's torch-only modules.
THIRD_PARTY = {"torch", "numpy", "pytest"}
FREESCALE = ("freescale.device", "freescale.transport", "freescale.transport.base", "freescale.transport.torch_dist",
             "freescale.transport.host_staged", "freescale.transport.registry", "freescale.profile.timeline",
             "freescale.model.seqrec", "freescale.model.jagged_attention", "freescale.distributed",
             "freescale.config", "freescale.errors", "freescale.env", "freescale.ft.catchup", "freescale.data.features")
HELPERS = {"helpers.spawn", "helpers.cuda", "helpers.syncs"}
HEAVY = ("torchrec", "fbgemm_gpu", "torchft")


def _run(*args, env=None, timeout=120):
    return subprocess.run([str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module)
    return names


def _allowed(name: str) -> bool:
    top = name.split(".")[0]
    if top in sys.stdlib_module_names or top in THIRD_PARTY or name in HELPERS:
        return True
    return name == "freescale.transport.host_staged" or name.startswith("freescale.transport.host_staged.") \
        or name in FREESCALE


def _blocking(tmp_path: Path) -> dict:
    """An environment in which TorchRec, fbgemm-gpu and torchft cannot be imported (as on a
    machine with a stock CUDA torch): a ``sitecustomize`` that refuses them."""
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        f"BLOCKED = {set(HEAVY)!r}\n"
        "class _Blocked(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (not on this machine)', name=name)\n"
        "sys.meta_path.insert(0, _Blocked())\n")
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_the_dry_run_names_each_tiers_steps_and_finds_what_they_run():
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    torch_part, full_part = proc.stdout.split("\ntier full: needs")
    for step in ("tests", "copies"):
        assert f"[{step}, at most" in torch_part
    for step in ("tests", "copies", "verify", "bubbles"):
        assert f"[{step}, at most" in full_part
    assert "no TorchRec, fbgemm-gpu or torchft" in torch_part and "scripts/setup.sh" in full_part
    assert "-m gpu" not in torch_part  # the torch tier names its files: nothing else is imported
    counts = {t: int(proc.stdout.split(f"tier {t}: pytest collects ")[1].split()[0]) for t in ("torch", "full")}
    assert counts["torch"] >= 30 and counts["full"] > counts["torch"]  # the full tier runs the torch tier's too
    one = _run("--dry-run", "--tier", "torch")
    assert one.returncode == 0 and "tier full" not in one.stdout


def test_the_dry_run_fails_naming_what_is_missing(tmp_path):
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "gpu_check.sh"
    script.write_text(SCRIPT.read_text())
    script.chmod(0o755)
    proc = subprocess.run([str(script), "--dry-run"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": "/nonexistent/python"})
    assert proc.returncode == 1
    for tier, missing in (("torch", "tests/gpu/test_torch_transport.py"), ("torch", "tests/helpers/cuda.py"),
                          ("torch", "scripts/requirements-gpu-torch.txt"), ("full", "tests/gpu/test_cuda.py"),
                          ("full", "scripts/bench_transport.py")):
        assert f"tier {tier}: missing {missing}" in proc.stderr


def test_bad_options_get_one_line_and_exit_2():
    for args, says in ((["--bogus"], "unknown option --bogus"), (["--tier", "gpu"], "unknown tier gpu"),
                       (["--tier"], "--tier needs a value"), (["a", "b"], "one OUT_DIR expected")):
        proc = _run(*args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, (args, proc.stderr)


def test_the_torch_tiers_files_import_only_torch_numpy_pytest_and_freescales_torch_only_modules():
    assert {p.name for p in TORCH_TIER_TESTS} >= {"test_torch_streams.py", "test_torch_copy_engine.py",
                                                  "test_torch_transport.py", "test_torch_timeline.py"}
    for path in [*TORCH_TIER_TESTS, *TEST_HELPERS, ROOT / "tests" / "conftest.py"]:
        extra = sorted(name for name in _imports(path) if not _allowed(name))
        assert extra == [], f"{path.relative_to(ROOT)} imports {extra}"


def test_the_freescale_modules_the_torch_tier_uses_import_without_torchrec_fbgemm_or_torchft(tmp_path):
    used = sorted({name for path in TORCH_TIER_TESTS for name in _imports(path) if name.startswith("freescale")}
                  | {"freescale.transport.sm_contention", "freescale.io"})  # what bench_transport.py --gpu-only runs
    code = "import importlib, sys\n" \
           f"for name in {used!r}:\n" \
           "    importlib.import_module(name)\n" \
           f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {set(HEAVY)!r})\n" \
           "assert not heavy, heavy\n"
    env = {**os.environ, **_blocking(tmp_path)}
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}{os.pathsep}{ROOT}"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_torch_tier_rehearsed_on_cpu_runs_its_steps_without_torchrec_fbgemm_or_torchft(tmp_path):
    out = tmp_path / "out"
    proc = _run("--tier", "torch", str(out), env={"GPU_CHECK_DEVICE": "cpu", **_blocking(tmp_path)}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["tier"] == "torch" and result["passed"] and list(result["steps"]) == ["tests", "copies"]
    assert "skipped" in result["steps"]["tests"]["summary"] and "error" not in result["steps"]["tests"]["summary"]
    assert json.loads((out / "bench_transport_gpu.json").read_text())["gpu"] is None  # no GPU here: said, not faked
    # The full tier says in one line what it lacks here, before running anything.
    full = _run("--tier", "full", str(tmp_path / "full"), env={"GPU_CHECK_DEVICE": "cpu", **_blocking(tmp_path)})
    assert full.returncode == 2  # the log (stdout) and gpu_check.log say why
    assert "the full tier cannot run here: missing fbgemm_gpu, torchrec, torchft" in full.stdout


def test_the_wheels_the_torch_tier_needs_are_listed_with_the_command_that_downloads_them():
    proc = _run("--wheels")
    assert proc.returncode == 0, proc.stderr
    requirements = (ROOT / "scripts" / "requirements-gpu-torch.txt").read_text()
    wanted = [line for line in requirements.splitlines() if line and not line.startswith("#")]
    assert {w.split(">=")[0] for w in wanted} == {"numpy", "pyyaml", "pytest", "pytest-timeout"}
    assert all(w in proc.stdout for w in wanted)
    download = proc.stdout.split("pip download", 1)[1].split("-r ", 1)[0]
    for flag in ("--only-binary=:all:", "--python-version 3.12", "--abi cp312", "--platform manylinux2014_x86_64"):
        assert flag in download
    assert "--no-index --find-links" in proc.stdout


@pytest.mark.slow
def test_the_full_tier_rehearsed_on_cpu_runs_every_step_and_writes_its_figures(tmp_path):
    proc = _run("--tier", "full", str(tmp_path), env={"GPU_CHECK_DEVICE": "cpu"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["tier"] == "full"
    assert result["passed"] and list(result["steps"]) == ["tests", "copies", "verify", "bubbles"]
    assert "skipped" in result["steps"]["tests"]["summary"]  # no GPU here: every gpu test skips
    assert result["steps"]["verify"]["bitwise"] is True  # on CPU the pipelines agree bit for bit
    assert result["steps"]["bubbles"]["summary"]["compute_from"] == "main-thread CPU"
    assert (tmp_path / "gpu_check.log").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_transport_gpu.json", "bubble_report.json",
                                                         "gpu_check.json", "gpu_check.log"]
