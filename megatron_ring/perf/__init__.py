"""Performance: the planner's cost model, hardware profiles, benchmarks and their reports.

Files:

* ``cost_model.py``      FLOPs, bytes, memory and TTFT/TPOT/TPS of a layout on a hardware profile;
* ``plan_cli.py``        ``megatron-ring plan``;
* ``hardware.py``        hardware profiles (``profiles/*.json``);
* ``bench_attention.py`` ring vs all-gather vs one process vs DeepSpeed Ulysses on gloo ranks;
* ``bench_block.py``     the block kernel vs torch's attention on one device;
* ``bench_numerics.py``  error vs float64 as the ring grows;
* ``report.py``          tables and Markdown of the above.
"""
