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


def test_under_the_replica_layer_each_pipeline_is_a_subclass_of_the_plain_one_chosen_at_build_time():
    from pathlib import Path

    import freescale.embedding.pipeline as schedules
    import freescale.train.pipelines as pipelines
    from freescale.embedding.replicated import PIPELINES as REPLICATED_SCHEDULES
    from freescale.train.pipelines import PIPELINES, REPLICATED, pipeline_class

    assert set(REPLICATED) == set(PIPELINES) - {"base"}
    for name, cls in REPLICATED.items():
        assert pipeline_class(name, True) is cls and pipeline_class(name, False) is PIPELINES[name]
        plain = PIPELINES["sparse_dist" if name == "pec" else name]  # (ReplicaPEC: ReplicaSparseDist's over PEC's modules)
        assert cls is not plain and issubclass(cls, plain) and cls.table_kind is PIPELINES[name].table_kind, name
    for name, cls in REPLICATED_SCHEDULES.items():
        assert cls is not schedules.PIPELINES[name] and issubclass(cls, schedules.PIPELINES[name]), name
    with pytest.raises(ValueError, match="base does not run under the replica layer"):
        pipeline_class("base", True)
    # No schedule asks whether the layer is there: its variant overrides the hooks instead.
    for module in (schedules, pipelines):
        assert "enabled" not in Path(module.__file__).read_text(), module.__name__


def test_the_trainer_never_asks_which_pipeline_or_tables_it_has():
    from pathlib import Path

    import freescale.train.trainer as trainer

    source = Path(trainer.__file__).read_text()
    for branch in ("cfg.train.pipeline", "OWNED_PIPELINES", "owned", "build_owned_model", "SeqRecModel"):
        assert branch not in source, branch
