"""What ``freescale export`` and ``freescale serve-bench`` check before they import torch: the
run folder, its checkpoint and config, the destination and the options. A mistake is one line
at once, not after seconds of imports."""

from __future__ import annotations

import os

from freescale.config import ConfigError, ExperimentConfig, load_config
from freescale.train.folders import list_checkpoints

QUANTIZATIONS = {"fp32": "FP32", "fp16": "FP16", "int8": "INT8", "int4": "INT4"}
"""``--quantize`` -> TorchRec's ``DataType`` name."""


class ExportError(Exception):
    """Bad input to ``freescale export`` (one line, exit status 2)."""


def find_checkpoint(run_dir: str, step: int | None) -> tuple[int, str]:
    """(step, folder) of the run's checkpoint at ``step`` (default: the newest)."""
    if not os.path.isdir(run_dir):
        raise ExportError(f"run folder not found: {run_dir}")
    if not os.path.isfile(os.path.join(run_dir, "config.yaml")):
        raise ExportError(f"not a run folder (no config.yaml): {run_dir}")
    found = list_checkpoints(os.path.join(run_dir, "checkpoints"))
    if not found:
        raise ExportError(f"no checkpoint in {run_dir} (expected {run_dir}/checkpoints/step_N; train with "
                          "checkpoint.every or checkpoint.at_end)")
    if step is None:
        return found[-1]
    for s, path in found:
        if s == step:
            return s, path
    raise ExportError(f"--step {step}: no checkpoint of that step in {run_dir} (steps: "
                      f"{', '.join(str(s) for s, _ in found)})")


def exportable_config(run_dir: str) -> ExperimentConfig:
    """The run's config, if its model can be exported."""
    try:
        cfg = load_config(os.path.join(run_dir, "config.yaml"))
    except ConfigError as e:
        raise ExportError(f"{run_dir}/config.yaml: {e}") from None
    if cfg.model.side_features:
        names = ", ".join(f.name for f in cfg.model.side_features)
        raise ExportError(f"{run_dir}: the model reads side features ({names}); serving does not feed them yet, "
                          f"so it cannot be exported")
    return cfg


def check_export(run_dir: str, out: str, step: int | None, quantize: str) -> None:
    """Everything ``export`` can tell wrong from the files alone."""
    check_destination(out, quantize)
    find_checkpoint(run_dir, step)
    exportable_config(run_dir)


def check_destination(out: str, quantize: str) -> None:
    if quantize not in QUANTIZATIONS:
        raise ExportError(f"--quantize: expected one of {', '.join(QUANTIZATIONS)}, got {quantize!r}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ExportError(f"--out {out} exists and is not an empty folder (choose another, or remove it)")


def check_bench(folder: str, batch_sizes: list[int], threads: int | None) -> None:
    """``serve-bench``'s options and its export folder."""
    if any(b < 1 for b in batch_sizes):
        raise ExportError(f"--batch-sizes: expected sizes >= 1, got {batch_sizes}")
    if threads is not None and threads < 1:
        raise ExportError(f"--threads: expected at least 1, got {threads}")
    check_export_folder(folder)


def check_export_folder(folder: str) -> None:
    if not os.path.isfile(os.path.join(folder, "manifest.json")) or not os.path.isfile(os.path.join(folder, "serve.py")):
        raise ExportError(f"not an export folder (no manifest.json and serve.py): {folder}")
