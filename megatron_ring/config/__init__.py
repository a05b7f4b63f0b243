"""Validated configuration schemas (pydantic) shared by every entry point.

Files:

* ``strict.py``  the strict base model (unknown keys rejected with a did-you-mean, no type coercion),
  :class:`Problems` (every problem of a config in one error), file loading, output paths;
* ``layout.py``  :class:`LayoutConfig`, the one layout schema;
* ``gpt.py``     the GPT model files of ``configs/megatron`` (sizes, or a transformers checkpoint);
* ``checkpoint.py`` where a transformers checkpoint is (the hf runner; a GPT model file's weights);
* ``shipped.py`` finding a config: relative to the working directory, else the shipped one.
"""
from megatron_ring.config.strict import (MAX_TIMEOUT_S, ConfigError, Problems, StrictModel, TimeoutSeconds,
                                         check_writable, load_mapping, load_model, output_problem)

__all__ = ["MAX_TIMEOUT_S", "ConfigError", "Problems", "StrictModel", "TimeoutSeconds", "check_writable", "load_mapping", "output_problem",
           "load_model"]
