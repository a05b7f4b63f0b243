"""Real text prompts of a workload, through the checkpoint's tokenizer (random ids: ``loop.make_prompt``).

``workload.text`` (:class:`TextSection`) names documents: one per file (``files``), or a JSONL
file whose lines are ``{"document": ..., "question": ...}`` (``jsonl``; ``document_file`` may
replace ``document``, a path relative to the JSONL file; an optional ``answer``, the expected reply,
is recorded beside the generated one, so that the long-document training lines of ``data.kind: chat``
are prompt files too). Each row of the batch is one document
followed by its question, optionally through the tokenizer's chat template (one user message), and
is fitted to exactly ``prompt_len`` tokens::

    [template prefix][document tokens, cut at the end to fit][\\n\\n question][template suffix]
    [pad ... pad][template prefix][whole document][\\n\\n question][template suffix]   (short: left-padded, mask 0)

The document is cut, never the question or the template; the pieces are tokenized separately
(a document cut at a token boundary). ``rows`` records, per row, where the text came from, how many
of the document's tokens were kept and how much padding was added.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from pydantic import Field

from megatron_ring.config import ConfigError, StrictModel
from megatron_ring.config.json_lines import json_lines

PLACEHOLDER = "\u0000DOCUMENT\u0000"


class TextSection(StrictModel):
    """Real text prompts (see the module docstring); paths relative to the config file, then the working directory."""

    files: list[str] = Field(default_factory=list, description="one document per file")
    jsonl: Optional[str] = Field(None, description='lines {"document" or "document_file": ..., "question": ...} '
                                 '(optional "answer": the expected reply, recorded)')
    question: Optional[str] = Field(None, description="asked after every document of files")
    chat_template: bool = Field(True, description="wrap each prompt in the tokenizer's chat template")


@dataclass
class Document:
    """One row's text: the document, its question (may be empty), where it came from and the expected answer
    (None: not given)."""

    text: str
    question: str
    source: str
    answer: Optional[str] = None


def find_file(given: str, base: Optional[Path], field: str) -> Path:
    """``given`` absolute, else relative to ``base`` (the config's directory), then to the working directory."""
    path = Path(given)
    tried = [path] if path.is_absolute() else ([base / path] if base is not None else []) + [Path.cwd() / path]
    for candidate in tried:
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{field} = {given!r}: file not found; tried {', '.join(str(p) for p in tried)}")


def read_text(path: Path, field: str) -> str:
    """The UTF-8 text of ``path``; a ConfigError naming ``field``, the file and the byte when it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{field}: {str(path)!r} is not UTF-8 text (byte {err.start}: {err.reason}); "
                          "allowed: a UTF-8 text file") from None


def load_documents(section: TextSection, base: Optional[Path]) -> list[Document]:
    """The documents of ``section`` in order; ConfigError naming the field and the line for bad input."""
    field = "megatron_ring.workload.text"
    if bool(section.files) == (section.jsonl is not None):
        raise ConfigError(f"{field}: give exactly one of 'files' (one document per file) or 'jsonl'; got "
                          f"files={section.files!r}, jsonl={section.jsonl!r}")
    if section.files:
        return [Document(read_text(find_file(f, base, f"{field}.files"), f"{field}.files"), section.question or "", f)
                for f in section.files]
    if section.question is not None:
        raise ConfigError(f"{field}.question is for 'files'; a JSONL line carries its own 'question'")
    path = find_file(section.jsonl, base, f"{field}.jsonl")
    docs = []
    for number, entry in json_lines(path, ConfigError, lambda n: f"{field}.jsonl {str(path)!r} line {n}"):
        where = f"{field}.jsonl {str(path)!r} line {number}"
        if not isinstance(entry, dict) or set(entry) - {"document", "document_file", "question", "answer"} or \
                ("document" in entry) == ("document_file" in entry):
            raise ConfigError(f"{where}: must be an object with 'document' or 'document_file' (one of them) and an "
                              f"optional 'question' and 'answer'; got keys "
                              f"{sorted(entry) if isinstance(entry, dict) else entry!r}")
        wrong = [f"'{key}' is {type(value).__name__}" for key, value in entry.items() if not isinstance(value, str)]
        if wrong:
            raise ConfigError(f"{where}: field {', '.join(wrong)}; allowed: a string (a null would be read "
                              "as the text 'None')")
        text = entry.get("document")
        if text is None:
            text = read_text(find_file(entry["document_file"], path.parent, f"{where}: document_file"), where)
        docs.append(Document(text, entry.get("question", ""), f"{path.name}:{number}", entry.get("answer")))
    if not docs:
        raise ConfigError(f"{field}.jsonl {str(path)!r} holds no documents")
    return docs


def _template(tokenizer: Any, question: str, chat: bool) -> tuple[str, str]:
    """The text before and after the document: the chat template around one user message, or a bare question."""
    content = f"{PLACEHOLDER}\n\n{question}" if question else PLACEHOLDER
    if not chat:
        return "", content[len(PLACEHOLDER):]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("megatron_ring.workload.text.chat_template = true but the checkpoint's tokenizer has no chat "
                         "template; set it to false")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    prefix, suffix = rendered.split(PLACEHOLDER)
    return prefix, suffix


def template_ids(tokenizer: Any, question: str, chat: bool) -> tuple[list[int], list[int]]:
    """The token ids before and after a document: ``[template prefix]`` and ``[\\n\\n question][template
    suffix]`` (the tokenizer's special tokens in front when ``chat`` is false); the document is tokenized
    apart, so a prompt is ``head + document ids + tail``."""
    prefix, suffix = _template(tokenizer, question, chat)
    head = tokenizer(prefix, add_special_tokens=not chat)["input_ids"] if prefix or not chat else []
    tail = tokenizer(suffix, add_special_tokens=False)["input_ids"]
    return list(head), list(tail)


def pad_token_id(tokenizer: Any) -> int:
    """The id that fills left padding (masked, so any id is exact): pad, else EOS, else 0."""
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return int(value)
    return 0


def text_prompts(documents: list[Document], tokenizer: Any, *, prompt_len: int, chat: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, Any]]]:
    """Ids and mask int64 ``[len(documents), prompt_len]`` (left-padded) and a record per row."""
    rows, masks, records = [], [], []
    for doc in documents:
        head, tail = template_ids(tokenizer, doc.question, chat)
        body = tokenizer(doc.text, add_special_tokens=False)["input_ids"]
        budget = prompt_len - len(head) - len(tail)
        if budget < 1:
            raise ValueError(f"megatron_ring.workload.prompt_len = {prompt_len} leaves no room for the document of "
                             f"{doc.source}: the template and question take {len(head) + len(tail)} tokens")
        kept = body[:budget]
        ids = head + kept + tail
        pad = prompt_len - len(ids)
        rows.append([pad_token_id(tokenizer)] * pad + ids)
        masks.append([0] * pad + [1] * len(ids))
        records.append({"source": doc.source, "question": doc.question, "document_tokens": len(body),
                        "document_tokens_kept": len(kept), "padding": pad,
                        **({"expected_answer": doc.answer} if doc.answer is not None else {})})
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(masks, dtype=torch.int64), records


def answers(tokenizer: Any, generated: list[list[int]]) -> list[str]:
    """Each row's generated ids as text, up to its first end-of-sequence token (special tokens dropped)."""
    eos = tokenizer.eos_token_id
    out = []
    for row in generated:
        end = row.index(eos) if eos in row else len(row)
        out.append(tokenizer.decode(row[:end], skip_special_tokens=True))
    return out
