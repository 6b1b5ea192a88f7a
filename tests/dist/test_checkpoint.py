"""Checkpointer on 2 gloo ranks: a save that fails half-way leaves the previous checkpoint
complete, loadable and the one a run folder resumes from."""

import os

import pytest
import torch

from freescale.config import CheckpointConfig
from helpers.spawn import run_ranks

pytestmark = pytest.mark.slow


class _Weights:
    def __init__(self, value: float) -> None:
        self.w = torch.full((4,), value)

    def state_dict(self) -> dict:
        return {"w": self.w}

    def load_state_dict(self, state: dict) -> None:
        self.w = state["w"].clone()


class _State:
    """The shape of a TrainingState: named Stateful parts, an RNG part, prepare_load()."""

    def __init__(self, value: float, rank: int) -> None:
        from freescale.train.state import RNGState

        self.parts = {"weights": _Weights(value), "rng": RNGState(rank)}

    def prepare_load(self) -> None:
        pass


def _crash_during_save(rank, world, root):
    import torch.distributed as dist

    from freescale.train import checkpoint
    from freescale.train.checkpoint import Checkpointer, list_checkpoints, resolve_checkpoint

    ckpt = Checkpointer(root, CheckpointConfig(keep=2), rank=rank, group=dist.group.WORLD)
    ckpt.save(1, _State(1.0, rank))
    save = checkpoint.dcp.save

    def crashing_save(state, checkpoint_id, process_group):
        os.makedirs(checkpoint_id, exist_ok=True)
        with open(os.path.join(checkpoint_id, f"__{rank}_0.distcp"), "wb") as f:
            f.write(b"half of a shard")  # what a crash mid-write leaves
        raise OSError(28, "No space left on device")

    checkpoint.dcp.save = crashing_save
    with pytest.raises(OSError, match="No space left"):
        ckpt.save(2, _State(2.0, rank))
    checkpoint.dcp.save = save
    dist.barrier()
    found = [step for step, _ in list_checkpoints(os.path.join(root, "checkpoints"))]
    assert found == [1]  # the half-written one does not count
    assert resolve_checkpoint(root).endswith("step_00000001")
    state = _State(0.0, rank)
    ckpt.load(resolve_checkpoint(root), state)
    assert torch.equal(state.parts["weights"].w, torch.full((4,), 1.0))
    # The next save goes through, clearing what the crash left.
    ckpt.save(2, _State(3.0, rank))
    assert [step for step, _ in list_checkpoints(os.path.join(root, "checkpoints"))] == [1, 2]
    assert not [n for n in os.listdir(os.path.join(root, "checkpoints")) if n.startswith(".")]


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    run_ranks(2, _crash_during_save, str(tmp_path))
