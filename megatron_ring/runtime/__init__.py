"""Process-level helpers shared by inference and training: lost-rank monitor, reporting."""
