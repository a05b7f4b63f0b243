"""Schema of the ``megatron_ring`` section of an inference config (pydantic).

A config file for ``launch/infer.py`` is DeepSpeed's inference JSON plus one section of ours::

    {
      "dtype": "bf16",                          <- DeepSpeed's keys, validated by DeepSpeed
      "replace_with_kernel_inject": false,
      "megatron_ring": {                        <- ours, validated here
        "model":    {"runner": "megatron", "config": "../megatron/paper_dense_ring_cp16.yaml"},
        "layout":   {"tp": 1, "cp": 16, "dp": 1, "pp": 1},
        "workload": {"batch": 128, "prompt_len": 100000, "new_tokens": 64,
                     "warmup": 1, "repeats": 3, "seed": 1234},
        "output":   "results/paper_ring_cp16.json"
      }
    }

:func:`megatron_ring.integrations.deepspeed.config.split_config` separates the two. Everything here is
checked before any process group or model exists: unknown keys (with a did-you-mean) and strict
types (``"batch": true`` or ``"prompt_len": "48"`` are errors), the layout against the launched
world size, the workload against the layout (zigzag needs ``prompt_len`` divisible by ``2*cp``),
the output location (written to and removed), and the model against all of them, DeepSpeed's
``dtype`` included, through the runner's ``check_model``. Every problem found is reported at once.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Optional, Union

from pydantic import Field

from megatron_ring.attention.sharding import check_divisible
from megatron_ring.config import ConfigError, Problems, StrictModel, TimeoutSeconds, check_writable, load_mapping
from megatron_ring.config.layout import LayoutConfig
from megatron_ring.inference.prompts import Document, TextSection, find_file, load_documents
from megatron_ring.integrations.deepspeed.config import SECTION
from megatron_ring.parallel.layout import ParallelLayout

RUNNERS: dict[str, str] = {
    "megatron": "megatron_ring.inference.runners.gpt",
    "toy": "megatron_ring.inference.runners.toy",
    "hf": "megatron_ring.inference.runners.hf",
}
"""``model.runner`` name -> module providing ``check_model`` and ``build_runner``
(see :class:`megatron_ring.inference.runners.protocol.RunnerModule`)."""


class ModelSection(StrictModel):
    """Which runner builds the model, and the model's own description."""

    runner: str = Field("megatron", description=f"one of {sorted(RUNNERS)}")
    config: Union[str, dict[str, Any]] = Field(
        ..., description="path of a model YAML/JSON (relative to this config file's directory, then to the "
        "working directory), or the mapping itself")


class WorkloadSection(StrictModel):
    """What one measured request is: ``batch`` prompts of ``prompt_len`` tokens, ``new_tokens`` generated.

    Every data-parallel replica serves the same batch, so the job processes ``dp * batch`` sequences.
    The first new token comes from prefill, the other ``new_tokens - 1`` from decode steps.
    """

    batch: int = Field(..., ge=1)
    prompt_len: int = Field(..., ge=1)
    new_tokens: int = Field(..., ge=2, description="tokens generated per sequence, >= 2 so that decode runs")
    warmup: int = Field(1, ge=0, description="untimed requests before the measured ones")
    repeats: int = Field(3, ge=1, description="measured requests; metrics are their median")
    seed: int = Field(1234, description="seeds the weights and the prompt tokens")
    text: Optional[TextSection] = Field(
        None, description="real text prompts, one document per row, fitted to prompt_len (runners with a "
        "tokenizer); None: random token ids")


class RingSection(StrictModel):
    """The whole ``megatron_ring`` section."""

    description: Optional[str] = Field(None, description="free text, copied into the result")
    model: ModelSection
    layout: LayoutConfig
    workload: WorkloadSection
    output: Optional[str] = Field(None, description="result JSON path; None prints only")
    serve: Optional[dict[str, Any]] = Field(None, description="settings of megatron-ring serve, checked by it "
                                                               "(serving/schema.py)")
    collective_timeout_s: TimeoutSeconds = Field(300.0, description="timeout of every collective")
    peer_timeout_s: TimeoutSeconds = Field(
        20.0, description="a peer silent this long is declared lost and the job stops")


