"""Helpers for tests and CPU demos: gloo worker pools, fake process groups, float64 references.

Nothing here is imported by the library itself.
"""
