"""Checkpoint save and resume with torch.distributed.checkpoint (DCP).

A checkpoint is a DCP folder ``<run>/checkpoints/step_<N>`` holding a ``TrainingState``'s
parts (``freescale.train.state``): the sharded model (embedding shards as ShardedTensors),
both optimizers, the step, the data cursor and each rank's RNG state. It is written to a
hidden temporary folder and renamed into place by the replica's main rank once every rank
has finished, so a crash mid-save never leaves a folder that looks complete, and the
previous checkpoint stays loadable; older checkpoints beyond ``keep`` are then removed.
Every collective runs on the replica's process group.
"""

from __future__ import annotations

import os
import re
import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from freescale.config import CheckpointConfig
from freescale.train.folders import list_checkpoints
from freescale.train.state import TrainingState

class CheckpointError(RuntimeError):
    """A checkpoint that cannot be found or read; the message is one line naming the path."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder itself, or the latest checkpoint of a run folder."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    found = list_checkpoints(os.path.join(path, "checkpoints"))
    if not found:
        raise CheckpointError(f"no checkpoint found in {path} (expected {path}/checkpoints/step_N)")
    return found[-1][1]


_GROUP_DIR = re.compile(r"^replica\d+$")


def job_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints of a run folder as (step, path), oldest first; for a replica group's
    folder (``<job>/replica<r>``, the layout ``freescale local`` makes), every group's of the
    job, this group's first among equal steps. Under the replica layer every group's model
    state at a step is the job's (dense parameters and tables agree at checkpoint steps), so
    any of them restores any group."""
    run_dir = os.path.abspath(run_dir)
    parent, name = os.path.split(run_dir)
    folders = [run_dir]
    if _GROUP_DIR.match(name) and os.path.isdir(parent):
        folders += [os.path.join(parent, d) for d in sorted(os.listdir(parent)) if _GROUP_DIR.match(d) and d != name]
    found = [c for folder in folders for c in list_checkpoints(os.path.join(folder, "checkpoints"))]
    return sorted(found, key=lambda c: c[0])


def run_dir_of(checkpoint: str) -> str:
    """The run folder a checkpoint folder belongs to."""
    return os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))


class Checkpointer:
    def __init__(self, run_dir: str, cfg: CheckpointConfig, *, rank: int, group: dist.ProcessGroup) -> None:
        self.root = os.path.join(run_dir, "checkpoints")
        self.cfg = cfg
        self.rank = rank
        self.group = group

    def save(self, step: int, state: TrainingState) -> str:
        final = os.path.join(self.root, step_dir_name(step))
        tmp = os.path.join(self.root, f".tmp-{step_dir_name(step)}")
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
        dist.barrier(group=self.group)
        dcp.save(state.parts, checkpoint_id=tmp, process_group=self.group)
        dist.barrier(group=self.group)
        if self.rank == 0:
            if os.path.exists(final):  # the same step saved again (a resume from an older checkpoint)
                old = os.path.join(self.root, f".old-{step_dir_name(step)}")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            for _, stale in list_checkpoints(self.root)[: -self.cfg.keep]:
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier(group=self.group)
        return final

    def load(self, path: str, state: TrainingState) -> None:
        """Load ``path`` into ``state``'s parts, in place."""
        if not os.path.exists(os.path.join(path, ".metadata")):
            raise CheckpointError(f"not a checkpoint folder: {path}")
        try:
            saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        except Exception as e:
            raise CheckpointError(f"{path}: unreadable checkpoint metadata ({type(e).__name__}: {e})") from None
        parts = dict(state.parts)
        if f"rng.{parts['rng'].key}" not in saved:  # saved with fewer ranks: this rank keeps its seed
            del parts["rng"]
        state.prepare_load()
        dcp.load(parts, checkpoint_id=path, process_group=self.group)
