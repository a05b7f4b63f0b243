"""The shipped configs: ``deepspeed/`` (JSON for the deepspeed launcher) and ``megatron/`` (GPT YAML). Data only."""
