"""Performance: the planner, the benchmarks and the sweep, each a package; ``report.py`` their shared tables.

* ``planner/``  the cost model (``megatron-ring plan``), hardware profiles (``megatron_ring/profiles/*.json``),
  ``megatron-ring calibrate``, predictions of inference runs, the paper-scale table, the comm figure;
* ``bench/``    one shared harness (timing, peak memory, the machine, gloo pools) and one file per
  benchmark: ``megatron-ring bench attention | numerics | compile``, ``python -m
  megatron_ring.perf.bench.block``, ``python -m megatron_ring.perf.bench.gather``, and the prepared GPU
  check (``bench/device_check.py``, ``scripts/gpu_check.sh``);
* ``sweep/``    ``megatron-ring sweep``: a pair over prompt lengths, repeated, its plots and the planner's errors;
* ``report.py`` tables (rich or Markdown) and number formats.

Bytes and times of one attention call are the core's (``costs/traffic.py``,
``costs/comm_choice.py``), so the planner, ``comm="auto"`` and the benchmarks count alike.
"""
