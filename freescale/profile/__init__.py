"""Bubble profiling: step timelines, their decomposition, and the report."""
