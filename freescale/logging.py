"""Rank-aware logging: lines start with ``[r{replica}/{rank}]`` or ``[r{replica}/{rank} step N]``.

Pass the step as ``logger.info(msg, extra={"step": n})``. The console shows rank 0's lines
(every rank's warnings); ``log_to_file`` adds a per-rank file that keeps every line of its
rank with a timestamp, and the tracebacks that the console leaves out
(``extra={"file_only": True}``).
"""

from __future__ import annotations

import logging
import os
import sys

_LOGGER_NAME = "freescale"
LOG_DIR = "logs"


class _RankFilter(logging.Filter):
    def __init__(self, replica: int, rank: int) -> None:
        super().__init__()
        self.tag = f"r{replica}/{rank}"

    def filter(self, record: logging.LogRecord) -> bool:
        step = getattr(record, "step", None)
        record.rank_tag = self.tag if step is None else f"{self.tag} step {step}"
        return True


class _ConsoleFilter(_RankFilter):
    def __init__(self, replica: int, rank: int, level: int) -> None:
        super().__init__(replica, rank)
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        super().filter(record)
        return record.levelno >= self.level and not getattr(record, "file_only", False)


def setup_logging(replica: int = 0, rank: int = 0, all_ranks: bool = False) -> logging.Logger:
    """Configure the package logger; ranks other than 0 show warnings only unless all_ranks."""
    logger = logging.getLogger(_LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    handler = logging.StreamHandler(sys.stdout)
    handler.addFilter(_ConsoleFilter(replica, rank, logging.INFO if (rank == 0 or all_ranks) else logging.WARNING))
    handler.setFormatter(logging.Formatter("[%(rank_tag)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


def log_file_path(run_dir: str, replica: int, rank: int) -> str:
    return os.path.join(run_dir, LOG_DIR, f"replica{replica}-rank{rank}.log")


def log_to_file(path: str, replica: int, rank: int) -> logging.Handler:
    """Also write every line of this rank (tracebacks included) to ``path``; close the handler to stop."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = _ClosingFileHandler(path)
    handler.addFilter(_RankFilter(replica, rank))
    handler.setFormatter(logging.Formatter("%(asctime)s [%(rank_tag)s] %(message)s"))
    logging.getLogger(_LOGGER_NAME).addHandler(handler)
    return handler


class _ClosingFileHandler(logging.FileHandler):
    def close(self) -> None:
        logging.getLogger(_LOGGER_NAME).removeHandler(self)
        super().close()


def get_logger() -> logging.Logger:
    return logging.getLogger(_LOGGER_NAME)


KNOWN_HARMLESS = (
    # torch.export asks torch.fx whether it is tracing; torch.fx warns that the answer covers both.
    ("torch.fx._symbolic_trace", "is_fx_tracing will return true for both fx.symbolic_trace and torch.export"),
)
KNOWN_HARMLESS_WARNINGS = (
    # TorchRec's sharded tables are ShardedTensors; DCP warns at every one it saves or loads.
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor"),
)


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_known_warnings() -> None:
    """Silence the third-party warnings known to be harmless here (``KNOWN_HARMLESS``, each by
    its logger and text; ``KNOWN_HARMLESS_WARNINGS``, each by its category and text); every
    other warning stays."""
    import warnings

    for name, text in KNOWN_HARMLESS:
        logging.getLogger(name).addFilter(_DropMessage(text))
    for category, text in KNOWN_HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=text, category=category)
