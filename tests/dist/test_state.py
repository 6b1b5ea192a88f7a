"""The training state as a live transfer would move it: ``TrainingState.state_dict()`` of a
trained replica loaded into a freshly built one (other initial weights, no optimizer state
yet) on 2 gloo ranks. From then on both must train bit for bit alike."""

import pytest
import torch

from freescale.balance.balancer import NullBalancer
from freescale.config import load_config
from freescale.data.loader import BatchLoader, build_sources
from freescale.distributed import Topology
from freescale.ft.replica import load_transferred, transfer_state
from freescale.model.seqrec import SeqRecModel
from freescale.model.sharding import build_optimizer, shard_model
from freescale.train.state import DataCursor, RNGState, TrainerState, TrainingState
from helpers.launch import FAST, QUICKSTART
from helpers.spawn import run_ranks

pytestmark = pytest.mark.slow


class Replica:
    """What the trainer builds on one rank, trained by hand one batch at a time."""

    def __init__(self, cfg, topo: Topology, seed: int) -> None:
        source, _ = build_sources(cfg.data, cfg.run.seed, task=cfg.task)
        torch.manual_seed(seed)
        model = SeqRecModel(cfg.model, cfg.embedding, num_items=source.num_items, max_uih_len=cfg.data.max_uih_len,
                            device=torch.device("meta"))
        self.model = shard_model(model, cfg.embedding, topo, torch.device("cpu"))
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.loader = BatchLoader(source, batch_size=cfg.data.batch_size, rank=topo.rank, world_size=topo.world_size,
                                  user_hash_size=cfg.model.user_hash_size)
        self.trainer = TrainerState()
        self.cursor = DataCursor(self.loader)
        self.state = TrainingState(model=self.model, optimizer=self.optimizer, trainer=self.trainer, data=self.cursor,
                                   rng=RNGState(topo.rank))
        self.user_hash_size = cfg.model.user_hash_size

    def train(self, steps: int) -> list[float]:
        losses = []
        batches = NullBalancer(self.user_hash_size).batches(self.cursor.stream())
        for _ in range(steps):
            batch = next(batches)
            loss, _ = self.model(batch)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.trainer.step += 1
            self.cursor.advance_past(batch.batch_index.item())
            losses.append(loss.item())
        return losses

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every weight and optimizer-state tensor, this rank's shards of the sharded ones."""
        flat = {}

        def walk(prefix, value):
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}", v)
            elif hasattr(value, "local_shards"):
                for i, shard in enumerate(value.local_shards()):
                    flat[f"{prefix}[{i}]"] = shard.tensor.clone()
            elif isinstance(value, torch.Tensor):
                flat[prefix] = value.clone()

        walk("model", self.model.state_dict())
        walk("optimizer", self.optimizer.state_dict())
        return flat


def _transfer(rank, world):
    cfg = load_config(QUICKSTART, FAST)
    topo = Topology(rank=rank, world_size=world, local_rank=rank, local_world_size=world)
    healthy = Replica(cfg, topo, seed=0)
    healthy.train(3)
    joiner = Replica(cfg, topo, seed=1)  # other initial weights, no optimizer state
    assert any(not torch.equal(v, joiner.tensors()[k]) for k, v in healthy.tensors().items() if "model" in k)

    joiner.state.load_state_dict(healthy.state.state_dict())

    assert joiner.trainer.step == 3 and joiner.cursor.next_batch == 3
    before = healthy.tensors()
    after = joiner.tensors()
    assert before.keys() == after.keys() and any(k.startswith("optimizer") for k in before)
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert joiner.train(3) == healthy.train(3)
    for name, value in healthy.tensors().items():
        assert torch.equal(joiner.tensors()[name], value), name

    # As the replica layer moves it: a copy holding each sharded tensor's local shards, loaded
    # in place into another replica's own storage.
    sent, taken = transfer_state(healthy.state.state_dict()), healthy.tensors()
    healthy.train(1)  # the copy is the state as it was when taken
    copied = Replica(cfg, topo, seed=2)
    load_transferred(copied.state, sent)
    assert copied.trainer.step == 6 and copied.cursor.next_batch == 6
    for name, value in taken.items():
        assert torch.equal(copied.tensors()[name], value), name


def test_a_fresh_replica_loaded_with_a_live_state_trains_alike():
    run_ranks(2, _transfer)
