"""The names of a batch's sparse features, shared by the batches and the models (no TorchRec here)."""

UIH_FEATURE = "uih_item"
"""Sequence feature: the item ids of each sample's user interaction history."""
CANDIDATE_FEATURE = "cand_item"
"""Sequence feature: the item ids of each sample's candidates (same table as the UIH)."""
USER_FEATURE = "user_id"
"""Pooled feature: the hashed user id."""
