"""Side features in the model: the source's categorical features as embedding tables, joined into
the user's and the items' rows before the task sees them.

Each feature ``model.side_features`` names (``user:<name>`` or ``item:<name>``, a column of the
source: ``freescale.data.batch.SideLayout``) gets a table of its own (``SideSpec``: rows, width,
pooling). A row of the batch (a sample for a user feature; a history event or a candidate for an
item feature) holds up to ``max_values`` values of a feature; their rows are pooled into one
(sum or mean; no value gives zeros). TorchRec's tables pool inside their
``EmbeddingBagCollection`` (``SeqRecModel``); FreeScale's own tables look every value up as a row
and ``pool_bags`` pools them in the dense part (``OwnedModel``).

The join (``SideJoin``): the pooled rows of a representation's features are concatenated and
projected by a learned ``Linear`` to ``model.embedding_dim``, and the projection is *added* to the
row it enriches:

- the user row (the hashed user id's, ``model.user_features``) + P_user(user features); without a
  user-id row the projection is the user row;
- a candidate's item row + P_seq(its ``sequence`` item features) + P_cand(its ``pooled`` ones);
- a history event's item row + P_seq(its ``sequence`` item features).

Added rather than concatenated to the task's input, so every task (the transformer, HSTU's
ranking and retrieval) and its width stay as they are, and a feature's contribution starts as a
small perturbation of the id rows it joins. Concatenating the features first and projecting
them together lets the projection weigh and mix them (one matmul per representation). The
``sequence`` features share one projection between history events and candidates: an item's
representation is the same wherever it appears, which retrieval's item tower needs (its
history items are the positions' targets, its candidates the negatives).

``SideFeaturesTask`` runs the join and then the task, as one module: the projections are dense
parameters of the task (the same optimizer, gradient all-reduce, checkpoint keys and
``freescale verify`` snapshot as the rest), and TorchRec's pipelines treat it as one FX leaf.
This module needs torch alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from freescale.data.sample_files import USER_PREFIX
from freescale.device import to_device
from freescale.model.flops import matmul
from freescale.model.jagged_attention import offsets_of

if TYPE_CHECKING:
    from freescale.config import ModelConfig
    from freescale.data.batch import SideLayout


@dataclass(frozen=True)
class SideSpec:
    """One side feature the model reads, resolved against the source's layout."""

    key: str
    """``user:<name>`` or ``item:<name>``: the batch's KJT key."""
    rows: int
    dim: int
    pooling: str
    """sum or mean."""
    sequence: bool
    """An item feature joined into the history events too (kind sequence)."""
    max_values: int
    """The most values one row has (the source's)."""

    @property
    def user(self) -> bool:
        return self.key.startswith(USER_PREFIX)

    @property
    def table(self) -> str:
        """Its embedding table's name."""
        return self.key.replace(":", "_") + "_table"


def side_specs(model: ModelConfig, layout: SideLayout) -> list[SideSpec]:
    """``model.side_features`` against the source's ``layout``, in the order the model joins them
    (user features, then the sequence item features, then the pooled ones, each in the config's
    order). A name the source lacks, or a table smaller than the feature's values, is a
    ``ConfigError`` naming the key."""
    from freescale.config import ConfigError

    specs = []
    for i, f in enumerate(model.side_features):
        key = f"model.side_features[{i}]"
        try:
            feature = layout.feature(f.name)
        except KeyError:
            known = ", ".join(layout.keys()) or "none"
            raise ConfigError(f"{key}.name: the source has no side feature {f.name} (it has: {known})") from None
        if 0 < f.rows < feature.num_values:
            raise ConfigError(f"{key}.rows: {f.name} takes {feature.num_values} values, a table of {f.rows} rows "
                              f"has none for the rest: expected 0 or at least {feature.num_values}")
        specs.append(SideSpec(key=f.name, rows=f.rows or feature.num_values, dim=f.dim or model.embedding_dim,
                              pooling=f.pooling, sequence=f.kind == "sequence", max_values=feature.max_values))
    return sorted(specs, key=lambda s: (not s.user, not s.sequence))  # (a stable sort keeps the config's order)


