"""Adapters into the tools users already run (TRL, PyTorch distributed)."""
