"""Rank-aware console logging: lines start with ``[r{replica}/{rank}]`` or ``[r{replica}/{rank} step N]``.

Pass the step as ``logger.info(msg, extra={"step": n})``.
"""

from __future__ import annotations

import logging
import sys

_LOGGER_NAME = "freescale"


class _RankFilter(logging.Filter):
    def __init__(self, replica: int, rank: int) -> None:
        super().__init__()
        self.tag = f"r{replica}/{rank}"

    def filter(self, record: logging.LogRecord) -> bool:
        step = getattr(record, "step", None)
        record.rank_tag = self.tag if step is None else f"{self.tag} step {step}"
        return True


def setup_logging(replica: int = 0, rank: int = 0, all_ranks: bool = False) -> logging.Logger:
    """Configure the package logger; ranks other than 0 log warnings only unless all_ranks."""
    logger = logging.getLogger(_LOGGER_NAME)
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.addFilter(_RankFilter(replica, rank))
    handler.setFormatter(logging.Formatter("[%(rank_tag)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if (rank == 0 or all_ranks) else logging.WARNING)
    logger.propagate = False
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger(_LOGGER_NAME)
