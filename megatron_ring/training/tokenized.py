"""Training documents through a checkpoint's own tokenizer: plain text and chat/instruction JSONL.

Two ``data.kind`` values read files into *documents*, each a token sequence ``[n]`` with a
per-token *target* mask ``[n]`` (1: the model learns to predict this token):

* ``documents``: every text file is one document, ``tokenizer(text)`` (its special tokens, e.g. a
  BOS, included) followed by the tokenizer's EOS; every token is a target. A document longer than
  ``seq_len + 1`` tokens is cut into pieces of ``seq_len + 1`` tokens (pretraining style), each
  piece attending only within itself.
* ``chat``: JSON lines, each either ``{"messages": [{"role": ..., "content": ...}, ...]}`` or the
  long-document form ``{"document": ..., "question": ..., "answer": ...}`` (optional ``"system"``),
  which becomes a user turn ``document + "\\n\\n" + question`` and an assistant turn ``answer``.
  The conversation is rendered by the tokenizer's chat template; only assistant tokens are targets
  (Note [Finding the assistant tokens]). One line is one document; it must fit ``seq_len + 1``.

:func:`load_documents` does the reading (cached per process, so the config check and the data
build tokenize once) and raises a :class:`DataError` naming the file, line and field of bad input.
The tokenizer comes from a checkpoint (:class:`~megatron_ring.config.checkpoint.CheckpointSource`:
a directory, a GGUF file or ``package:``), loaded offline (:func:`load_tokenizer`).

Note [Finding the assistant tokens]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Templates differ (ChatML, Llama 3 headers, Mistral's ``[INST]``), so no template string is
guessed. For every assistant message j the template renders two prefixes of the conversation as
text: messages ``0..j-1`` with the generation prompt (everything up to where the assistant starts
writing) and messages ``0..j``. The characters between the two ends are the assistant's (its
content and the template's end-of-turn marker, which the model must learn to emit). Both must be
prefixes of the whole rendered conversation, else the template is not prefix-stable and the line
is rejected. The whole text is tokenized once (no special tokens added: the template writes them)
with character offsets, and a token is a target when its first character lies in an assistant
span, so merges of tokens across a turn boundary cannot shift the mask.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from megatron_ring.config import ConfigError
from megatron_ring.config.checkpoint import CheckpointSource
from megatron_ring.config.json_lines import json_lines
from megatron_ring.training.data import Document

ROLES = ("system", "user", "assistant", "tool")


class DataError(ConfigError):
    """Bad training data: the message names the file, the line (JSONL) and the field."""


def load_tokenizer(source: CheckpointSource) -> Any:
    """The tokenizer of a checkpoint, offline: a directory's, or a GGUF file's (from its converted copy
    when one is cached, else read from the GGUF metadata alone: the weights are not de-quantised)."""
    from transformers import AutoTokenizer

    from megatron_ring.integrations.hf.checkpoint import converted_dir, gguf_location, resolve_checkpoint

    path = resolve_checkpoint(source.checkpoint)
    location = gguf_location(path, source.gguf_file)
    if location is None:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    converted = converted_dir(location[0] / location[1], Path(source.cache_dir) if source.cache_dir else None)
    if (converted / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(converted, local_files_only=True)
    return AutoTokenizer.from_pretrained(location[0], gguf_file=location[1], local_files_only=True)


@functools.lru_cache(maxsize=4)
def cached_tokenizer(source_json: str) -> Any:
    """:func:`load_tokenizer` once per process per checkpoint (``source_json``: the source's JSON)."""
    return load_tokenizer(CheckpointSource.model_validate_json(source_json))


def tokenizer_for(source: CheckpointSource, *, field: str) -> Any:
    """The cached tokenizer of ``source``; a ConfigError naming ``field`` when it cannot be loaded."""
    try:
        return cached_tokenizer(source.model_dump_json())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{field} = {source.checkpoint!r}: its tokenizer cannot be loaded ({err})") from None


# --- plain text -------------------------------------------------------------------------------

def text_documents(files: Sequence[Path], tokenizer: Any, seq_len: int) -> list[Document]:
    """Every file one document (its tokens and EOS), cut into pieces of at most ``seq_len + 1`` tokens."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(f"data.kind = 'documents': the tokenizer has no EOS token to end each document; "
                        "allowed: a tokenizer with eos_token set")
    docs = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{path}: not UTF-8 text ({err}); data.kind = 'documents' reads text files") from None
        ids = torch.tensor(list(tokenizer(text)["input_ids"]) + [eos], dtype=torch.long)
        for start in range(0, max(ids.numel() - 1, 1), seq_len):
            piece = ids[start:start + seq_len + 1]
            if piece.numel() >= 2:
                docs.append(Document(piece, torch.ones(piece.numel()), str(path)))
    return docs


# --- chat JSONL -------------------------------------------------------------------------------

def row_messages(row: Any, where: str) -> list[dict[str, str]]:
    """The conversation of one JSONL row (either form); DataError naming ``where`` and the field."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a line must be a JSON object with 'messages' or 'document'/'question'/'answer', "
                        f"got {type(row).__name__}")
    if "messages" in row:
        unknown = sorted(set(row) - {"messages"})
        messages = row["messages"]
        if unknown:
            raise DataError(f"{where}: unknown field(s) {unknown} next to 'messages'; allowed: 'messages' alone")
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: field 'messages' = {messages!r:.80}: must be a non-empty list of "
                            "{'role': ..., 'content': ...}")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or set(message) != {"role", "content"}:
                raise DataError(f"{where}: field 'messages[{i}]' = {message!r:.80}: must be an object with exactly "
                                "the keys 'role' and 'content'")
            if message["role"] not in ROLES:
                raise DataError(f"{where}: field 'messages[{i}].role' = {message['role']!r}; allowed: {list(ROLES)}")
            if not isinstance(message["content"], str):
                raise DataError(f"{where}: field 'messages[{i}].content' is a {type(message['content']).__name__}; "
                                "allowed: a string")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: field 'messages' has no assistant turn (roles "
                            f"{[m['role'] for m in messages]}); the loss is on assistant tokens only, so the line "
                            "would train nothing: add an {'role': 'assistant', ...} message")
        return messages
    required, optional = ("document", "question", "answer"), ("system",)
    missing = [k for k in required if k not in row]
    if missing:
        raise DataError(f"{where}: missing field(s) {missing}; a line is {{'messages': [...]}} or "
                        "{'document': ..., 'question': ..., 'answer': ...} (optional 'system')")
    unknown = sorted(set(row) - set(required) - set(optional))
    if unknown:
        raise DataError(f"{where}: unknown field(s) {unknown}; allowed: {list(required + optional)}")
    for key in (*required, *optional):
        if key in row and not isinstance(row[key], str):
            raise DataError(f"{where}: field '{key}' is a {type(row[key]).__name__}; allowed: a string")
    if not row["answer"]:
        raise DataError(f"{where}: field 'answer' is empty; the loss is on the answer's tokens only")
    messages = [{"role": "system", "content": row["system"]}] if "system" in row else []
    return messages + [{"role": "user", "content": f"{row['document']}\n\n{row['question']}"},
                       {"role": "assistant", "content": row["answer"]}]


