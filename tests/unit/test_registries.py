"""Every config choice that names an implementation lists exactly its registry's keys."""

import typing

import pytest

from freescale import config


def choices(section: type, field: str) -> set[str]:
    hint = typing.get_type_hints(section)[field]
    return set(typing.get_args(hint))


def registries():
    from freescale.balance.partition import PARTITIONS
    from freescale.model.sharding import DENSE_OPTIMIZERS, EMBEDDING_OPTIMIZERS, SHARDING_TYPES
    from freescale.train.pipelines import PIPELINES
    from freescale.transport.registry import TRANSPORTS

    return [
        (config.TransportConfig, "kind", set(TRANSPORTS)),
        (config.BalanceConfig, "partition", set(PARTITIONS)),
        (config.TrainConfig, "pipeline", set(PIPELINES)),
        (config.TrainConfig, "optimizer", set(DENSE_OPTIMIZERS)),
        (config.EmbeddingConfig, "optimizer", set(EMBEDDING_OPTIMIZERS)),
        (config.EmbeddingConfig, "sharding", set(SHARDING_TYPES) | {"auto"}),
    ]


@pytest.mark.parametrize("index", range(6))
def test_config_choices_equal_registry_keys(index):
    section, field, keys = registries()[index]
    assert choices(section, field) == keys, f"{section.__name__}.{field}"


def test_every_pipeline_class_has_the_interface_and_names_its_tables():
    from freescale.train.pipelines import PIPELINES, TrainPipeline
    from freescale.train.tables import OWNED_TABLES, PEC_TABLES, TORCHREC_TABLES

    members = {"progress", "drain", "close", "evaluating", "vote"}
    assert members <= set(dir(TrainPipeline))
    for name, cls in PIPELINES.items():
        assert members | {"build", "table_kind"} <= set(dir(cls)), name
        assert cls.table_kind in (TORCHREC_TABLES, PEC_TABLES, OWNED_TABLES), name


def test_the_trainer_never_asks_which_pipeline_or_tables_it_has():
    from pathlib import Path

    import freescale.train.trainer as trainer

    source = Path(trainer.__file__).read_text()
    for branch in ("cfg.train.pipeline", "OWNED_PIPELINES", "owned", "build_owned_model", "SeqRecModel"):
        assert branch not in source, branch
