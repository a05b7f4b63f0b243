"""Datasets built from local text for fine-tuning and evaluation (standard library only)."""
