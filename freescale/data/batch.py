"""The Batch type: one rank's slice of a global batch, as the model and pipelines see it.

Samples are kept in numpy as ``Samples`` (what sources produce and what the balancer will
move between ranks) and turned into a ``Batch`` of tensors for the model. The sparse
features are TorchRec ``KeyedJaggedTensor``s so that ``TrainPipelineSparseDist`` can start
their input distribution ahead of the forward pass.

A batch's shape (history lengths, candidate counts), its sample ids, its index and its event
times stay in host memory when the batch moves to a device (``HOST_FIELDS``): everything whose
value decides a size or an index is computed from them on the host (the attention's groups, the
pipelines' routes, the buckets of time differences), so the host never waits for the device to
learn a number.

Labels are 2-D, ``[candidates, K]`` with ``K >= 1`` labels per candidate
(``freescale.data.features.label_names`` names them).

Side features (``SideLayout``): categorical values of the user (``user:<name>``, one row per
sample) and of the item (``item:<name>``, one row per history event and per candidate: an
item's features travel with every occurrence of the item, so the balancer moves them with the
samples and the model never looks an item's features up). Each feature takes ``max_values``
consecutive int64 slots of its row, unused slots ``-1``. A ``Batch`` carries them as two
KeyedJaggedTensors, one bag per row and feature, the padding left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from freescale.data.features import CANDIDATE_FEATURE, UIH_FEATURE, USER_FEATURE
from freescale.data.sample_files import ITEM_PREFIX, USER_PREFIX, SideFeature
from freescale.device import accelerated, to_device

HOST_FIELDS = ("uih_lengths", "cand_counts", "sample_ids", "batch_index", "uih_timestamps", "cand_timestamps",
               "item_ids", "stream_positions", "user_ids", "seen_items")
"""The fields that stay on the host when a batch moves to a device."""
SPARSE_FIELDS = ("seq_features", "user_features", "user_side_features", "item_side_features")
"""The ids: the device's for TorchRec's tables; the pipelines over FreeScale's own tables route
them from the host and leave them there."""
PADDING = -1
"""An unused slot of a side feature."""


@dataclass(frozen=True)
class SideLayout:
    """The side features a source's samples carry, in slot order: each takes ``max_values``
    consecutive int64 slots of its row (``Samples.user_side``: the user's; ``uih_side`` and
    ``cand_side``: the item's), unused slots ``PADDING``. Every rank of a run shares it."""

    user: tuple[SideFeature, ...] = ()
    item: tuple[SideFeature, ...] = ()

    @property
    def user_width(self) -> int:
        return sum(f.max_values for f in self.user)

    @property
    def item_width(self) -> int:
        return sum(f.max_values for f in self.item)

    def keys(self) -> list[str]:
        """Every feature's key (``user:<name>``, ``item:<name>``): the batch's KJT keys."""
        return [USER_PREFIX + f.name for f in self.user] + [ITEM_PREFIX + f.name for f in self.item]

    def feature(self, key: str) -> SideFeature:
        """The feature of ``key``; a KeyError naming the keys there are."""
        for prefix, features in ((USER_PREFIX, self.user), (ITEM_PREFIX, self.item)):
            for f in features:
                if prefix + f.name == key:
                    return f
        raise KeyError(f"{key} (the source's side features: {', '.join(self.keys()) or 'none'})")


@dataclass
class Samples:
    """A run of samples in time order, jagged fields flattened.

    ``uih_values`` holds the histories back to back (``uih_lengths`` each, oldest event first),
    and likewise ``cand_values`` / ``labels`` with ``cand_counts``. Timestamps are in seconds;
    a history's are non-decreasing and at most its candidates'.
    """

    sample_ids: np.ndarray  # int64 [n]
    user_ids: np.ndarray  # int64 [n]
    uih_lengths: np.ndarray  # int64 [n]
    uih_values: np.ndarray  # int64 [sum(uih_lengths)]
    uih_timestamps: np.ndarray  # int64 [sum(uih_lengths)], seconds
    cand_counts: np.ndarray  # int64 [n]
    cand_values: np.ndarray  # int64 [sum(cand_counts)]
    cand_timestamps: np.ndarray  # int64 [sum(cand_counts)], seconds
    labels: np.ndarray  # float32 [sum(cand_counts), K], K >= 1
    stream_positions: np.ndarray | None = None
    """int64 [n]: each sample's position in the training stream, counted across epochs (the loader
    sets it; default: the sample ids). It is the same whichever rank or replica group trains the
    sample, and differs from one epoch to the next: the key of the sample's dropout masks."""
    user_side: np.ndarray | None = None
    """int64 [n, side_layout.user_width]: each sample's user side features (None: empty, when the
    layout has no user feature or there is no sample; likewise the two below)."""
    uih_side: np.ndarray | None = None
    """int64 [sum(uih_lengths), side_layout.item_width]: the item side features of each history event."""
    cand_side: np.ndarray | None = None
    """int64 [sum(cand_counts), side_layout.item_width]: the item side features of each candidate
    (retrieval's negatives included)."""
    side_layout: SideLayout = field(default_factory=SideLayout)

    def __post_init__(self) -> None:
        if self.stream_positions is None:
            self.stream_positions = np.asarray(self.sample_ids, dtype=np.int64).copy()
        rows = {"user_side": (len(self.sample_ids), self.side_layout.user_width),
                "uih_side": (int(np.sum(self.uih_lengths)), self.side_layout.item_width),
                "cand_side": (int(np.sum(self.cand_counts)), self.side_layout.item_width)}
        for name, shape in rows.items():
            value = getattr(self, name)
            if value is None and 0 in shape:  # (nothing to carry: no feature, or no row)
                setattr(self, name, np.zeros(shape, dtype=np.int64))
            elif value is None or value.shape != shape:
                got = "none" if value is None else list(value.shape)
                raise ValueError(f"Samples.{name}: expected {list(shape)} (rows, the layout's slots), got {got}")

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
            uih_timestamps=self.uih_timestamps[uih],
            cand_counts=self.cand_counts[index],
            cand_values=self.cand_values[cand],
            cand_timestamps=self.cand_timestamps[cand],
            labels=self.labels[cand],
            stream_positions=self.stream_positions[index],
            user_side=self.user_side[index],
            uih_side=self.uih_side[uih],
            cand_side=self.cand_side[cand],
            side_layout=self.side_layout,
        )

    @staticmethod
    def concat(parts: list["Samples"]) -> "Samples":
        layout = parts[0].side_layout
        if any(p.side_layout != layout for p in parts):
            raise ValueError("Samples.concat: the parts carry different side features")
        arrays = [f for f in Samples.__dataclass_fields__ if f != "side_layout"]
        return Samples(**{f: np.concatenate([getattr(p, f) for p in parts]) for f in arrays}, side_layout=layout)


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
    user_side_features: KeyedJaggedTensor
    """Keys ``user:<name>``: one bag per sample (its values, padding left out)."""
    item_side_features: KeyedJaggedTensor
    """Keys ``item:<name>``: one bag per history event, then one per candidate."""
    uih_lengths: torch.Tensor
    cand_counts: torch.Tensor
    labels: torch.Tensor
    """float32 [sum(cand_counts), K]."""
    sample_ids: torch.Tensor
    batch_index: torch.Tensor
    loss_scale: torch.Tensor
    """Multiplies the local mean loss; 1 unless ranks hold unequal shares (see balance.balancer)."""
    uih_timestamps: torch.Tensor
    """int64 seconds [sum(uih_lengths)], on the host."""
    cand_timestamps: torch.Tensor
    """int64 seconds [sum(cand_counts)], on the host."""
    item_ids: torch.Tensor
    """The item ids of ``seq_features`` (histories', then candidates'), kept on the host whatever
    device the features go to: the same tensor, no copy (retrieval compares ids on the host)."""
    stream_positions: torch.Tensor
    """int64 [n] on the host: ``Samples.stream_positions`` (the key of each sample's dropout)."""
    user_ids: torch.Tensor
    """int64 [n] on the host: the samples' user ids as the source gives them, before hashing into
    the user table (``user_features``): per-user figures (GAUC) group by these, so users whose
    hashes collide stay apart."""
    seen_items: list[np.ndarray] | None = None
    """Held-out retrieval batches of a source that knows users' whole timelines (a ratings log):
    each sample's every item before its target, however long (its history is only the latest
    ``data.max_uih_len``); what ``task.exclude_history`` leaves out of the ranking. None: the
    history is all the source knows."""

    @staticmethod
    def from_samples(samples: Samples, batch_index: int, user_hash_size: int, loss_scale: float = 1.0) -> "Batch":
        uih_lengths = torch.from_numpy(samples.uih_lengths)
        cand_counts = torch.from_numpy(samples.cand_counts)
        item_ids = torch.from_numpy(np.concatenate([samples.uih_values, samples.cand_values]))
        seq = KeyedJaggedTensor.from_lengths_sync(
            keys=[UIH_FEATURE, CANDIDATE_FEATURE], values=item_ids, lengths=torch.cat([uih_lengths, cand_counts]),
        )
        user = KeyedJaggedTensor.from_lengths_sync(
            keys=[USER_FEATURE],
            values=torch.from_numpy(samples.user_ids % user_hash_size),
            lengths=torch.ones(len(samples), dtype=torch.int64),
        )
        layout = samples.side_layout
        return Batch(
            seq_features=seq,
            user_features=user,
            user_side_features=side_features(USER_PREFIX, layout.user, samples.user_side),
            item_side_features=side_features(ITEM_PREFIX, layout.item,
                                             np.concatenate([samples.uih_side, samples.cand_side])),
            uih_lengths=uih_lengths,
            cand_counts=cand_counts,
            labels=torch.from_numpy(samples.labels),
            sample_ids=torch.from_numpy(samples.sample_ids),
            batch_index=torch.tensor(batch_index, dtype=torch.int64),
            loss_scale=torch.tensor(loss_scale, dtype=torch.float32),
            uih_timestamps=torch.from_numpy(samples.uih_timestamps),
            cand_timestamps=torch.from_numpy(samples.cand_timestamps),
            item_ids=item_ids,
            stream_positions=torch.from_numpy(samples.stream_positions),
            user_ids=torch.from_numpy(np.asarray(samples.user_ids, dtype=np.int64)),
        )

    def __len__(self) -> int:
        return self.sample_ids.numel()

    def candidate_users(self) -> torch.Tensor:
        """Each candidate's user id (``user_ids``, unhashed), in candidate order."""
        return torch.repeat_interleave(self.user_ids, self.cand_counts)

    def _map(self, fn, names) -> "Batch":
        return Batch(**{name: fn(value) if name in names else value
                        for name, value in ((n, getattr(self, n)) for n in self.__dataclass_fields__)})

    def to(self, device: torch.device, non_blocking: bool = False, sparse: bool = True) -> "Batch":
        """The batch with what the device computes on moved there (``HOST_FIELDS`` stay; with
        ``sparse=False`` the ids stay too). On an accelerator the copies are always
        non-blocking, from pinned memory (``freescale.device.to_device``), whatever
        ``non_blocking`` says: they are ordered on the current stream like any kernel."""
        names = set(self.__dataclass_fields__) - set(HOST_FIELDS) - (set() if sparse else set(SPARSE_FIELDS))
        return self._map(lambda value: _to(value, device), names)

    def record_stream(self, stream) -> None:
        for name in set(self.__dataclass_fields__) - set(HOST_FIELDS):
            value = getattr(self, name)
            if (value.device if isinstance(value, torch.Tensor) else value.device()).type != "cpu":
                value.record_stream(stream)


