"""Text prompts checked in one process before any rank starts: the tokenizer, its chat template, the room
left for each document, and rows the runner cannot pad (``megatron-ring check``, ``compare``)."""
from __future__ import annotations

from megatron_ring.config import ConfigError
from megatron_ring.config.checkpoint import CheckpointSource
from megatron_ring.config.gpt import parse_model_file
from megatron_ring.inference.prompts import text_prompts
from megatron_ring.inference.runners.checkpoint import source_tokenizer
from megatron_ring.inference.schema import InferenceSpec

WHERE = "megatron_ring.workload.text"


def check_text_prompts(spec: InferenceSpec) -> None:
    """Build ``spec``'s text prompts (``workload.text``) with the checkpoint's tokenizer, as the ranks will after
    loading the model, and raise ConfigError for what would fail there: no chat template, a ``prompt_len``
    without room for a document, and for the megatron runner (no padding) a document shorter than
    ``prompt_len`` leaves."""
    if spec.documents is None:
        return
    runner = spec.ring.model.runner
    source = parse_model_file(spec.model, where=WHERE) if runner == "megatron" else \
        CheckpointSource.parse(spec.model, where=WHERE)
    tokenizer = source_tokenizer(source, WHERE)
    work = spec.ring.workload
    try:
        _, _, records = text_prompts(spec.documents, tokenizer, prompt_len=work.prompt_len,
                                     chat=work.text.chat_template)
    except ValueError as err:
        raise ConfigError(str(err), where=WHERE) from None
    if runner == "megatron":
        short = [r for r in records if r["padding"]]
        if short:
            raise ConfigError(*(f"the document of {r['source']} is {r['document_tokens']} tokens: with the template "
                                f"and question its prompt is {r['padding']} tokens short of workload.prompt_len = "
                                f"{work.prompt_len}, and the megatron runner takes no padding; give a document of "
                                f"at least {r['document_tokens'] + r['padding']} tokens (a longer one is cut to fit)"
                                for r in short), where=WHERE)
