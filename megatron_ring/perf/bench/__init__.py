"""The benchmarks: one shared harness and one file per benchmark.

* ``harness.py``           timing, peak memory, the machine's description, gloo pools;
* ``attention.py``         ``megatron-ring bench attention`` (``attention_worker.py`` the ranks' side,
  ``attention_report.py`` its tables and plots);
* ``numerics.py``          ``megatron-ring bench numerics``: error vs float64 as the ring grows;
* ``compile.py``           ``megatron-ring bench compile``: eager vs ``torch.compile``;
* ``train_memory.py``      ``megatron-ring bench train-memory``: the longest sequence a Megatron GPT trains
  under a memory cap per process, by cp (``train_memory_worker.py`` the ranks' side,
  ``train_memory_report.py`` its table and plot, ``memory_cap.py`` the cap, ``length_search.py`` the search);
* ``block.py``             the block kernel on one device (``python -m megatron_ring.perf.bench.block``);
* ``gather.py``            gloo's all-gather vs pairwise transfers (``python -m megatron_ring.perf.bench.gather``);
* ``device_check.py``      the prepared device check (``scripts/gpu_check.sh``): ``device_checks.py`` its
  single-process checks, ``device_ring.py`` two ranks on one GPU.
"""
