import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _no_gpu_reason() -> str | None:
    """Why the ``gpu`` tests cannot run here (None: they can)."""
    if torch.version.cuda is None:
        return f"needs a CUDA GPU: torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _no_gpu_reason()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
