"""``megatron-ring sweep``: a baseline and a ring config over prompt lengths, repeated, with the planner's errors.

* ``cli.py``      the command and its flags (``sweep_main``);
* ``points.py``   the points and each side's derived config per point;
* ``run.py``      the runs, their provenance, ``run_sweep``, ``write_outputs``, ``repredict``;
* ``summary.py``  medians, ratios, crossovers, predictions and their errors;
* ``schema.py``   ``sweep.json`` (``SweepResult``);
* ``table.py``    the text tables; ``plots.py`` the PNG plots.
"""
