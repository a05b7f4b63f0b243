"""The ``--model_args`` of the lm-eval model ``megatron_ring``, checked before any rank starts or any weight loads.

One schema (:class:`HarnessArgs`, unknown keys refused with a did-you-mean) serves the model on
every rank and ``megatron-ring lm-eval`` before its launch (:func:`check_harness_args`), so a bad
checkpoint, a cp that does not fit the model or a ``max_length`` over its window is named once,
before any process group exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from pydantic import Field

from megatron_ring.config import ConfigError, StrictModel
from megatron_ring.inference.schema import runner_module
from megatron_ring.parallel.layout import ParallelLayout

WHERE = "lm-eval --model_args of megatron_ring"


class HarnessArgs(StrictModel):
    """``--model_args checkpoint=...,cp=2,...`` of ``lm_eval --model megatron_ring``."""

    checkpoint: str = Field(..., description="a transformers checkpoint: directory, .gguf file or package:<module>")
    gguf_file: Optional[str] = Field(None, description="the .gguf file inside a directory or package checkpoint")
    runner: Literal["hf", "megatron"] = Field("hf", description="hf: transformers with the ring (tp by AutoTP); "
                                              "megatron: the checkpoint converted to Megatron-core's GPTModel")
    tp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1, description="pipeline stages (megatron runner only)")
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    max_length: Optional[int] = Field(None, ge=2, description="longest request in tokens (default: the model's "
                                      "window); a longer request is an error, never truncated")
    max_gen_toks: int = Field(256, ge=1, description="generate_until's default new tokens")
    batch_size: int = Field(1, ge=1, description="requests per forward (rows right-padded, Note [Right padding "
                            "for scores])")
    collective_timeout_s: float = Field(1800.0, gt=0, description="a stalled rank ends the run after this long")

    def layout(self) -> ParallelLayout:
        return ParallelLayout(tp=self.tp, cp=self.cp, pp=self.pp)

    def model(self) -> dict[str, Any]:
        """The runner's model mapping (``megatron_ring.model.config`` of an inference config)."""
        source = {"checkpoint": self.checkpoint, **({"gguf_file": self.gguf_file} if self.gguf_file else {})}
        if self.runner == "hf":
            return source
        return {**source, "dtype": self.dtype, "attention": "ring" if self.cp > 1 else "sdpa",
                "parallel": {"tp": self.tp, "pp": self.pp, "cp": self.cp}}


@dataclass(frozen=True)
class CheckedArgs:
    """Arguments that passed :func:`check_harness_args`: the parsed args, the layout, the runner's model
    mapping and summary, and the longest request in tokens."""

    args: HarnessArgs
    layout: ParallelLayout
    model: dict[str, Any]
    summary: dict[str, Any]
    max_length: int


def parse_harness_args(given: dict[str, Any]) -> HarnessArgs:
    """:class:`HarnessArgs` of lm-eval's parsed ``--model_args`` plus its ``batch_size``/``device`` extras.

    lm-eval passes ``batch_size`` as given on its command line (``"4"``) and ``device``; ``auto``
    sizes are refused (every rank must batch alike), ``device`` is left to the launcher.
    """
    given = {k: v for k, v in given.items() if v is not None and k not in ("device", "max_batch_size")}
    size = given.get("batch_size")
    if isinstance(size, str):
        if not size.isdigit():
            raise ConfigError(f"batch_size = {size!r}: allowed: a positive integer (every rank must batch the same "
                              "requests, so 'auto' is not offered)", where=WHERE)
        given["batch_size"] = int(size)
    return HarnessArgs.parse(given, where=WHERE)


def check_harness_args(args: HarnessArgs, *, world_size: Optional[int] = None) -> CheckedArgs:
    """Check ``args`` against the checkpoint and the world (``WORLD_SIZE``; None: not known yet) without
    loading weights; ConfigError naming the field otherwise."""
    layout = args.layout()
    if world_size is not None and world_size != layout.world_size:
        raise ConfigError(f"tp * cp * pp = {args.tp} * {args.cp} * {args.pp} = {layout.world_size} but the launcher "
                          f"started {world_size} processes; start tp * cp * pp of them", where=WHERE)
    model = args.model()
    module = runner_module(args.runner)
    try:  # lengths are checked below, against max_length
        summary = module.check_model(model, layout, batch=args.batch_size, prompt_len=2, new_tokens=1,
                                     dtype=args.dtype)
    except ConfigError as err:
        raise ConfigError(f"checkpoint, runner, tp, cp, pp as an inference config's model and layout: {err}",
                          where=WHERE) from None
    window = summary.get("max_position_embeddings") or summary.get("seq_length")
    if args.max_length is not None and window is not None and args.max_length > window:
        raise ConfigError(f"max_length = {args.max_length} exceeds the model's window of {window} tokens", where=WHERE)
    max_length = args.max_length or window
    if max_length is None:
        raise ConfigError(f"the checkpoint {args.checkpoint!r} names no window (max_position_embeddings); "
                          "give max_length", where=WHERE)
    if args.runner == "megatron" and max_length % (2 * args.cp):
        raise ConfigError(f"max_length = {max_length}: the megatron runner needs a multiple of 2 * cp = "
                          f"{2 * args.cp} (zigzag sharding); give max_length = {max_length - max_length % (2 * args.cp)}",
                          where=WHERE)
    return CheckedArgs(args, layout, model, summary, max_length)