def chat_document(messages: list[dict[str, str]], tokenizer: Any, where: str) -> Document:
    """Token ids and assistant-token targets of one conversation (Note [Finding the assistant tokens])."""
    def render(part: list[dict[str, str]], prompt: bool) -> str:
        return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)

    text = render(messages, False)
    spans = []
    for j, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = render(messages[:j], True) if j else "", render(messages[:j + 1], False)
        if not (text.startswith(start) and text.startswith(end) and len(end) > len(start)):
            raise DataError(f"{where}: field 'messages[{j}]': the tokenizer's chat template does not render this "
                            "conversation's prefixes as prefixes of the whole, so the assistant tokens cannot be "
                            "found; allowed: a prefix-stable chat template")
        spans.append((len(start), len(end)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(encoded["input_ids"], dtype=torch.long)
    first = torch.tensor([s for s, _ in encoded["offset_mapping"]], dtype=torch.long)
    target = torch.zeros(ids.numel())
    for s, e in spans:
        target[(first >= s) & (first < e)] = 1.0
    if not target.any():
        raise DataError(f"{where}: field 'messages': the assistant turns tokenize to no token")
    return Document(ids, target, where)


def chat_documents(files: Sequence[Path], tokenizer: Any) -> list[Document]:
    """Every line of every JSONL file one document; DataError (file, line, field) on bad input."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"data.kind = 'chat': the tokenizer has no chat template (tokenizer.chat_template is "
                        f"empty), so conversations in {[str(f) for f in files][:3]} cannot be rendered; allowed: a "
                        "checkpoint whose tokenizer_config.json / chat_template.jinja holds one, or data.kind = "
                        "'documents'")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("data.kind = 'chat' needs a fast tokenizer (character offsets locate the assistant tokens); "
                        f"{type(tokenizer).__name__} is not one")
    docs = []
    for path in files:
        for number, row in json_lines(path, DataError, lambda n: f"{path}:{n}"):
            where = f"{path}:{number}"
            docs.append(chat_document(row_messages(row, where), tokenizer, where))
    if not docs:
        raise DataError(f"data.paths {[str(f) for f in files]}: no JSON line found")
    return docs


def check_lengths(docs: Sequence[Document], seq_len: int, max_positions: Optional[int]) -> None:
    """DataError naming the first document longer than a row (``seq_len + 1`` tokens: inputs and the
    last label) or than the model's positions."""
    for doc in docs:
        n = doc.ids.numel() - 1  # inputs
        if n > seq_len:
            raise DataError(f"{doc.origin}: {n + 1} tokens, longer than megatron_ring.seq_len + 1 = {seq_len + 1}, "
                            "one training row; shorten it or raise seq_len")
        if max_positions is not None and n > max_positions:
            raise DataError(f"{doc.origin}: {n} input tokens, more than the model's {max_positions} positions "
                            "(max_position_embeddings)")


@functools.lru_cache(maxsize=4)
def _cached_documents(kind: str, files: tuple[tuple[Path, int, int], ...], source_json: str,
                      seq_len: int) -> tuple[Document, ...]:
    """The documents of ``files`` (each with its size and modification time: a changed file is read again)."""
    tokenizer = cached_tokenizer(source_json)
    paths = [path for path, _, _ in files]
    docs = text_documents(paths, tokenizer, seq_len) if kind == "documents" else chat_documents(paths, tokenizer)
    return tuple(docs)


def load_documents(kind: str, files: Sequence[Path], source: CheckpointSource, seq_len: int,
                   max_positions: Optional[int] = None) -> tuple[Document, ...]:
    """The documents of ``files`` for ``kind`` (``documents`` or ``chat``), tokenized by ``source``'s
    tokenizer once per process; DataError (file, line, field) on bad input or a too-long document."""
    if kind not in ("documents", "chat"):  # schema.DOCUMENT_KINDS (schema imports this module)
        raise ValueError(f"data.kind = {kind!r}; allowed: 'documents', 'chat'")
    stamped = tuple((Path(f), f.stat().st_size, f.stat().st_mtime_ns) for f in map(Path, files))
    docs = _cached_documents(kind, stamped, source.model_dump_json(), seq_len)
    check_lengths(docs, seq_len, max_positions)
    return docs
