"""The planner: an analytical model of inference jobs on hardware profiles.

* ``inputs.py``      what is planned (model, workload, layout: ``PlanInput``) and the alternative layout;
* ``cost_model.py``  ``Planner``: FLOPs, bytes, memory, TTFT/TPOT/TPS of a layout (Note [The cost model]);
* ``prediction.py``  what it says (``Prediction``) and its findings;
* ``hardware.py``    ``HardwareProfile`` (``megatron_ring/profiles/*.json``);
* ``plan_cli.py``    ``megatron-ring plan``; ``plan_table.py`` its tables; ``comm_figure.py`` ``--comm-figure``;
* ``measured.py``    predicted vs measured ``bench attention`` points (``plan --measured``);
* ``predict.py``     the planner on an inference config at a workload (the sweep's predictions);
* ``paper_scale.py`` the paper's workload and the largest batch that fits;
* ``calibrate.py``   ``megatron-ring calibrate``: a hardware profile measured on this machine.
"""
