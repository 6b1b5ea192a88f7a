"""Which two runs ``freescale verify`` can compare, decided from their configs alone: the command
checks its arguments with these before it imports torch, so a mistake is one line at once.

``TABLES_OF`` names the tables each ``train.pipeline`` trains, as its pipeline class's
``table_kind`` describes them (``freescale.train.tables``; a unit test holds the two alike)."""

from __future__ import annotations

from freescale.config import OWNED_PIPELINES, ConfigError, ExperimentConfig

TABLES_OF = {"sparse_dist": "TorchRec's tables", "base": "TorchRec's tables", "pec": "TorchRec's tables",
             **{name: "FreeScale's own tables" for name in OWNED_PIPELINES}}
"""Each ``train.pipeline``: the tables it trains."""

SHARED_BY_BOTH_RUNS = ("run.device", "train.backend", "run.threads")
"""Settings of the job itself: run B cannot take another value of these."""


def pipeline_pair(text: str) -> tuple[str, str]:
    """``A,B``: two different pipelines over the same kind of tables; raises a ConfigError
    naming what is wrong otherwise."""
    names = [name.strip() for name in text.split(",")]
    known = ", ".join(TABLES_OF)
    if len(names) != 2 or not all(names):
        raise ConfigError(f"--pipelines: expected two pipelines as A,B (of: {known}), got {text!r}")
    a, b = names
    for name in names:
        if name not in TABLES_OF:
            raise ConfigError(f"--pipelines: unknown pipeline {name!r} (expected one of: {known})")
    if a == b:
        raise ConfigError(f"--pipelines: {a} twice: expected two different pipelines")
    if TABLES_OF[a] != TABLES_OF[b]:  # (pec's tables are TorchRec's)
        raise ConfigError(f"--pipelines: {a} trains {TABLES_OF[a]} and {b} {TABLES_OF[b]}: "
                          f"verify compares two pipelines over the same kind of tables")
    return a, b


def check_runs(a: ExperimentConfig, b: ExperimentConfig) -> None:
    """Raise a ConfigError unless runs ``a`` and ``b`` can be compared on this job's ranks."""
    pipeline_pair(f"{a.train.pipeline},{b.train.pipeline}")
    for cfg in (a, b):
        if cfg.ft.enable:
            raise ConfigError("ft.enable: freescale verify trains both runs on the same ranks, without the replica "
                              "layer (set ft.enable=false)")
    for key in SHARED_BY_BOTH_RUNS:
        section, name = key.split(".")
        if getattr(getattr(a, section), name) != getattr(getattr(b, section), name):
            raise ConfigError(f"{key}: both runs share the job's {', '.join(SHARED_BY_BOTH_RUNS)}; run B cannot "
                              f"change them")
