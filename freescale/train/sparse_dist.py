"""TorchRec's ``TrainPipelineSparseDist`` with its input distribution marked on the timeline:
the base of ``sparse_dist``'s pipeline and of ``pec``'s (``freescale.train.pec``)."""

from __future__ import annotations

from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from freescale import compat


class ProfiledSparseDist(TrainPipelineSparseDist):
    """TrainPipelineSparseDist that marks its input-distribution calls on the timeline."""

    def __init__(self, *args, timeline, **kwargs) -> None:
        compat.require_methods(TrainPipelineSparseDist, "start_sparse_data_dist", "wait_sparse_data_dist")
        super().__init__(*args, **kwargs)
        self._timeline = timeline

    def start_sparse_data_dist(self, *args, **kwargs):
        with self._timeline.span("input_dist"):
            return super().start_sparse_data_dist(*args, **kwargs)

    def wait_sparse_data_dist(self, *args, **kwargs):
        with self._timeline.span("input_dist"):
            return super().wait_sparse_data_dist(*args, **kwargs)
