import dataclasses

import pytest
import yaml

from freescale.config import (
    ConfigError,
    ExperimentConfig,
    declared_faults,
    describe,
    dump_yaml,
    field_docs,
    load_config,
    write_config,
)
from helpers.launch import QUICKSTART


def write(tmp_path, text, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_without_file():
    cfg = load_config(None, [])
    assert cfg == ExperimentConfig()


def test_precedence_cli_over_yaml_over_defaults(tmp_path):
    path = write(tmp_path, "train:\n  steps: 50\n  lr: 0.01\ndata:\n  synthetic:\n    num_items: 99\n")
    cfg = load_config(path, ["--train.steps=7", "data.synthetic.sigma=0.5"])
    assert cfg.train.steps == 7  # CLI beats YAML
    assert cfg.train.lr == 0.01  # YAML beats default
    assert cfg.data.synthetic.num_items == 99
    assert cfg.data.synthetic.sigma == 0.5
    assert cfg.data.batch_size == ExperimentConfig().data.batch_size  # default kept


def test_override_values_are_typed_by_the_field():
    cfg = load_config(None, ["--run.name=007", "--train.lr=1", "--model.mlp_dims=[8, 4]", "--model.user_features=false"])
    assert cfg.run.name == "007"
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.model.mlp_dims == [8, 4]
    assert cfg.model.user_features is False


def test_the_transport_lanes_are_auto_unless_told():
    assert load_config(None).transport.lanes == "auto"
    assert load_config(None, ["--transport.lanes=2"]).transport.lanes == 2
    assert load_config(None, ["--transport.lanes=1"]).transport.lanes == 1


def test_numbers_in_exponent_form_without_a_dot_are_numbers():
    cfg = load_config(None, ["--sim.failures_per_rank_hour=1e-5", "--train.lr=5E-3"])
    assert cfg.sim.failures_per_rank_hour == 1e-5 and cfg.train.lr == 5e-3


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["--no.such=1"], "unknown config key 'no.such'"),
        (["--train.stepz=1"], "unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
        (["--data.synthetic.bogus=1"], "unknown config key 'data.synthetic.bogus'"),
        (["--train.steps=abc"], "train.steps: expected an integer, got 'abc'"),
        (["--train.steps=1.5"], "train.steps: expected an integer"),
        (["--model.user_features=1"], "model.user_features: expected true or false"),
        (["--train.lr=fast"], "train.lr: expected a number"),
        (["--model.mlp_dims=wide"], "model.mlp_dims: expected a list of int"),
        (["--model.mlp_dims=[8, x]"], "model.mlp_dims[1]: expected an integer"),
        (["--train.steps=0"], "train.steps: expected a value >= 1, got 0"),
        (["--data.synthetic.affinity=1.5"], "data.synthetic.affinity: expected a value in [0.0, 1.0], got 1.5"),
        (["--train.pipeline=warp"], "train.pipeline: expected one of sparse_dist, base, pec, prioritized, sync; got 'warp'"),
        (["--data=3"], "data: is a section"),
        (["--model.num_heads=3"], "model.num_heads: expected a divisor of model.embedding_dim"),
        (["--data.min_uih_len=9", "--data.max_uih_len=8"], "data.min_uih_len: expected <= data.max_uih_len"),
        (["--data.source=ratings"], "data.ratings.path: required when data.source is ratings"),
        (["--data.source=ratings", "--data.ratings.path=/no/such/ratings.csv"], "data.ratings.path: file not found: /no/such/ratings.csv"),
        (["--checkpoint.resume=/no/such/run"], "checkpoint.resume: folder not found: /no/such/run"),
        (["--train.steps"], "expected --section.key=value"),
        (["--sim.ranks=[8, 0]"], "sim.ranks: expected rank counts >= 1, got [8, 0]"),
        (["--train.lr=1e"], "train.lr: expected a number"),
        (["--faults=[{at_step: x}]"], "faults[0].at_step: expected an integer, got 'x'"),
        (["--faults=[{}, {at_stpe: 3}]"], "unknown config key 'faults[1].at_stpe' (did you mean 'faults[1].at_step'?)"),
        (["--faults=[{at_step: 3, kind: hold}]"], "faults[0].kind: hold holds a replica group at its vote"),
        (["--faults=3"], "faults: expected a list of sections (mappings of keys), got 3"),
        (["--faults.at_step=3"], "unknown config key 'faults.at_step' ('faults' is a list: set it whole"),
        (["--task.kind=retrieval"], "task.kind: retrieval trains next-item prediction with model.kind hstu, got transformer"),
        (["--model.kind=hstu", "--task.eval_ks=[10, 0]"], "task.eval_ks: expected cut-offs >= 1, got [10, 0]"),
        (["--model.kind=rnn"], "model.kind: expected one of transformer, hstu; got 'rnn'"),
        (["--data.synthetic.num_labels=3"], "data.synthetic.num_labels: expected a value in [1, 2], got 3"),
        (["--transport.lanes=3"], "transport.lanes: expected one of auto, 1, 2; got 3"),
        (["--transport.lanes=0"], "transport.lanes: expected one of auto, 1, 2; got 0"),
        (["--dense.sharding=fsdp"], "dense.sharding: fsdp shards the dense part under train.pipeline sync or "
         "prioritized, got sparse_dist"),
        (["--dense.sharding=fsdp", "--train.pipeline=pec"], "dense.sharding: fsdp shards the dense part under "
         "train.pipeline sync or prioritized, got pec"),
        (["--dense.sharding=zero"], "dense.sharding: expected one of replicate, fsdp; got 'zero'"),
        (["--dense.sharding=fsdp", "--train.pipeline=sync", "--model.kind=hstu", "--task.kind=retrieval"],
         "dense.sharding: fsdp needs every rank of a group to run the same layers at every step; task.kind retrieval"),
        (["--transport.lanes=true"], "transport.lanes: expected one of auto, 1, 2; got True"),
        (["--transport.lanes=1.0"], "transport.lanes: expected one of auto, 1, 2; got 1.0"),
        (["--model.kind=hstu", "--task.kind=retrieval", "--task.window_stride=5"],
         "task.window_stride: overlapping windows cut a ratings log's timelines for retrieval; this run is "
         "retrieval on synthetic data"),
        (["--data.source=ml100k", "--task.window_stride=5"], "this run is ranking on ml100k data"),
        (["--data.source=ml100k", "--model.kind=hstu", "--task.kind=retrieval", "--data.max_uih_len=20",
          "--task.window_stride=21"], "task.window_stride: expected <= data.max_uih_len (20: a longer stride"),
    ],
)
def test_errors_name_the_key_and_expectation(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    message = str(e.value)
    assert fragment in message
    assert "\n" not in message


def test_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    bad = write(tmp_path, "train:\n  steps: [1, 2\n")
    with pytest.raises(ConfigError, match=r"malformed YAML at line \d+, column \d+"):
        load_config(bad)
    top = write(tmp_path, "- a\n- b\n", "list.yaml")
    with pytest.raises(ConfigError, match="expected a mapping of sections at the top level"):
        load_config(top)
    section = write(tmp_path, "train: 5\n", "section.yaml")
    with pytest.raises(ConfigError, match="train: expected a mapping of keys"):
        load_config(section)
    unknown = write(tmp_path, "train:\n  stpes: 5\n", "unknown.yaml")
    with pytest.raises(ConfigError, match="unknown config key 'train.stpes'"):
        load_config(unknown)


def test_empty_yaml_is_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == ExperimentConfig()


def test_every_field_is_documented():
    def walk(cls, prefix=""):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{prefix}{f.name} has no docstring"
            if dataclasses.is_dataclass(f.type) or isinstance(f.default_factory, type):
                sub = f.default_factory if isinstance(f.default_factory, type) else None
                if sub is not None and dataclasses.is_dataclass(sub):
                    walk(sub, f"{prefix}{f.name}.")

    walk(ExperimentConfig)
    rows = describe(ExperimentConfig())
    assert ("train.steps", 200, "Total optimizer steps (a resumed run continues up to this count).") in rows


def test_faults_are_a_list_of_fault_sections(tmp_path):
    path = write(tmp_path, "fault:\n  at_step: 5\nfaults:\n  - {at_step: 7, kind: delay, delay_s: 0.5}\n"
                           "  - at_step: 9\n    ranks: [1]\n")
    cfg = load_config(path, [])
    assert [(f.at_step, f.kind, f.ranks) for f in cfg.faults] == [(7, "delay", []), (9, "raise", [1])]
    assert cfg.faults[0].delay_s == 0.5 and cfg.faults[1].during == "step"  # each section's own defaults
    assert [(name, f.at_step) for name, f in declared_faults(cfg)] == [("fault", 5), ("faults[0]", 7), ("faults[1]", 9)]
    out = tmp_path / "config.yaml"
    write_config(cfg, str(out))
    assert load_config(out) == cfg
    assert [f.at_step for f in load_config(path, ["--faults=[{at_step: 3}]"]).faults] == [3]  # the CLI sets the whole list
    assert load_config(None, []).faults == []


def test_written_config_round_trips(tmp_path):
    cfg = load_config(QUICKSTART, ["--train.steps=3", "--model.mlp_dims=[16]"])
    out = tmp_path / "config.yaml"
    write_config(cfg, str(out))
    assert load_config(out) == cfg
    assert yaml.safe_load(dump_yaml(cfg))["train"]["steps"] == 3


SHIPPED = sorted((QUICKSTART.parent).glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_experiments_resolve(path):
    load_config(path, [])


def test_baseline_and_freescale_experiments_differ_only_in_the_techniques():
    base = dataclasses.asdict(load_config(QUICKSTART.parent / "baseline_torchrec.yaml", []))
    ours = dataclasses.asdict(load_config(QUICKSTART.parent / "freescale.yaml", []))
    for section in ("data", "model", "embedding", "checkpoint", "profile", "sim"):
        assert base[section] == ours[section], section
    assert {k: v for k, v in base["train"].items() if k != "pipeline"} == \
           {k: v for k, v in ours["train"].items() if k != "pipeline"}
    assert (base["train"]["pipeline"], base["balance"]["enable"], base["transport"]["kind"]) == \
           ("sparse_dist", False, "torch_dist")
    assert (ours["train"]["pipeline"], ours["balance"]["enable"], ours["transport"]["kind"]) == \
           ("prioritized", True, "host_staged")
    ml = load_config(QUICKSTART.parent / "ml100k.yaml", [])
    assert ml.data.source == "ml100k" and ml.train.pipeline == "prioritized" and ml.balance.enable
