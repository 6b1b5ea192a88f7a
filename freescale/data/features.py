"""The names of a batch's features and labels, shared by the batches and the models (no TorchRec here)."""

UIH_FEATURE = "uih_item"
"""Sequence feature: the item ids of each sample's user interaction history."""
CANDIDATE_FEATURE = "cand_item"
"""Sequence feature: the item ids of each sample's candidates (same table as the UIH)."""
USER_FEATURE = "user_id"
"""Pooled feature: the hashed user id."""
NEXT_ITEM_LABEL = "next_item"
"""Retrieval's one label: 1 for the candidate that is the user's next item, 0 for a negative."""


def label_names(data_cfg, task_kind: str = "ranking") -> list[str]:
    """The names of the ``K`` label columns of ``Batch.labels`` for a ``DataConfig``, in order."""
    if task_kind == "retrieval":
        return [NEXT_ITEM_LABEL]
    if data_cfg.source == "parquet":
        from freescale.data.sample_files import Manifest

        return list(Manifest.load(data_cfg.path).labels)
    if data_cfg.source == "synthetic":
        return ["click", "liked"][: data_cfg.synthetic.num_labels]
    thresholds = [data_cfg.ratings.positive_rating, *data_cfg.ratings.more_labels]
    return [f"rating>={t:g}" for t in thresholds]
