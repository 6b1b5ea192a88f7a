"""The training a config names, built in one place: the model, its optimizer and the pipeline.

``build_training`` looks ``train.pipeline`` up once (its replicated variant when ``ft.enable``
is on: ``pipeline_class``); the pipeline's table
kind (``freescale.train.tables``) builds the model and its optimizer. The rest follows in the
trainer's order: a checkpoint is loaded into the model and the optimizer, the replica layer is
built over their dense part and the tables (``dense_parameters``, ``dense_optimizer``,
``table_side``), and the pipeline over the replica layer (``build_pipeline``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from freescale.config import ExperimentConfig
from freescale.data.batch import SideLayout
from freescale.distributed import Topology
from freescale.model.sharding import dense_parameters
from freescale.train.pipelines import PIPELINES, TrainPipeline, pipeline_class


def check_device(cfg: ExperimentConfig, device: torch.device) -> None:
    """Raise a ConfigError if the tables of ``train.pipeline`` cannot run on ``device``."""
    PIPELINES[cfg.train.pipeline].table_kind.check_device(cfg.train.pipeline, device)


@dataclass
class Training:
    """The model and optimizer a pipeline class trains, and what the replica layer and the
    pipeline are built from."""

    cfg: ExperimentConfig
    model: nn.Module
    optimizer: object
    pipeline_class: type

    @property
    def dense_module(self) -> nn.Module:
        """The module of the dense layers (straggler injection delays its forward)."""
        return self.pipeline_class.table_kind.dense_module(self.model)

    @property
    def task(self) -> nn.Module:
        """The model's task (``flops`` counts a batch's model FLOPs: ``freescale.model.flops``)."""
        return self.pipeline_class.table_kind.task(self.model)

    def dense_parameters(self) -> list[nn.Parameter]:
        return dense_parameters(self.dense_module)

    @property
    def dense_optimizer(self):
        """The optimizer of the dense parameters alone."""
        return self.pipeline_class.table_kind.dense_optimizer(self.optimizer)

    def table_side(self):
        """What the replica layer does with the tables across the groups (None without the layer)."""
        if not self.cfg.ft.enable:
            return None
        return self.pipeline_class.table_kind.table_side(self.cfg, self.model)

    def build_pipeline(self, device: torch.device, timeline, *, group, replica) -> TrainPipeline:
        """The pipeline; ``timeline`` receives its phase spans, ``replica`` votes on its steps
        (the replicated variant's; a plain pipeline takes none)."""
        return self.pipeline_class.build(self.model, self.optimizer, device, timeline, group=group,
                                         transport_cfg=self.cfg.transport, replica=replica, train_cfg=self.cfg.train)


def build_training(cfg: ExperimentConfig, *, num_items: int, topology: Topology, device: torch.device,
                   side_layout: SideLayout = SideLayout()) -> Training:
    """The model (its tables sharded over the replica's ranks; ``side_layout``: the source's side
    features, of which it reads ``model.side_features``) and its optimizer, for ``train.pipeline``."""
    chosen = pipeline_class(cfg.train.pipeline, cfg.ft.enable)
    tables = chosen.table_kind
    model = tables.build_model(cfg, num_items=num_items, topology=topology, device=device, side_layout=side_layout)
    return Training(cfg, model, tables.build_optimizer(model, cfg.train), chosen)
