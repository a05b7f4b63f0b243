"""DeepSpeed integration: config split and validation, process groups under its launcher, its engines.

Files:

* ``config.py``           split off our ``megatron_ring`` section; DeepSpeed's inference keys checked by DeepSpeed;
* ``process_group.py``    torch.distributed from the launcher's environment; DeepSpeed's comm backend over it;
* ``inference_engine.py`` ``deepspeed.init_inference`` for a model that is already tensor-parallel;
* ``mpu.py``              our groups as the ``mpu`` of DeepSpeed's training engine (gradients over dp x cp);
* ``autotp.py``           DeepSpeed AutoTP on a transformers model on our TP group (TP x CP).
"""
