"""A seeded synthetic stream of time-ordered samples with heavy-tailed history lengths.

Sample ``i`` of a split is a pure function of ``(seed, split, i)``: the stream is cut into
blocks of ``BLOCK`` samples, each drawn from its own ``SeedSequence``, so any position can be
read directly (a resumed or re-partitioned run sees exactly the same samples).

The generative story, which plants a signal a sequence model can learn:
- items belong to clusters (item ``i`` is in cluster ``i % num_clusters``);
- each user prefers ``clusters_per_user`` clusters (a hash of the user id);
- a history of length ``L`` draws each event from a preferred cluster with probability
  ``affinity``, else from any cluster;
- an item is drawn uniformly within its cluster, or with probability ``hot_prob`` from the
  cluster's few hot items (``hot_items`` in all): consecutive batches share the hot rows and
  hardly any other (with a large ``num_items``), which sets their collision rate;
- ``L`` follows a lognormal body with a Pareto tail, clipped to ``[min_uih_len, max_uih_len]``;
- half the candidates come from preferred clusters; a candidate is clicked with probability
  ``sigmoid(base_logit + preference_logit * [cluster preferred] + quality(item))``, where
  ``quality`` is a fixed per-item draw of standard deviation ``quality_std``. The preference
  term is the larger one, and the model can only learn it by reading the history.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from freescale.config import SyntheticDataConfig
from freescale.data.batch import Samples

BLOCK = 4096
"""Samples per independently seeded block of the stream."""
SPLITS = {"train": 0, "eval": 1}
EVAL_ID_OFFSET = 1 << 40
"""Eval sample ids start here so they never equal a training sample id."""


def sample_uih_lengths(cfg: SyntheticDataConfig, n: int, min_len: int, max_len: int, rng: np.random.Generator) -> np.ndarray:
    """Draw ``n`` history lengths: lognormal body, Pareto tail, clipped."""
    body = np.exp(np.log(cfg.median_uih_len) + cfg.sigma * rng.standard_normal(n))
    tail = cfg.tail_min_len * (1.0 + rng.pareto(cfg.tail_alpha, n))
    lengths = np.where(rng.random(n) < cfg.tail_prob, tail, body)
    return np.clip(np.rint(lengths), min_len, max_len).astype(np.int64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a cheap, well-spread integer hash."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x


class SyntheticSource:
    """Infinite stream of samples for one split ("train" or "eval")."""

    def __init__(self, cfg: SyntheticDataConfig, *, seed: int, split: str, min_uih_len: int, max_uih_len: int, num_candidates: int) -> None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLITS)}")
        if cfg.num_items < cfg.num_clusters:
            raise ValueError(f"data.synthetic.num_items ({cfg.num_items}) must be at least num_clusters ({cfg.num_clusters})")
        self.cfg = cfg
        self.seed = seed
        self.split = split
        self.min_uih_len = min_uih_len
        self.max_uih_len = max_uih_len
        self.num_candidates = num_candidates
        self._block = lru_cache(maxsize=4)(self._generate_block)

    @property
    def num_items(self) -> int:
        return self.cfg.num_items

    num_samples = None
    """Infinite: positions never wrap."""

    def preferred_clusters(self, user_ids: np.ndarray) -> np.ndarray:
        """[n, clusters_per_user] preferred clusters of each user."""
        k = self.cfg.clusters_per_user
        keys = user_ids.astype(np.uint64)[:, None] * np.uint64(k) + np.arange(k, dtype=np.uint64)[None, :]
        with np.errstate(over="ignore"):
            keys = keys + np.uint64(self.seed) * np.uint64(0x9E3779B97F4A7C15)
        return (_mix(keys) % np.uint64(self.cfg.num_clusters)).astype(np.int64)

    def item_quality(self, items: np.ndarray) -> np.ndarray:
        """Fixed per-item click-logit offset, approximately normal with std ``quality_std``."""
        u = (_mix(items.astype(np.uint64) ^ np.uint64(0xA5A5A5A5 + self.seed)) >> np.uint64(11)).astype(np.float64)
        u = (u + 0.5) / float(1 << 53)
        # Logistic quantile scaled to the requested standard deviation (pi / sqrt(3) per unit).
        return self.cfg.quality_std * np.sqrt(3.0) / np.pi * np.log(u / (1.0 - u))

    def samples_at(self, positions: np.ndarray) -> Samples:
        """Samples at stream ``positions`` of this split, in the order given."""
        positions = np.asarray(positions, dtype=np.int64)
        blocks = positions // BLOCK
        order = np.argsort(blocks, kind="stable")
        parts = [
            self._block(int(b)).select(positions[order][blocks[order] == b] - b * BLOCK)
            for b in np.unique(blocks)
        ]
        if not parts:
            return self._block(0).select(positions)
        grouped = parts[0] if len(parts) == 1 else Samples.concat(parts)
        return grouped.select(np.argsort(order, kind="stable"))

    def _generate_block(self, block: int) -> Samples:
        cfg = self.cfg
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, SPLITS[self.split], block]))
        n = BLOCK
        users = rng.integers(0, cfg.num_users, n, dtype=np.int64)
        prefs = self.preferred_clusters(users)
        per_cluster = cfg.num_items // cfg.num_clusters

        lengths = sample_uih_lengths(cfg, n, self.min_uih_len, self.max_uih_len, rng)
        owner = np.repeat(np.arange(n), lengths)
        uih_clusters = self._draw_clusters(rng, prefs, owner, cfg.affinity)
        uih = uih_clusters + cfg.num_clusters * self._draw_within(rng, per_cluster, len(owner))

        counts = np.full(n, self.num_candidates, dtype=np.int64)
        cand_owner = np.repeat(np.arange(n), counts)
        cand_clusters = self._draw_clusters(rng, prefs, cand_owner, 0.5)
        cands = cand_clusters + cfg.num_clusters * self._draw_within(rng, per_cluster, len(cand_owner))
        preferred = (prefs[cand_owner] == cand_clusters[:, None]).any(axis=1)
        logit = cfg.base_logit + cfg.preference_logit * preferred + self.item_quality(cands)
        labels = (rng.random(len(cand_owner)) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)

        ids = np.arange(block * n, (block + 1) * n, dtype=np.int64)
        if self.split == "eval":
            ids += EVAL_ID_OFFSET
        return Samples(
            sample_ids=ids,
            user_ids=users,
            uih_lengths=lengths,
            uih_values=uih.astype(np.int64),
            cand_counts=counts,
            cand_values=cands.astype(np.int64),
            labels=labels,
        )

    def _draw_within(self, rng: np.random.Generator, per_cluster: int, n: int) -> np.ndarray:
        """Each item's index within its cluster: uniform, or with probability ``hot_prob`` one of
        the cluster's first ``hot_items / num_clusters`` (the rows every batch shares)."""
        within = rng.integers(0, per_cluster, n)
        cfg = self.cfg
        if cfg.hot_prob > 0 and cfg.hot_items > 0:
            hot = rng.random(n) < cfg.hot_prob
            hot_per_cluster = max(1, min(per_cluster, -(-cfg.hot_items // cfg.num_clusters)))
            within = np.where(hot, rng.integers(0, hot_per_cluster, n), within)
        return within

    def _draw_clusters(self, rng: np.random.Generator, prefs: np.ndarray, owner: np.ndarray, p_pref: float) -> np.ndarray:
        from_pref = rng.random(len(owner)) < p_pref
        pick = rng.integers(0, prefs.shape[1], len(owner))
        anywhere = rng.integers(0, self.cfg.num_clusters, len(owner))
        return np.where(from_pref, prefs[owner, pick], anywhere)
