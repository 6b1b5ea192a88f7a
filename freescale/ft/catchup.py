"""Catch-up: the state a healthy replica group hands one that (re)joins, and how it lands.

torchft fetches a live peer's state in its quorum thread while the peers keep stepping (the
rank-``r`` ranks of a group take the rank-``r`` peer's state: the same layout, the same
shards). What the peer sends is a *copy* taken before it writes anything in the step
(``transfer_state``): tensors copied to host memory, sharded tensors as their local shards. On
a GPU the copy is made in torchft's thread on the device's default stream, the one the step's
kernels run on, so it holds every write issued before it and none after; it lands in host
memory, where torchft sends it from, rather than as a second copy of the tables in device
memory. The receiving
rank does not load it when it arrives: it keeps it until its group's commit vote, and the
vote decides for the whole group (``freescale.ft.replica``): committed, every
rank loads its stash; not committed (a rank's fetch failed, the peer died mid-transfer), every
rank drops it. A group never ends half caught up.

``load_into`` writes a received copy into the live state in place, so tables keep their
kernels' storage and parameters stay the optimizer's.
"""

from __future__ import annotations

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host memory (a clone of a host tensor)."""
    return tensor.detach().to("cpu", copy=True)


def transfer_state(state: dict) -> dict:
    """A copy of ``state`` that the live state can no longer change: tensors copied to host
    memory, sharded tensors as their local shards (a rank catching up takes the same-rank
    peer's shards)."""

    def copy(value):
        if isinstance(value, DTensor):
            return host_copy(value.to_local())
        if isinstance(value, ShardedTensor):
            return [host_copy(s.tensor) for s in value.local_shards()]
        if isinstance(value, torch.Tensor):
            return host_copy(value)
        return value

    return tree_map(copy, state, is_leaf=lambda v: isinstance(v, ShardedTensor))


def load_into(live, value):
    """``value`` (a ``transfer_state`` copy) written into ``live`` (what a part's ``state_dict()``
    returns) in place: tensors, DTensors and ShardedTensors keep their storage (the tables'
    kernels, the parameters) and take the values; anything else is taken as it comes.
    Returns ``live`` for the part's ``load_state_dict``."""
    if isinstance(live, DTensor):
        live.to_local().copy_(value)
    elif isinstance(live, ShardedTensor):
        shards = live.local_shards()
        if len(shards) != len(value):
            raise ValueError(f"a peer's state holds {len(value)} local shard(s) where this rank holds {len(shards)}")
        for shard, v in zip(shards, value):
            shard.tensor.copy_(v)
    elif isinstance(live, torch.Tensor) and isinstance(value, torch.Tensor) and live.shape == value.shape:
        live.copy_(value)
    elif isinstance(live, dict) and isinstance(value, dict):
        for key, v in value.items():
            live[key] = load_into(live[key], v) if key in live else v
    elif isinstance(live, list) and isinstance(value, list) and len(live) == len(value):
        live[:] = [load_into(a, b) for a, b in zip(live, value)]
    else:
        return value
    return live


def load_transferred(state, transferred: dict) -> None:
    """A peer's ``transfer_state`` copy of a ``TrainingState`` loaded into ``state``, in place."""
    state.prepare_load()
    with torch.no_grad():
        for name, part in state.parts.items():
            if name in transferred:
                part.load_state_dict(load_into(part.state_dict(), transferred[name]))

