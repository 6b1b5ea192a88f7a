"""The TorchX component's app (``freescale/torchx.py:replica_groups``) and the lighthouse that ends
with its run: each group's command against what ``freescale local`` runs, written out here;
bad input as one line; the lighthouse's exit once every group has finished."""

import os
import shlex
import subprocess
import sys
import time

import pytest
import torchx.specs as specs

from freescale.config import ConfigError
from freescale.ft.lighthouse import RunWatch
from freescale.torchx import replica_groups
from helpers.launch import REPO

FT_LOCAL = str(REPO / "configs" / "ft_local.yaml")


def group_command(role: specs.Role) -> tuple[str, list[str]]:
    """(the lighthouse address the group's shell exports, the command it then runs)."""
    assert role.entrypoint == "bash" and role.args[0] == "-c"
    export, run = role.args[1].split("; exec ", 1)
    name, address = export.removeprefix("export ").split("=", 1)
    assert name == "TORCHFT_LIGHTHOUSE"
    return address, shlex.split(run)


def test_each_group_runs_what_freescale_local_runs_it_with():
    app = replica_groups("train.steps=50", "--checkpoint.every=0", config=FT_LOCAL, replicas=3, nproc=2,
                         run_dir="/runs/x", lighthouse_port=29700, max_restarts=4, max_retries=2)
    assert [r.name for r in app.roles] == ["lighthouse", "replica0", "replica1", "replica2"]
    lighthouse = app.roles[0]
    assert [lighthouse.entrypoint, *lighthouse.args] == [
        "python", "-m", "freescale", "lighthouse", "--bind", "127.0.0.1:29700", "--min-replicas", "1",
        "--until-done", "/runs/x", "--replicas", "3"]
    for r, role in enumerate(app.roles[1:]):
        address, command = group_command(role)
        assert address == "http://127.0.0.1:29700"
        assert command == ["torchrun", "--standalone", "--nproc_per_node=2", "--max_restarts=4", "-m", "freescale",
                           "train", "--config", FT_LOCAL, "--train.steps=50", "--checkpoint.every=0", "--ft.enable=true",
                           "--ft.num_replicas=3", f"--ft.replica_id={r}", f"--run.dir=/runs/x/replica{r}"]
        assert role.env["OMP_NUM_THREADS"] == "1" and role.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        assert role.num_replicas == 1 and role.max_retries == 2 and role.retry_policy == specs.RetryPolicy.REPLICA
    assert lighthouse.max_retries == 2
    assert len({id(role.env) for role in app.roles}) == len(app.roles)  # a scheduler adds to each its own


def test_on_a_cluster_the_groups_dial_the_host_the_scheduler_gave_the_lighthouse():
    app = replica_groups(config=FT_LOCAL, replicas=2, lighthouse_host="role0", lighthouse_bind="0.0.0.0")
    assert app.roles[0].args[4] == "0.0.0.0:29510"
    for scheduler_variable in ("SLURM_JOB_NODELIST_HET_GROUP_0", "VC_LIGHTHOUSE_0_HOSTS"):
        role = specs.macros.Values(img_root="", app_id="app", replica_id="0",
                                   rank0_env=scheduler_variable).apply(app.roles[1])
        address, _ = group_command(role)
        assert address == f"http://${{{scheduler_variable}:-127.0.0.1}}:29510"
        shell = subprocess.run(["bash", "-c", role.args[1].split(";")[0] + "; echo $TORCHFT_LIGHTHOUSE"],
                               env={scheduler_variable: "node7"}, capture_output=True, text=True)
        assert shell.stdout.strip() == "http://node7:29510"
    # The default run folder is the app's own, the same for every role.
    run = app.roles[0].args[app.roles[0].args.index("--until-done") + 1]
    assert run == "runs/ft_local-${app_id}" and f"--run.dir={run}/replica1" in group_command(app.roles[2])[1]


@pytest.mark.parametrize("kwargs, overrides, message", [
    ({"replicas": 0}, (), "--replicas: expected a value >= 1, got 0"),
    ({"max_restarts": -1}, (), "--max_restarts: expected a value >= 0"),
    ({"lighthouse_port": 70000}, (), "--lighthouse_port: expected a port in 1..65535"),
    ({"lighthouse_host": "role0"}, (), "the lighthouse binds 127.0.0.1, which only this host reaches"),
    ({}, ("ft.replica_id=1",), "ft.replica_id is set by the component"),
    ({}, ("train.stepz=3",), "train.stepz"),
    ({"replicas": 2}, ("ft.min_replicas=3",), "ft.min_replicas: expected <= ft.num_replicas (2)"),
])
def test_bad_input_fails_before_anything_is_submitted(kwargs, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        replica_groups(*overrides, config=FT_LOCAL, **kwargs)


def write_summary(run, replica):
    folder = run / f"replica{replica}"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "summary.json.tmp"
    tmp.write_text("{}")
    os.replace(tmp, folder / "summary.json")  # as the trainer writes it: a new file


def test_the_run_is_finished_when_every_group_wrote_its_summary_since_the_watch_began(tmp_path):
    write_summary(tmp_path, 1)  # left by an earlier launch in this folder
    watch = RunWatch(str(tmp_path), 2)
    assert not watch.finished()
    write_summary(tmp_path, 0)
    assert not watch.finished()  # replica 1's summary is the old one
    write_summary(tmp_path, 1)
    assert watch.finished()


def test_the_lighthouse_exits_once_the_run_is_done(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "RUST_LOG": "warn"}
    lighthouse = subprocess.Popen([sys.executable, "-m", "freescale", "lighthouse", "--bind", "127.0.0.1:0",
                                   "--until-done", str(tmp_path), "--replicas", "2"], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "lighthouse at" in lighthouse.stdout.readline()  # serving
        write_summary(tmp_path, 0)
        time.sleep(1.5)  # more than one look (every second): one group done is not the run
        assert lighthouse.poll() is None
        write_summary(tmp_path, 1)
        assert lighthouse.wait(timeout=60) == 0
        assert "every replica group" in lighthouse.stdout.read()
    finally:
        lighthouse.kill()
        lighthouse.wait()


def test_until_done_needs_the_number_of_groups(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "freescale", "lighthouse", "--until-done", str(tmp_path)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "--until-done RUN_DIR and --replicas R go together" in proc.stderr