def pool_bags(rows: torch.Tensor, lengths: torch.Tensor, max_values: int, pooling: str) -> torch.Tensor:
    """[bags, D]: each bag's rows (``rows`` bag after bag, ``lengths`` host) summed, or averaged;
    an empty bag gives zeros. The rows are placed into a [bags, max_values, D] block and summed over
    its slots: the same additions in the same order whichever batch-mates a bag has."""
    bags = len(lengths)
    within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(offsets_of(lengths)[:-1], lengths)
    slot = torch.repeat_interleave(torch.arange(bags), lengths) * max_values + within
    block = rows.new_zeros((bags * max_values, rows.shape[1])).index_copy(0, to_device(slot, rows.device), rows)
    pooled = block.view(bags, max_values, rows.shape[1]).sum(dim=1)
    if pooling == "mean":
        pooled = pooled / to_device(lengths.clamp(min=1).to(rows.dtype), rows.device)[:, None]
    return pooled


class SideJoin(nn.Module):
    """The projections of the pooled side rows, added to the rows they enrich (module docstring)."""

    def __init__(self, specs: list[SideSpec], dim: int) -> None:
        super().__init__()
        self.user_keys = [s.key for s in specs if s.user]
        self.sequence_keys = [s.key for s in specs if not s.user and s.sequence]
        self.pooled_keys = [s.key for s in specs if not s.user and not s.sequence]
        widths = {s.key: s.dim for s in specs}

        def projection(keys: list[str]) -> nn.Linear | None:
            return nn.Linear(sum(widths[k] for k in keys), dim) if keys else None

        self.user = projection(self.user_keys)
        self.sequence = projection(self.sequence_keys)
        self.pooled = projection(self.pooled_keys)

    def forward(self, uih: torch.Tensor, cand: torch.Tensor, user_rows: torch.Tensor | None,
                user_side: dict[str, torch.Tensor], item_side: dict[str, torch.Tensor]):
        """(uih, cand, user_rows) with the side rows joined. ``user_side``: a user feature's pooled
        rows per sample; ``item_side``: an item feature's per candidate, preceded by the history
        events' (a sequence feature's always; a pooled feature's may be, and they are not read)."""
        if self.user is not None:
            joined = self.user(torch.cat([user_side[k] for k in self.user_keys], dim=-1))
            user_rows = joined if user_rows is None else user_rows + joined
        n_uih, n_cand = uih.shape[0], cand.shape[0]
        if self.sequence is not None:
            joined = self.sequence(torch.cat([item_side[k] for k in self.sequence_keys], dim=-1))
            uih, cand = uih + joined[:n_uih], cand + joined[n_uih:]
        if self.pooled is not None:
            rows = [item_side[k] for k in self.pooled_keys]
            cand = cand + self.pooled(torch.cat([r[r.shape[0] - n_cand:] for r in rows], dim=-1))
        return uih, cand, user_rows

    def flops(self, uih_lengths, cand_counts) -> float:
        """Forward FLOPs of the projections (``freescale.model.flops``)."""
        events, cands = float(torch.as_tensor(uih_lengths).sum()), float(torch.as_tensor(cand_counts).sum())
        total = 0.0
        for linear, rows in ((self.user, float(len(torch.as_tensor(uih_lengths)))), (self.sequence, events + cands),
                             (self.pooled, cands)):
            if linear is not None:
                total += matmul(rows, linear.out_features, linear.in_features)
        return total


class SideFeaturesTask(nn.Module):
    """A task whose rows are first joined with the side features' (``SideJoin``): what
    ``build_task`` returns when ``model.side_features`` is set. Its forward takes the user and item
    side rows after the rows, then what every task takes."""

    def __init__(self, task: nn.Module, join: SideJoin) -> None:
        super().__init__()
        self.task = task
        self.join = join

    def forward(self, uih, cand, user_rows, user_side, item_side, *arguments):
        return self.task(*self.join(uih, cand, user_rows, user_side, item_side), *arguments)

    def flops(self, uih_lengths, cand_counts) -> float:
        return self.task.flops(uih_lengths, cand_counts) + self.join.flops(uih_lengths, cand_counts)
