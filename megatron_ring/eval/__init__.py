"""Long-context quality at any layout: an lm-evaluation-harness model over the ring, needle-in-a-haystack
heatmaps, loss by position. It composes ``inference/`` (runners) and ``datasets/``; nothing below imports it."""
