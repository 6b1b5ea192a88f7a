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
  term is the larger one, and the model can only learn it by reading the history;
- with ``num_labels: 2`` a clicked candidate is also "liked" with probability
  ``sigmoid(preference_logit * ([cluster preferred] - 1/2) + 2 * quality(item))``: a second
  label, correlated with the click and learnable from the same two signals.

Times (int64 seconds): sample ``i`` is requested at ``START_TIME + i * REQUEST_GAP`` (each
split's stream has its own positions on the same clock), and its candidates are shown then.
Its history goes back from the request in gaps drawn from a lognormal (log-space standard
deviation ``GAP_SIGMA``) whose mean is ``HISTORY_SPAN / L`` for a history of ``L`` events, clipped
to ``[1 s, MAX_GAP]``: a typical history reaches back about ``HISTORY_SPAN`` whatever its length,
short histories spaced by days to weeks, long ones by seconds to hours. The gaps are at least a
second, so a history's times strictly decrease going back from the request.

Retrieval (``task="retrieval"``): the history is drawn the same way, and the candidates are
the next event of the user, drawn like a history event (preferred cluster with probability
``affinity``), followed by ``num_negatives`` uniform negatives
(``freescale.data.retrieval``); all at the request time.

Draws for the times, the second label and the next item come from their own generators, so a
split's histories, candidates and clicks are the same whichever of them are asked for.

Side features (off by default; they draw nothing, so the samples are the same with them):
``user_features`` gives each sample ``user:clusters``, its user's preferred clusters, and
``item_features`` each history event and candidate ``item:cluster``, its item's cluster. Together
they state the preference term of the click, which otherwise has to be read from the history.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from freescale.config import SyntheticDataConfig
from freescale.data.batch import Samples, SideLayout
from freescale.data.sample_files import SideFeature
from freescale.data.retrieval import next_item_candidates
from freescale.data.retrieval import splitmix64 as _mix

BLOCK = 4096
"""Samples per independently seeded block of the stream."""
SPLITS = {"train": 0, "eval": 1}
EVAL_ID_OFFSET = 1 << 40
"""Eval sample ids start here so they never equal a training sample id."""
START_TIME = 1_700_000_000
"""Request time of stream position 0 (seconds since the epoch, November 2023)."""
REQUEST_GAP = 1
"""Seconds between consecutive requests of a stream."""
HISTORY_SPAN = 180 * 86400
"""Mean time a history reaches back before its request, in seconds."""
GAP_SIGMA = 2.0
"""Log-space standard deviation of the gaps between a user's events."""
MAX_GAP = 90 * 86400
"""Longest gap between two events of a history, in seconds."""
_TIMES, _LIKED, _NEXT = 1, 2, 3  # SeedSequence keys of the side generators


def sample_uih_lengths(cfg: SyntheticDataConfig, n: int, min_len: int, max_len: int, rng: np.random.Generator) -> np.ndarray:
    """Draw ``n`` history lengths: lognormal body, Pareto tail, clipped."""
    body = np.exp(np.log(cfg.median_uih_len) + cfg.sigma * rng.standard_normal(n))
    tail = cfg.tail_min_len * (1.0 + rng.pareto(cfg.tail_alpha, n))
    lengths = np.where(rng.random(n) < cfg.tail_prob, tail, body)
    return np.clip(np.rint(lengths), min_len, max_len).astype(np.int64)


class SyntheticSource:
    """Infinite stream of samples for one split ("train" or "eval")."""

    def __init__(self, cfg: SyntheticDataConfig, *, seed: int, split: str, min_uih_len: int, max_uih_len: int, num_candidates: int,
                 task: str = "ranking", num_negatives: int = 0) -> None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLITS)}")
        if task not in ("ranking", "retrieval"):
            raise ValueError(f"unknown task {task!r}; expected ranking or retrieval")
        if cfg.num_items < cfg.num_clusters:
            raise ValueError(f"data.synthetic.num_items ({cfg.num_items}) must be at least num_clusters ({cfg.num_clusters})")
        self.cfg = cfg
        self.seed = seed
        self.split = split
        self.min_uih_len = min_uih_len
        self.max_uih_len = max_uih_len
        self.num_candidates = num_candidates
        self.task = task
        self.num_negatives = num_negatives
        self.side_layout = SideLayout(
            user=(SideFeature("clusters", cfg.num_clusters, cfg.clusters_per_user),) if cfg.user_features else (),
            item=(SideFeature("cluster", cfg.num_clusters, 1),) if cfg.item_features else ())
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

    def item_side(self, item_ids: np.ndarray) -> np.ndarray:
        """[n, 1] the items' clusters (``item:cluster``), or [n, 0] without item features."""
        items = np.asarray(item_ids, dtype=np.int64)
        if not self.cfg.item_features:
            return np.zeros((len(items), 0), dtype=np.int64)
        return (items % self.cfg.num_clusters)[:, None]

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

    def lengths_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(history lengths, candidate counts) of the samples at ``positions``: those
        :meth:`samples_at` gives, drawn without the samples' items and times (what the simulator
        samples: 0.08 s against samples_at's 5.4 s for its 65536 positions of
        configs/freescale.yaml's stream, here)."""
        positions = np.asarray(positions, dtype=np.int64)
        lengths = np.empty(len(positions), dtype=np.int64)
        blocks = positions // BLOCK
        for b in np.unique(blocks):
            here = blocks == b
            lengths[here] = self._block_users_and_lengths(int(b))[2][positions[here] - b * BLOCK]
        per = 1 + self.num_negatives if self.task == "retrieval" else self.num_candidates
        return lengths, np.full(len(positions), per, dtype=np.int64)

    def _block_users_and_lengths(self, block: int) -> tuple[np.random.Generator, np.ndarray, np.ndarray]:
        """A block's generator, its users and their history lengths: the first draws of the block."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, SPLITS[self.split], block]))
        users = rng.integers(0, self.cfg.num_users, BLOCK, dtype=np.int64)
        return rng, users, sample_uih_lengths(self.cfg, BLOCK, self.min_uih_len, self.max_uih_len, rng)

    def _generate_block(self, block: int) -> Samples:
        cfg = self.cfg
        rng, users, lengths = self._block_users_and_lengths(block)
        n = BLOCK
        prefs = self.preferred_clusters(users)
        per_cluster = cfg.num_items // cfg.num_clusters

        owner = np.repeat(np.arange(n), lengths)
        uih_clusters = self._draw_clusters(rng, prefs, owner, cfg.affinity)
        uih = uih_clusters + cfg.num_clusters * self._draw_within(rng, per_cluster, len(owner))

        ids = np.arange(block * n, (block + 1) * n, dtype=np.int64)
        request = START_TIME + REQUEST_GAP * ids
        uih_times = self._history_times(block, request, lengths)
        if self.split == "eval":
            ids += EVAL_ID_OFFSET
        if self.task == "retrieval":
            nxt = np.random.default_rng(np.random.SeedSequence([self.seed, SPLITS[self.split], block, _NEXT]))
            next_items = (self._draw_clusters(nxt, prefs, np.arange(n), cfg.affinity)
                          + cfg.num_clusters * self._draw_within(nxt, per_cluster, n))
            counts, cands, cand_times, labels = next_item_candidates(
                ids, next_items, request, seed=self.seed, num_negatives=self.num_negatives, num_items=cfg.num_items)
        else:
            counts, cands, labels = self._ranking_candidates(rng, block, prefs, per_cluster)
            cand_times = np.repeat(request, counts)
        return Samples(
            sample_ids=ids,
            user_ids=users,
            uih_lengths=lengths,
            uih_values=uih.astype(np.int64),
            uih_timestamps=uih_times,
            cand_counts=counts,
            cand_values=cands.astype(np.int64),
            cand_timestamps=cand_times,
            labels=labels,
            user_side=prefs if cfg.user_features else None,
            uih_side=self.item_side(uih),
            cand_side=self.item_side(cands),
            side_layout=self.side_layout,
        )

    def _ranking_candidates(self, rng: np.random.Generator, block: int, prefs: np.ndarray, per_cluster: int):
        """(counts, items, labels [.., num_labels]) of a block's ranking candidates."""
        cfg = self.cfg
        n = len(prefs)
        counts = np.full(n, self.num_candidates, dtype=np.int64)
        cand_owner = np.repeat(np.arange(n), counts)
        cand_clusters = self._draw_clusters(rng, prefs, cand_owner, 0.5)
        cands = cand_clusters + cfg.num_clusters * self._draw_within(rng, per_cluster, len(cand_owner))
        preferred = (prefs[cand_owner] == cand_clusters[:, None]).any(axis=1)
        quality = self.item_quality(cands)
        logit = cfg.base_logit + cfg.preference_logit * preferred + quality
        click = rng.random(len(cand_owner)) < _sigmoid(logit)
        labels = [click]
        if cfg.num_labels > 1:
            liked_rng = np.random.default_rng(np.random.SeedSequence([self.seed, SPLITS[self.split], block, _LIKED]))
            liked_logit = cfg.preference_logit * (preferred - 0.5) + 2.0 * quality
            labels.append(click & (liked_rng.random(len(cand_owner)) < _sigmoid(liked_logit)))
        return counts, cands, np.stack(labels, axis=1).astype(np.float32)

    def _history_times(self, block: int, request: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """int64 [sum(lengths)]: each history's event times, oldest first, going back from its request."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, SPLITS[self.split], block, _TIMES]))
        owner = np.repeat(np.arange(len(lengths)), lengths)
        # A lognormal with mean HISTORY_SPAN / L has median HISTORY_SPAN / L / exp(sigma^2 / 2).
        median = HISTORY_SPAN / np.maximum(lengths, 1)[owner] / np.exp(GAP_SIGMA ** 2 / 2)
        gaps = np.clip(np.rint(median * np.exp(GAP_SIGMA * rng.standard_normal(len(owner)))), 1, MAX_GAP).astype(np.int64)
        # Event k of a history is its request minus the gaps of events k..L-1 (the suffix sum).
        cum = np.cumsum(gaps)
        ends = np.cumsum(lengths) - 1
        suffix = cum[ends][owner] - cum + gaps if len(gaps) else gaps
        return request[owner] - suffix

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


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))
