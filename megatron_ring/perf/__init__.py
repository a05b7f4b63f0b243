"""Performance: the planner's cost model, hardware profiles, benchmarks and their reports.

Files:

* ``cost_model.py``      FLOPs, bytes, memory and TTFT/TPOT/TPS of a layout on a hardware profile;
* ``plan_cli.py``        ``megatron-ring plan``;
* ``predict.py``         the cost model on an inference config at a workload (the sweep's predictions);
* ``calibrate.py``       ``megatron-ring calibrate``: a hardware profile measured on this machine;
* ``paper_scale.py``     the planner table of the paper's workload and of the largest batch that fits;
* ``sweep.py``           ``megatron-ring sweep``: a pair over prompt lengths, repeated; ``sweep_plots.py`` its plots;
* ``hardware.py``        hardware profiles (``profiles/*.json``);
* ``bench_attention.py`` ring vs all-gather vs one process vs DeepSpeed Ulysses on gloo ranks;
* ``bench_block.py``     the block kernel vs torch's attention on one device;
* ``bench_numerics.py``  error vs float64 as the ring grows;
* ``report.py``          tables and Markdown of the above.
"""
