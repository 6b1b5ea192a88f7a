"""The replica layer's pure parts: kill plans, stall measure, the state handed to a group that
catches up, cursor files, faults under the layer, data shards, config checks, the lighthouse."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from freescale.config import ConfigError, SyntheticDataConfig, declared_faults, load_config
from freescale.data.loader import BatchLoader
from freescale.data.synthetic import SyntheticSource
from freescale.faults import FaultInjector, Faults, InjectedFault, NullFaults, build_faults
from freescale.ft.lighthouse import LighthouseOptions, start_lighthouse
from freescale.local import ALL, descendants, longest_gap, parse_kills
from freescale.ft.catchup import load_into, transfer_state
from freescale.ft.files import ReplicaFiles
from helpers.launch import REPO, freescale

FT_LOCAL = REPO / "configs" / "ft_local.yaml"


def test_kill_plans_parse_and_bad_ones_name_the_item():
    assert [(k.replica, k.step) for k in parse_kills("1@10, 0@30", replicas=2, steps=100)] == [(0, 30), (1, 10)]
    assert [(k.replica, k.step) for k in parse_kills("all@50", replicas=2, steps=100)] == [(ALL, 50)]
    assert parse_kills("", replicas=2, steps=100) == []
    for text, message in [("1-10", "expected REPLICA@STEP"), ("any@3", "expected REPLICA@STEP or all@STEP"),
                          ("2@10", "replica 2 does not exist"),
                          ("0@100", "expected a step in 1..99"), ("0@0", "expected a step in 1..99")]:
        with pytest.raises(ConfigError, match=message):
            parse_kills(text, replicas=2, steps=100)


def test_the_stall_is_the_longest_gap_that_overlaps_the_failure():
    times = [0.0, 1.0, 1.5, 4.0, 4.1, 9.0]
    assert longest_gap(times, start=1.2, end=4.05) == 2.5  # 1.5 -> 4.0
    assert longest_gap(times, start=4.2, end=5.0) == pytest.approx(4.9)  # 4.1 -> 9.0 spans the window
    assert longest_gap(times, start=20.0, end=30.0) == 0.0


def test_the_transferred_state_is_a_copy_the_live_state_cannot_change():
    live = torch.ones(4)
    state = {"model": {"w": live, "n": 3}, "trainer": {"step": torch.tensor(7)}}
    copy = transfer_state(state)
    live.add_(1.0)
    assert torch.equal(copy["model"]["w"], torch.ones(4)) and copy["model"]["n"] == 3
    assert int(copy["trainer"]["step"]) == 7


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


def test_sharded_states_are_sent_as_copies_of_their_local_shards_and_land_in_place(one_rank):
    from torch.distributed._shard.sharded_tensor import Shard as LocalShard
    from torch.distributed._shard.sharded_tensor import ShardMetadata, init_from_local_shards
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh("cpu", [0])
    dtensor = DTensor.from_local(torch.ones(4, 2), mesh, [Shard(0)])
    sharded = init_from_local_shards([LocalShard(torch.ones(3, 2), ShardMetadata([0, 0], [3, 2], "rank:0/cpu"))],
                                     [3, 2])
    copy = transfer_state({"tables": {"d": dtensor, "s": sharded}})
    assert isinstance(copy["tables"]["d"], torch.Tensor) and len(copy["tables"]["s"]) == 1
    dtensor.to_local().add_(1.0)  # the peer goes on training after the copy is taken
    sharded.local_shards()[0].tensor.add_(1.0)
    assert torch.equal(copy["tables"]["d"], torch.ones(4, 2)) and torch.equal(copy["tables"]["s"][0], torch.ones(3, 2))
    # Loaded into a live state, the values land in its own storage.
    live_d, live_s = dtensor.to_local(), sharded.local_shards()[0].tensor
    loaded = load_into({"d": dtensor, "s": sharded}, copy["tables"])
    assert loaded["d"] is dtensor and loaded["s"] is sharded
    assert torch.equal(live_d, torch.ones(4, 2)) and torch.equal(live_s, torch.ones(3, 2))
    with pytest.raises(ValueError, match="holds 2 local shard"):
        load_into(sharded, [torch.ones(3, 2), torch.ones(3, 2)])


def test_the_cursor_round_trips_and_a_bad_one_is_named(tmp_path):
    files = ReplicaFiles(str(tmp_path))
    assert files.read_cursor() is None
    files.write(step=5, next_batch=4, trained=True)
    files.write(step=6, next_batch=4, trained=False)
    assert files.read_cursor() == {"step": 6, "next_batch": 4}
    lines = [json.loads(line) for line in open(files.commits_path)]
    assert [(c["step"], c["trained"]) for c in lines] == [(5, True), (6, False)]
    with open(files.cursor_path, "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="ft_cursor.json: unreadable data cursor"):
        files.read_cursor()


def declared(*overrides: str) -> list:
    return [fault for _, fault in declared_faults(load_config(FT_LOCAL, list(overrides)))]


def test_faults_under_the_layer_pick_groups_and_fire_once(tmp_path):
    cfg = declared("fault.at_step=3", "fault.during=allreduce", "fault.replicas=[1]")
    assert isinstance(build_faults(cfg, rank=0, replica=0, run_dir=str(tmp_path)), NullFaults)
    faults = build_faults(cfg, rank=0, replica=1, run_dir=str(tmp_path))
    faults.at("step", 3)
    faults.at("allreduce", 2)
    with pytest.raises(RuntimeError, match="injected fault at step 3 during allreduce"):
        faults.at("allreduce", 3)
    build_faults(cfg, rank=0, replica=1, run_dir=str(tmp_path)).at("allreduce", 3)  # struck already: nothing
    recover = FaultInjector(5, "raise", rank=0, during="recover")
    recover.at("recover", 4)
    with pytest.raises(RuntimeError, match="during recover"):
        recover.at("recover", 9)  # the first catch-up at or after step 5
    delay = FaultInjector(2, "delay", rank=0, during="quorum", delay_s=0.2)
    started = time.monotonic()
    delay.at("quorum", 2)
    assert time.monotonic() - started >= 0.2


def test_several_faults_each_strike_their_groups_and_a_hold_lets_its_step_pass_once_every_group_is_in(tmp_path):
    # Group 1 fails in the all-reduce of step 150; group 0 holds at step 300; both vote against step 7.
    cfg = declared("fault.at_step=150", "fault.during=allreduce", "fault.replicas=[1]",
                   "faults=[{at_step: 300, during: vote, kind: hold, replicas: [0]}, {fail_commit_at: [7]}]")
    group0 = build_faults(cfg, rank=0, replica=0, run_dir=str(tmp_path / "replica0"))
    group1 = build_faults(cfg, rank=0, replica=1, run_dir=str(tmp_path / "replica1"))
    assert group0.fail_commit_at == group1.fail_commit_at == [7]
    group0.at("allreduce", 150)  # group 1's fault, not group 0's
    with pytest.raises(InjectedFault, match="at step 150 during allreduce"):
        group1.at("allreduce", 150)
    assert group1.hold(300, 1, 2) == ""  # group 0's hold, not group 1's
    group0.at("vote", 300)  # a hold strikes only at the vote's count of the groups
    assert group0.hold(299, 1, 2) == ""
    for _ in range(3):  # the step trained again is held again, as long as a group is missing
        assert group0.hold(300, 1, 2) == "injected hold at step 300 until every replica group is in it: 1 of 2 are"
    assert group0.hold(300, 2, 2) == ""  # every group in the step: it passes, for good
    assert group0.hold(300, 1, 2) == ""
    assert build_faults(cfg, rank=0, replica=0, run_dir=str(tmp_path / "replica0")).hold(300, 1, 2) == ""
    # Without the replica layer, every section's rank faults strike.
    both = build_faults(declared("fault.at_step=2", "faults=[{at_step: 4, kind: delay, delay_s: 0}]"), rank=0)
    both.before_step(4)
    with pytest.raises(InjectedFault, match="at step 2 on rank 0"):
        both.before_step(2)


def test_each_group_trains_its_own_shard_of_the_stream():
    source = SyntheticSource(SyntheticDataConfig(num_items=64), seed=0, split="train", min_uih_len=1,
                             max_uih_len=16, num_candidates=1)
    shards = [BatchLoader(source, batch_size=2, rank=0, world_size=1, user_hash_size=10, shard=s, shards=3)
              for s in range(3)]
    seen = []
    for loader in shards:
        it = loader.iter_samples()
        seen += [next(it)[0] for _ in range(4)]
        assert loader.next_batch == 4 and loader.position_after(loader.batch_at(3)) == 4
    assert sorted(seen) == list(range(12))


def test_config_checks_of_the_layer():
    for overrides, message in [(["ft.replica_id=2", "ft.num_replicas=2"], "ft.replica_id: expected < ft.num_replicas"),
                               (["ft.min_replicas=3", "ft.num_replicas=2"], "ft.min_replicas: expected <="),
                               (["train.pipeline=base"], "ft.enable: the replica layer votes on the steps of .* got base"),
                               (["ft.enable=false", "train.pipeline=pec", "embedding.sharding=table_wise"],
                                "embedding.sharding: TorchRec's PEC modules .* row-wise only, got table_wise"),
                               (["ft.enable=false", "fault.during=allreduce"], "fault.during: allreduce needs the replica layer"),
                               (["ft.enable=false", "fault.fail_commit_at=[3]"], "fault.fail_commit_at: needs the replica layer"),
                               (["fault.fail_commit_at=[0]"], "fault.fail_commit_at: expected steps >= 1"),
                               (["fault.kind=hold", "fault.during=quorum"],
                                r"fault.kind: hold holds a replica group at its vote: expected fault.during: vote, got quorum"),
                               (["ft.enable=false", "faults=[{at_step: 3, during: vote, kind: hold}]"],
                                r"faults\[0\].during: vote needs the replica layer"),
                               (["faults=[{}, {ranks: [-1]}]"], r"faults\[1\].ranks: expected rank numbers >= 0"),
                               (["faults=[{at_step: 3, kind: sleep}]"], r"faults\[0\].kind: expected one of raise, exit, delay, slow, hold"),
                               (["faults={at_step: 3}"], "faults: expected a list of sections"),
                               (["faults.at_step=3"], r"'faults' is a list: set it whole, --faults=\[...\]")]:
        with pytest.raises(ConfigError, match=message):
            load_config(FT_LOCAL, overrides)


def test_the_lighthouse_refuses_a_taken_port_in_one_line():
    first = start_lighthouse(LighthouseOptions(bind="127.0.0.1:0"))
    port = first.address().rsplit(":", 1)[1]
    try:
        with pytest.raises(ValueError, match=f"cannot start the lighthouse on 127.0.0.1:{port}: Address already in use"):
            start_lighthouse(LighthouseOptions(bind=f"127.0.0.1:{port}"))
    finally:
        first.shutdown()
    with pytest.raises(ValueError, match="--bind: expected HOST:PORT"):
        start_lighthouse(LighthouseOptions(bind="nowhere"))


def test_descendants_finds_the_whole_tree():
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", "import subprocess,sys,time; "
                               "p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(30)']); "
                               "print(p.pid, flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert child in descendants(parent.pid) and os.getpid() not in descendants(parent.pid)
    finally:
        for pid in (child, parent.pid):
            os.kill(pid, 9)
        parent.wait()


@pytest.mark.parametrize("args, message", [
    (["--kill", "3@5"], "--kill 3@5: replica 3 does not exist"),
    (["--kill", "1@5", "--train.pipeline=base"], "ft.enable: the replica layer votes on the steps of train.pipeline"),
    (["--restart-delay", "-1"], "--restart-delay: expected seconds >= 0"),
])
def test_local_refuses_bad_input_in_one_line(args, message):
    proc = freescale("local", "--config", str(FT_LOCAL), "--replicas", "2", "--nproc", "1", *args, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("freescale: error: "), proc.stderr
    assert message in lines[0]


def test_faults_strike_from_wrappers_around_torchfts_parts(tmp_path):
    from torch.distributed.distributed_c10d import AllreduceOptions
    from torchft.process_group import ProcessGroupDummy

    from freescale.ft.faults import (FaultyManager, FaultyProcessGroup, FaultyTransport, wrap_manager,
                                     wrap_process_group, wrap_transport)

    # Nothing declared: the parts themselves.
    parts = object()
    assert wrap_process_group(parts, NullFaults(), lambda: 1) is parts and wrap_transport(parts, NullFaults()) is parts
    assert wrap_manager(parts, NullFaults(), lambda: 1, 2) is parts

    # The step's all-reduce, through a process group that keeps wrapping after an abort.
    step = {"n": 2}
    pg = FaultyProcessGroup(ProcessGroupDummy(0, 1), FaultInjector(3, "raise", rank=0, during="allreduce"),
                            lambda: step["n"])
    pg.allreduce([torch.ones(2)], AllreduceOptions()).wait()
    step["n"] = 3
    with pytest.raises(InjectedFault, match="at step 3 during allreduce"):
        pg.allreduce([torch.ones(2)], AllreduceOptions())
    inner = pg.parent
    pg.abort()
    assert pg.parent is inner

    # Fetching a peer's state: the catch-up is the step after the peer's last.
    class Transport:
        def recv_checkpoint(self, src_rank, metadata, step, timeout):
            return {"step": step}

    transport = FaultyTransport(Transport(), FaultInjector(5, "raise", rank=1, during="recover"))
    assert transport.recv_checkpoint(0, "", 3, None) == {"step": 3}
    with pytest.raises(InjectedFault, match="at step 5 during recover on rank 1"):
        transport.recv_checkpoint(0, "", 4, None)

    # The quorum, and commit failures declared once per step.
    class Manager:
        def __init__(self):
            self.step, self.errors = 3, []

        def current_step(self):
            return self.step

        def start_quorum(self):
            pass

        def report_error(self, e):
            self.errors.append(str(e))

        def should_commit(self):
            return not self.errors

    manager = FaultyManager(Manager(), Faults([FaultInjector(4, "raise", rank=0, during="quorum")], fail_commit_at=[4]),
                            groups_in_step=lambda: 2, groups=2)
    with pytest.raises(InjectedFault, match="at step 4 during quorum"):
        manager.start_quorum()
    assert manager.should_commit() is False and manager.errors == ["injected commit failure at step 4"]
    manager.errors.clear()
    assert manager.should_commit() is True  # the step trained again commits
    assert manager.current_step() == 3  # everything else is the manager's

    # A hold: the group votes against its step, each time it trains it again, until every
    # group is in the step (a group that catches up in it counts).
    in_step = {"groups": 1}
    held = FaultyManager(Manager(), Faults([FaultInjector(4, "hold", rank=0, during="vote")]),
                         groups_in_step=lambda: in_step["groups"], groups=2)
    for _ in range(2):
        assert held.should_commit() is False
        assert held.errors == ["injected hold at step 4 until every replica group is in it: 1 of 2 are"]
        held.errors.clear()
    in_step["groups"] = 2
    assert held.should_commit() is True and held.errors == []


def test_the_launcher_and_its_lighthouse_start_without_torch():
    # freescale local and freescale lighthouse load neither torch nor torchft's package: the
    # lighthouse is torchft's Rust server alone, and the groups' files are read without torch.
    # Its imports took 2-3 s of CPU before every group started.
    code = ("import sys\n"
            "import freescale.cli, freescale.local\n"
            "from freescale.ft.lighthouse import LighthouseOptions, start_lighthouse\n"
            "server = start_lighthouse(LighthouseOptions(bind='127.0.0.1:0'))\n"
            "assert server.address().startswith('http://')\n"
            "server.shutdown()\n"
            "print(sorted(m for m in ('torch', 'torchft', 'torchrec', 'fbgemm_gpu') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RUST_LOG": "warn"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
