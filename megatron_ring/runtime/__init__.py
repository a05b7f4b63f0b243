"""Process-level helpers shared by inference, training and the benchmarks.

Files:

* ``faults.py``    :class:`PeerMonitor`: a lost or stalled rank ends the job, naming the rank;
* ``reporting.py`` peak memory, atomic JSON result files, progress bars;
* ``pool.py``      :class:`GlooPool`: a function run on N CPU ranks over loopback;
* ``args.py``      command-line value types (``positive_int`` ...) and the one-line usage error (stdlib only,
  so the torch-only entry points, ``demo`` and the benchmarks, need no pydantic).
"""
