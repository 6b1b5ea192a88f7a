"""The Batch type: one rank's slice of a global batch, as the model and pipelines see it.

Samples are kept in numpy as ``Samples`` (what sources produce and what the balancer will
move between ranks) and turned into a ``Batch`` of tensors for the model. The sparse
features are TorchRec ``KeyedJaggedTensor``s so that ``TrainPipelineSparseDist`` can start
their input distribution ahead of the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

UIH_FEATURE = "uih_item"
"""Sequence feature: the item ids of each sample's user interaction history."""
CANDIDATE_FEATURE = "cand_item"
"""Sequence feature: the item ids of each sample's candidates (same table as the UIH)."""
USER_FEATURE = "user_id"
"""Pooled feature: the hashed user id."""


@dataclass
class Samples:
    """A run of samples in time order, jagged fields flattened.

    ``uih_values`` holds the histories back to back (``uih_lengths`` each), and likewise
    ``cand_values`` / ``labels`` with ``cand_counts``.
    """

    sample_ids: np.ndarray  # int64 [n]
    user_ids: np.ndarray  # int64 [n]
    uih_lengths: np.ndarray  # int64 [n]
    uih_values: np.ndarray  # int64 [sum(uih_lengths)]
    cand_counts: np.ndarray  # int64 [n]
    cand_values: np.ndarray  # int64 [sum(cand_counts)]
    labels: np.ndarray  # float32 [sum(cand_counts)]

    def __len__(self) -> int:
        return len(self.sample_ids)

    def select(self, index: np.ndarray) -> "Samples":
        """The samples at ``index`` (in that order)."""
        index = np.asarray(index, dtype=np.int64)
        uih = _jagged_take(self.uih_lengths, index)
        cand = _jagged_take(self.cand_counts, index)
        return Samples(
            sample_ids=self.sample_ids[index],
            user_ids=self.user_ids[index],
            uih_lengths=self.uih_lengths[index],
            uih_values=self.uih_values[uih],
            cand_counts=self.cand_counts[index],
            cand_values=self.cand_values[cand],
            labels=self.labels[cand],
        )

    @staticmethod
    def concat(parts: list["Samples"]) -> "Samples":
        return Samples(*(np.concatenate([getattr(p, f) for p in parts]) for f in Samples.__dataclass_fields__))


def _jagged_take(lengths: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Flat positions of the jagged rows ``index`` of a jagged array with ``lengths``."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    sel_len = lengths[index]
    total = int(sel_len.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(offsets[index], sel_len)
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(sel_len) - sel_len, sel_len)
    return starts + within


@dataclass
class Batch(Pipelineable):
    """Tensors of one local batch. ``batch_index`` is the global step the batch belongs to."""

    seq_features: KeyedJaggedTensor
    user_features: KeyedJaggedTensor
    uih_lengths: torch.Tensor
    cand_counts: torch.Tensor
    labels: torch.Tensor
    sample_ids: torch.Tensor
    batch_index: torch.Tensor
    loss_scale: torch.Tensor
    """Multiplies the local mean loss; 1 unless ranks hold unequal shares (see balance.balancer)."""

    @staticmethod
    def from_samples(samples: Samples, batch_index: int, user_hash_size: int, loss_scale: float = 1.0) -> "Batch":
        uih_lengths = torch.from_numpy(samples.uih_lengths)
        cand_counts = torch.from_numpy(samples.cand_counts)
        seq = KeyedJaggedTensor.from_lengths_sync(
            keys=[UIH_FEATURE, CANDIDATE_FEATURE],
            values=torch.from_numpy(np.concatenate([samples.uih_values, samples.cand_values])),
            lengths=torch.cat([uih_lengths, cand_counts]),
        )
        user = KeyedJaggedTensor.from_lengths_sync(
            keys=[USER_FEATURE],
            values=torch.from_numpy(samples.user_ids % user_hash_size),
            lengths=torch.ones(len(samples), dtype=torch.int64),
        )
        return Batch(
            seq_features=seq,
            user_features=user,
            uih_lengths=uih_lengths,
            cand_counts=cand_counts,
            labels=torch.from_numpy(samples.labels),
            sample_ids=torch.from_numpy(samples.sample_ids),
            batch_index=torch.tensor(batch_index, dtype=torch.int64),
            loss_scale=torch.tensor(loss_scale, dtype=torch.float32),
        )

    def __len__(self) -> int:
        return self.sample_ids.numel()

    def _map(self, fn) -> "Batch":
        return Batch(**{name: fn(getattr(self, name)) for name in self.__dataclass_fields__})

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return self._map(lambda t: t.to(device=device, non_blocking=non_blocking))

    def record_stream(self, stream) -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).record_stream(stream)

    def pin_memory(self) -> "Batch":
        return self._map(lambda t: t.pin_memory())
