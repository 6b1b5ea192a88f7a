"""Transports for collectives without a reduction (all-to-all, all-gather), chosen by ``transport.kind``."""
