"""Two replicas in one world: every collective of the trainer stays inside its replica's group.

Four ranks form two replica groups of two; each replica trains its own experiment (another
seed: other data, other weights) through ``train(cfg, topology)``, with its own checkpoint
and evaluation schedule. If any collective ran on the world instead of the replica's group
(a loss all-reduce, an evaluation gather, a checkpoint barrier, the sharding plan, the
balancer's exchange, the clock offsets), the replicas would mix their data, or, for a
barrier, wait for collectives the other replica never issues; each must match a plain 2-rank
run of its experiment, bitwise.
"""

import json

import pytest
import torch.distributed as dist

from freescale.config import load_config
from freescale.distributed import Topology
from helpers.launch import FAST, QUICKSTART, check, metrics, ranks, train_losses
from helpers.spawn import run_ranks

pytestmark = pytest.mark.slow

EXPERIMENT = [*FAST, "--train.steps=4", "--balance.enable=true", "--transport.kind=host_staged",
              "--profile.enable=true", "--profile.warmup_steps=1", "--train.ledger=true", "--run.threads=1"]
# Replica 0 evaluates and checkpoints at steps 2 and 4, replica 1 only at its end.
SCHEDULES = [["--train.eval_every=2", "--checkpoint.every=2"], ["--train.eval_every=0", "--checkpoint.every=0"]]
CHECKPOINTS = [["step_00000002", "step_00000004"], ["step_00000004"]]


def experiment(replica: int) -> list[str]:
    return [*EXPERIMENT, *SCHEDULES[replica], f"--run.seed={replica}"]


def _replica(rank, world, root):
    from freescale.train.trainer import train

    group, _ = dist.new_subgroups(group_size=2)
    replica = rank // 2
    topology = Topology(rank=rank % 2, world_size=2, local_rank=rank, local_world_size=world, replica_id=replica,
                        num_replicas=2, group=group)
    cfg = load_config(QUICKSTART, [*experiment(replica), f"--run.dir={root}/replica{replica}"])
    summary = train(cfg, topology)
    assert summary["steps"] == 4 and summary["ranks"] == 2


def test_replicas_in_one_world_train_apart(tmp_path):
    run_ranks(4, _replica, str(tmp_path))
    for replica in (0, 1):
        alone = tmp_path / f"alone{replica}"
        check(ranks(2, "train", "--config", str(QUICKSTART), *experiment(replica), f"--run.dir={alone}"))
        together = tmp_path / f"replica{replica}"
        assert train_losses(together) == train_losses(alone), replica
        evals = lambda d: [r for r in metrics(d) if "eval/auc" in r]  # noqa: E731
        assert evals(together) == evals(alone) and len(evals(alone)) == 2 - replica
        assert sorted(p.name for p in (together / "checkpoints").iterdir()) == CHECKPOINTS[replica]
        report = json.loads((together / "report" / "report.json").read_text())
        assert report["summary"]["ranks"] == 2
        assert len(list((together / "ledger").iterdir())) == 2
    assert train_losses(tmp_path / "replica0") != train_losses(tmp_path / "replica1")  # they did differ
