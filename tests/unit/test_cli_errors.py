"""The CLI's bad-input contract: exit status 2 and one line on stderr naming what was wrong."""

import os
import subprocess
import sys

import pytest

from freescale.local import descendants
from helpers.launch import QUICKSTART, REPO, freescale, torchrun


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["train", "--config", str(QUICKSTART), "--no.such=1"], "no.such"),
        (["train", "--config", str(QUICKSTART), "--train.steps=-4"], "train.steps: expected a value >= 1"),
        (["train", "--config", str(QUICKSTART), "--train.lr", "fast"], "train.lr: expected a number"),
        (["train", "--config", "configs/nope.yaml"], "config file not found: configs/nope.yaml"),
        (["train", "--config", str(QUICKSTART), "--data.source=ratings", "--data.ratings.path=missing.csv"],
         "data.ratings.path: file not found: missing.csv"),
        (["train", "--config", str(QUICKSTART), "--verbose"], "unrecognized argument '--verbose'"),
        (["train", "--config", str(QUICKSTART), "--faults=[{at_step: 3, kind: hold}]"],
         "faults[0].kind: hold holds a replica group at its vote: expected faults[0].during: vote, got step"),
        (["train", "--config", str(QUICKSTART), "--faults", "{at_step: 3}"], "faults: expected a list of sections"),
        (["verify", "--config", str(QUICKSTART), "--tolerance=-1"], "--tolerance: expected a number at least 0"),
        (["verify", "--config", str(QUICKSTART), "--tolerance=nan"], "--tolerance: expected a number at least 0"),
        (["verify", "--config", str(QUICKSTART), "--pipelines=sync"], "--pipelines: expected two pipelines as A,B"),
        (["verify", "--config", str(QUICKSTART), "--pipelines=sync,nope"], "--pipelines: unknown pipeline 'nope'"),
        (["verify", "--config", str(QUICKSTART), "--pipelines=base,base"], "--pipelines: base twice"),
        (["verify", "--config", str(QUICKSTART), "--pipelines=sync,base"],
         "verify compares two pipelines over the same kind of tables"),
        (["verify", "--config", str(QUICKSTART), "--ft.enable=true"],
         "ft.enable: freescale verify trains both runs on the same ranks, without the replica layer"),
        (["verify", "--config", str(QUICKSTART), "--set-b", "train.pipeline=base"],
         "train.pipeline: freescale verify trains the two pipelines of --pipelines"),
        (["verify", "--config", str(QUICKSTART), "--set-b", "run.device=cpu", "--run.device=auto"],
         "run.device: both runs share the job's"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, fragment):
    proc = freescale(*args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("freescale: error: ")
    assert fragment in lines[0]
    assert "Traceback" not in proc.stderr


def test_malformed_yaml_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  name: [unclosed\n")
    proc = freescale("train", "--config", str(bad), timeout=120)
    assert proc.returncode == 2
    assert f"{bad}: malformed YAML at line" in proc.stderr.strip()


def test_config_command_prints_resolved_config_and_keys():
    proc = freescale("config", "--config", str(QUICKSTART), "--train.steps=12", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "steps: 12" in proc.stdout
    keys = freescale("config", "--keys", timeout=120)
    assert keys.returncode == 0
    assert "data.synthetic.tail_alpha = 1.2" in keys.stdout
    assert "Pareto shape of the tail" in keys.stdout


def _bad_ratings(tmp_path):
    path = tmp_path / "ratings.csv"
    path.write_text("user,item,rating,timestamp\n1,10,4,100\n1,11,four,101\n2,10,3,102\n")
    return path


def test_malformed_ratings_file_fails_before_a_run_folder_exists(tmp_path):
    path, run_dir = _bad_ratings(tmp_path), tmp_path / "run"
    proc = freescale("train", "--config", str(QUICKSTART), "--data.source=ratings", f"--data.ratings.path={path}",
                     f"--run.dir={run_dir}", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"freescale: error: {path}:3: rating and timestamp must be numbers, got 'four', '101'"]
    assert not run_dir.exists()


def test_ml100k_that_cannot_be_downloaded_fails_in_one_line(tmp_path):
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    unreachable = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2",
                   "PIP_NO_CACHE_DIR": "1", "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": ""}
    proc = freescale("train", "--config", str(QUICKSTART), "--data.source=ml100k", f"--data.ratings.cache={cache}",
                     f"--run.dir={run_dir}", timeout=180, env=unreachable)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("freescale: error: data.source ml100k: could not download recbole==1.2.1 from PyPI"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists() and not (cache / "ml-100k.inter").exists()


def test_calibrate_on_a_malformed_ratings_file_exits_2(tmp_path):
    path = _bad_ratings(tmp_path)
    proc = freescale("calibrate", "--config", str(QUICKSTART), "--data.source=ratings", f"--data.ratings.path={path}",
                     "--out", str(tmp_path / "cost.json"), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"freescale: error: {path}:3: rating and timestamp must be numbers, got 'four', '101'"]


def test_malformed_cost_model_fails_before_a_run_folder_exists(tmp_path):
    path, run_dir = tmp_path / "cost.json", tmp_path / "run"
    path.write_text('{"a": 1e-6, "b": "steep"}')
    proc = freescale("train", "--config", str(QUICKSTART), "--balance.enable=true", f"--balance.cost_model={path}",
                     f"--run.dir={run_dir}", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert f"freescale: error: {path}: not a cost model" in proc.stderr
    assert not run_dir.exists()


def test_first_line_of_an_error():
    from freescale.errors import first_line

    assert first_line(RuntimeError("  gloo: connection reset\n  at pair.cc:537\n")) == "gloo: connection reset"
    assert first_line(TimeoutError()) == "TimeoutError"
    assert first_line("one\ntwo") == "one"


def test_a_side_feature_the_source_lacks_fails_before_a_run_folder_exists(tmp_path):
    proc = freescale("train", "--config", str(QUICKSTART), f"--run.out_dir={tmp_path}",
                     "--data.synthetic.item_features=true",
                     "--model.side_features=[{name: item:cluster}, {name: user:clusters}]", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["freescale: error: model.side_features[1].name: the source has no side "
                                                "feature user:clusters (it has: item:cluster)"]
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_model_with_side_features_in_one_line(tmp_path):
    """Serving feeds item and user ids only: a model that reads side features is not exported."""
    from freescale.config import load_config, write_config

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000003").mkdir(parents=True)
    (run / "checkpoints" / "step_00000003" / ".metadata").write_bytes(b"")
    write_config(load_config(QUICKSTART, ["--data.synthetic.item_features=true",
                                          "--model.side_features=[{name: item:cluster}]"]), str(run / "config.yaml"))
    proc = freescale("export", str(run), "--out", str(tmp_path / "out"), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"freescale: error: {run}: the model reads side features (item:cluster); "
                                                "serving does not feed them yet, so it cannot be exported"]
    assert not (tmp_path / "out").exists()


def test_a_corrupt_prepared_file_fails_before_a_run_folder_exists(tmp_path):
    # The last of the train split's files is damaged: the run stops before it writes anything,
    # not when its cursor first reaches that file.
    from helpers.prepared import write_synthetic_prepared

    data = write_synthetic_prepared(tmp_path / "data", QUICKSTART, [], n_train=120)
    last = sorted((tmp_path / "data" / "train").iterdir())[-1]
    last.write_bytes(last.read_bytes()[:-40])
    run_dir = tmp_path / "run"
    proc = freescale("train", "--config", str(QUICKSTART), "--data.source=parquet", f"--data.path={data}",
                     f"--run.dir={run_dir}", timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"freescale: error: {last}: not a readable Parquet file"), proc.stderr
    assert not run_dir.exists()


def _plain_env() -> dict:
    """The environment a user's shell has: no thread count set (torchrun prints a banner then)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.parametrize("args, fragment", [
    (["--config", str(QUICKSTART), "--train.stpes=10"], "unknown config key 'train.stpes' (did you mean 'train.steps'?)"),
    (["--config", "configs/nope.yaml"], "config file not found: configs/nope.yaml"),
])
def test_the_readme_train_command_with_a_typo_or_a_missing_config_says_so_in_one_line(args, fragment):
    proc = subprocess.run([sys.executable, "-m", "freescale", "train", "--nproc", "2", *args], cwd=REPO,
                          env=_plain_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and proc.stderr.strip().splitlines() == [f"freescale: error: {fragment}"], proc.stderr


def test_a_rank_that_finds_bad_data_under_nproc_ends_the_command_with_its_line_and_status(tmp_path):
    # The ranks read the ratings file; each says what is wrong with it, and the command exits 2
    # without torchrun's report of the failed rank (its traceback, the ChildFailedError block).
    path, run_dir = _bad_ratings(tmp_path), tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "freescale", "train", "--nproc", "2", "--config", str(QUICKSTART),
                           "--data.source=ratings", f"--data.ratings.path={path}", f"--run.dir={run_dir}"], cwd=REPO,
                          env=_plain_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2, proc.stderr
    assert set(lines) == {f"freescale: error: {path}:3: rating and timestamp must be numbers, got 'four', '101'"}, \
        proc.stderr


def test_a_config_error_is_said_by_rank_0_alone():
    # Every rank of a torchrun job finds a config error alike: rank 0 says it, the others exit
    # with the same status in silence.
    for rank, said in (("0", ["freescale: error: unknown config key 'train.stpes' (did you mean 'train.steps'?)"]),
                       ("1", [])):
        proc = freescale("train", "--config", str(QUICKSTART), "--train.stpes=10", env={"RANK": rank}, timeout=120)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == said, (rank, proc.stderr)


def test_under_plain_torchrun_a_config_error_is_said_once_not_per_rank():
    proc = torchrun(2, "train", "--config", str(QUICKSTART), "--train.stpes=10", timeout=300)
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if line.startswith("freescale: error: ")]
    assert said == ["freescale: error: unknown config key 'train.stpes' (did you mean 'train.steps'?)"], proc.stderr


def test_under_plain_torchrun_a_late_rank_0_still_says_the_config_error(tmp_path):
    import time

    from freescale import cli

    # Rank 0 starts 3 s after rank 1 (as on a busy machine): rank 1, which finds the error first,
    # waits to be stopped; exiting at once, it had torchrun stop rank 0 before rank 0 said
    # anything.
    (tmp_path / "sitecustomize.py").write_text("import os, time\nif os.environ.get('RANK') == '0':\n"
                                               "    time.sleep(3)\n")
    env = {**_plain_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "freescale", "train", "--config", str(QUICKSTART), "--train.stpes=10"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    # Rank 1 was stopped by torchrun once rank 0 exited, not at the end of its wait.
    assert time.monotonic() - started < cli._SAID_WAIT_S
    said = [line for line in proc.stderr.splitlines() if line.startswith("freescale: error: ")]
    assert said == ["freescale: error: unknown config key 'train.stpes' (did you mean 'train.steps'?)"], proc.stderr


def test_a_sigterm_to_freescale_train_nproc_stops_its_ranks_and_says_so_in_one_line(tmp_path):
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "freescale", "train", "--nproc", "2", "--config", str(QUICKSTART),
                             f"--run.dir={run_dir}", "--run.log_every=1"], cwd=REPO, env=_plain_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:  # (the ranks train)
            time.sleep(0.2)
        assert (run_dir / "metrics.jsonl").exists()
        # On CPU the ranks are forked from the launcher: each has its command line, where a rank
        # started afresh would run the command without --nproc.
        ranks = descendants(proc.pid)
        assert len(ranks) == 2 and all(_cmdline(pid) == _cmdline(proc.pid) for pid in ranks), \
            [_cmdline(pid) for pid in [proc.pid, *ranks]]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert err.strip().splitlines()[-1] == "freescale: stopped by SIGTERM, and the ranks with it", err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    left = subprocess.run(["pgrep", "-f", f"--run.dir={run_dir}"], capture_output=True, text=True).stdout.split()
    assert left == [], left  # no rank outlives the command


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().split("\0")


@pytest.mark.parametrize("device, cuda_built, forks", [
    ("cpu", True, True), ("auto", False, True), ("auto", True, False), ("cuda", True, False), ("cuda", False, False)])
def test_nproc_forks_the_ranks_only_where_no_rank_can_use_cuda(monkeypatch, device, cuda_built, forks):
    import torch

    from freescale import cli
    from freescale.config import load_config

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: cuda_built)
    assert cli.forks_ranks(load_config(str(QUICKSTART), [f"--run.device={device}"])) is forks


def test_a_forked_rank_puts_back_the_signal_handlers_and_logger_levels_it_inherited(tmp_path):
    # As the launcher's agent leaves them: SIGTERM and its kin raise an exception, torch.distributed's
    # loggers are quiet. The rank runs its command (here `config`) with the defaults and the levels back.
    code = ("import logging, signal, sys\n"
            "from freescale import cli\n"
            "SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)\n"
            "def agent(signum, frame):\n"
            "    raise RuntimeError(signum)\n"
            "for sig in SIGNALS:\n"
            "    signal.signal(sig, agent)\n"
            "logging.getLogger('torch.distributed.elastic').setLevel(logging.CRITICAL)\n"
            "cli._forked_rank(['config', '--config', sys.argv[1], '--train.steps=7'], {'torch.distributed.elastic': 30})\n"
            "print([signal.getsignal(sig) is signal.SIG_DFL for sig in SIGNALS],"
            " logging.getLogger('torch.distributed.elastic').level)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(QUICKSTART)], cwd=REPO, env=_plain_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "steps: 7" in proc.stdout  # (the command ran)
    assert proc.stdout.strip().splitlines()[-1] == "[True, True, True, True] 30", proc.stdout[-500:]


def test_a_forked_rank_that_raises_prints_its_traceback_and_exits_1(tmp_path):
    # Under torch.multiprocessing's wrapper, as torchrun's agent runs a forked rank: the wrapper
    # would keep an escaping exception's traceback in its error file, unprinted; the rank prints it.
    code = ("import sys\n"
            "from torch.multiprocessing.spawn import _wrap\n"
            "from freescale import cli\n"
            "def main(argv):\n"
            "    raise RuntimeError('the rank broke')\n"
            "cli.main = main\n"
            "_wrap(lambda i, argv, levels: cli._forked_rank(argv, levels), 0, (['train'], {}), sys.argv[1])\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "error")], cwd=REPO, env=_plain_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" in proc.stderr and "RuntimeError: the rank broke" in proc.stderr, proc.stderr


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "fresh"])
@pytest.mark.parametrize("failures, status, said", [
    # Rank 1 found the bad data and exited 2; torchrun then stopped rank 0 with SIGTERM before
    # rank 0 exited with its own 2. The command exits with the status a rank gave, in silence.
    ({0: -15, 1: 2}, 2, ""),
    ({0: 2, 1: -15}, 2, ""),
    # No rank exited with a status: the lowest rank's signal is named.
    ({0: -9, 1: -15}, 1, "freescale: error: rank 0 ended by signal 9 (pid 100)\n"),
])
def test_launch_exits_with_the_status_a_rank_gave_even_when_a_stopped_rank_sorts_first(
        monkeypatch, capsys, failures, status, said, fork):
    # Both ways of starting the ranks: forked (torchrun's agent with a function entrypoint) and
    # fresh processes (torchrun's own run).
    import torch.distributed.launcher.api
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from freescale import cli
    from freescale.config import load_config

    called = []

    def failed(how):
        called.append(how)
        raise ChildFailedError("freescale", {rank: ProcessFailure(rank, 100 + rank, code, "<none>")
                                             for rank, code in failures.items()})

    monkeypatch.setattr(torch.distributed.launcher.api, "elastic_launch",
                        lambda config, entrypoint: lambda *args: failed("forked"))
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: failed("fresh"))
    monkeypatch.setattr(cli, "forks_ranks", lambda cfg: fork)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(SystemExit) as stop:
        cli._launch(2, ["train", "--nproc", "2", "--config", str(QUICKSTART)], load_config(str(QUICKSTART), []))
    assert called == ["forked" if fork else "fresh"]
    assert stop.value.code == status
    assert capsys.readouterr().err == said