def side_features(prefix: str, features: tuple[SideFeature, ...], slots: np.ndarray) -> KeyedJaggedTensor:
    """A KJT of ``slots`` (int64 [rows, the features' slots]): key ``prefix + name`` per feature,
    one bag per row holding its values in slot order, ``PADDING`` left out. A value outside the
    feature's ``num_values`` (what its table holds) is refused here, naming the feature."""
    keys, values, lengths = [], [], []
    at = 0
    for f in features:
        block = slots[:, at:at + f.max_values]
        at += f.max_values
        bad = (block < PADDING) | (block >= f.num_values)
        if bad.any():
            raise ValueError(f"side feature {prefix}{f.name}: value {int(block[bad][0])} is outside its "
                             f"{f.num_values} values (0..{f.num_values - 1}, {PADDING} for an unused slot)")
        present = block != PADDING
        keys.append(prefix + f.name)
        values.append(block[present])  # row-major: each row's values in slot order
        lengths.append(present.sum(axis=1))
    join = lambda parts: torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))  # noqa: E731
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=join(values or [np.zeros(0, np.int64)]),
                                               lengths=join(lengths or [np.zeros(0, np.int64)]), stride=len(slots))


def _to(value, device: torch.device):
    """A tensor or ``KeyedJaggedTensor`` on ``device`` (see ``Batch.to``)."""
    if isinstance(value, torch.Tensor):
        return to_device(value, device)
    if not accelerated(device):
        return value
    # (A KeyedJaggedTensor has no pin_memory: its tensors move one by one, its host-side
    # per-key lengths and offsets with it.)
    return KeyedJaggedTensor(keys=value.keys(), values=to_device(value.values(), device),
                             lengths=to_device(value.lengths(), device), stride=value.stride(),
                             length_per_key=value.length_per_key(), offset_per_key=value.offset_per_key())
