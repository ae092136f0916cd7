"""`sweep serve`: the live sweep page (analysis.serve.app) and its data (analysis.serve.snapshot)."""

from analysis.serve.snapshot import ServeOptions, SweepView

__all__ = ["ServeOptions", "SweepView"]
