"""FreeScale: a distributed trainer for sequence recommendation models on TorchRec."""

__version__ = "0.1.0"
