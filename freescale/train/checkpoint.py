"""Checkpoint save and resume with torch.distributed.checkpoint (DCP).

A checkpoint is a DCP folder ``<run>/checkpoints/step_<N>`` holding the sharded model
(embedding shards as ShardedTensors), both optimizers, the trainer state (step, data cursor)
and each rank's RNG state. It is written to a hidden temporary folder and renamed into place
by the main rank once every rank has finished, so a crash mid-save never leaves a folder that
looks complete; older checkpoints beyond ``keep`` are then removed.
"""

from __future__ import annotations

import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from freescale.config import CheckpointConfig

_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be found or read; the message is one line naming the path."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(root, name, ".metadata")):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder itself, or the latest checkpoint of a run folder."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    found = list_checkpoints(os.path.join(path, "checkpoints"))
    if not found:
        raise CheckpointError(f"no checkpoint found in {path} (expected {path}/checkpoints/step_N)")
    return found[-1][1]


def run_dir_of(checkpoint: str) -> str:
    """The run folder a checkpoint folder belongs to."""
    return os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))


class Checkpointer:
    def __init__(self, run_dir: str, cfg: CheckpointConfig, *, rank: int) -> None:
        self.root = os.path.join(run_dir, "checkpoints")
        self.cfg = cfg
        self.rank = rank

    def app_state(self, model: torch.nn.Module, optimizer, trainer_state: dict) -> dict:
        """The state dict tree that is saved and loaded (in place)."""
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            # Tensors, not ints: DCP flattens nested tensors on both save and load.
            "trainer": {k: torch.tensor(v, dtype=torch.int64) for k, v in trainer_state.items()},
            "rng": {f"rank{self.rank}": torch.get_rng_state()},
        }

    def save(self, step: int, state: dict) -> str:
        final = os.path.join(self.root, step_dir_name(step))
        tmp = os.path.join(self.root, f".tmp-{step_dir_name(step)}")
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        dcp.save(state, checkpoint_id=tmp)
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for _, old in list_checkpoints(self.root)[: -self.cfg.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def load(self, path: str, state: dict) -> None:
        """Load ``path`` into ``state`` in place (the tree from ``app_state``)."""
        if not os.path.exists(os.path.join(path, ".metadata")):
            raise CheckpointError(f"not a checkpoint folder: {path}")
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        rng_key = f"rank{self.rank}"
        if f"rng.{rng_key}" not in saved:  # saved with fewer ranks: this rank keeps its seed
            state = {k: v for k, v in state.items() if k != "rng"}
        dcp.load(state, checkpoint_id=path)
        if "rng" in state:
            torch.set_rng_state(state["rng"][rng_key])