class InferenceSpec:
    """A validated config: our section, DeepSpeed's part, the model mapping and its summary."""

    def __init__(self, ring: RingSection, deepspeed: dict[str, Any], model: dict[str, Any],
                 model_summary: dict[str, Any], path: Path | None, output: str | None,
                 documents: list[Document] | None = None) -> None:
        self.ring = ring
        self.documents = documents
        """The text of each prompt row (``workload.text``), None for random prompts."""
        self.deepspeed = deepspeed
        self.model = model
        self.model_summary = model_summary
        self.path = path
        self.output = output
        """The result JSON path (``--output``, else ``megatron_ring.output``); None prints only."""

    @property
    def layout(self) -> ParallelLayout:
        return self.ring.layout.layout()

    @property
    def name(self) -> str:
        """The config file's stem (``cpu_ring_cp4``), or ``inline``."""
        return self.path.stem if self.path else "inline"


def runner_module(name: str) -> Any:
    """Import the module of runner ``name``; ConfigError naming the allowed runners otherwise."""
    if name not in RUNNERS:
        raise ConfigError(f"megatron_ring.model.runner = {name!r}: unknown runner; allowed: {sorted(RUNNERS)}")
    try:
        return importlib.import_module(RUNNERS[name])
    except ModuleNotFoundError as err:
        raise ConfigError(
            f"megatron_ring.model.runner = {name!r} needs module {RUNNERS[name]} which cannot be imported: {err}"
        ) from err


def find_model_file(given: str, base: Path | None) -> Path:
    """The model file named by ``model.config``: absolute, else relative to ``base`` (the directory of
    the config file, so configs work from any working directory), then to the working directory."""
    return find_file(given, base, f"{SECTION}.model.config")


def load_model_mapping(section: ModelSection, base: Path | None) -> dict[str, Any]:
    """The model description: the inline mapping, or the file it names (:func:`find_model_file`)."""
    if isinstance(section.config, dict):
        return dict(section.config)
    return load_mapping(find_model_file(section.config, base))


def validate(ring_data: Any, deepspeed: dict[str, Any], *, world_size: int, dtype: Optional[str],
             path: Path | None = None, output: Optional[str] = None) -> InferenceSpec:
    """Validate our section against itself, the world size and the model; build nothing.

    ring_data: the raw ``megatron_ring`` mapping; deepspeed: the rest of the config (checked
    against our layout here, against DeepSpeed's schema by the DeepSpeed integration); dtype: the
    dtype DeepSpeed's part selects (``fp32``, ``bf16``, ``fp16``), which the model must share, or
    None when DeepSpeed's part was rejected; output: the ``--output`` flag, which replaces
    ``megatron_ring.output``. Raises :class:`ConfigError` with every problem it finds.
    """
    problems = Problems()
    ring = problems.run(RingSection.parse, ring_data, where=None, key=SECTION)
    if ring is None:
        problems.raise_if_any()
    layout = ring.layout.layout()
    try:
        layout.check_world_size(world_size)
    except ValueError as err:
        problems.add(f"{SECTION}.layout: {err}")
    work = ring.workload
    try:
        check_divisible(work.prompt_len, layout.cp, "zigzag", what=f"{SECTION}.workload.prompt_len")
    except ValueError as err:
        problems.add(str(err))
    ds_tp = (deepspeed.get("tensor_parallel") or {}).get("tp_size")
    if ds_tp is not None and ds_tp != layout.tp:
        problems.add(f"tensor_parallel.tp_size = {ds_tp} disagrees with {SECTION}.layout.tp = {layout.tp}; "
                     "set them equal (or drop tensor_parallel: the layout is what the model uses)")
    target = output if output is not None else ring.output
    if target is not None:
        problems.run(check_writable, Path(target), field="--output" if output is not None else f"{SECTION}.output",
                     value=target)
    documents = None
    if work.text is not None:
        documents = problems.run(load_documents, work.text, path.parent if path else None)
        if documents is not None and len(documents) != work.batch:
            problems.add(f"{SECTION}.workload.batch = {work.batch} but {SECTION}.workload.text gives "
                         f"{len(documents)} documents; one row per document: make them equal")
    module = problems.run(runner_module, ring.model.runner)
    model = problems.run(load_model_mapping, ring.model, path.parent if path else None)
    takes_text = getattr(module, "takes_text", None)
    if work.text is not None and module is not None and model is not None and not (takes_text and takes_text(model)):
        problems.add(f"{SECTION}.workload.text needs a model with a tokenizer (the hf runner, or the megatron runner "
                     f"with a checkpoint); {SECTION}.model (runner {ring.model.runner!r}) serves random weights: "
                     "drop text")
    summary = None
    if module is not None and model is not None:
        summary = problems.run(module.check_model, model, layout, batch=work.batch, prompt_len=work.prompt_len,
                               new_tokens=work.new_tokens, dtype=dtype)
    problems.raise_if_any()
    return InferenceSpec(ring, deepspeed, model, summary, path, target, documents)
