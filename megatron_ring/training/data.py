"""Training data: byte-level tokens from local text, packed, split over DP ranks, zigzag over CP ranks.

The path of a training sequence:

1. :class:`ByteTokenizer` turns text into ids with no download: id = byte value, the last id of
   the vocabulary is end-of-document (EOD).
2. :func:`text_corpus` reads the configured files (folders searched for suffixes, sorted order),
   joins their token streams with EOD; :class:`PackedSequences` cuts the stream into samples of
   ``seq_len + 1`` tokens (sample i starts at ``i * seq_len``: inputs are its first ``seq_len``
   tokens, labels the last ``seq_len``). :class:`SyntheticSequences` is the explicit alternative.
3. :class:`TrainData` fixes which samples every step sees: the k-th sample of the run is sample
   ``perm_e[k mod n]`` of epoch ``e = k // n`` (a seeded permutation per epoch), so the data
   position is a function of the step alone and a resumed run continues exactly where the saved
   one stopped. Step s uses run samples ``s*G .. s*G+G-1`` (G = global batch); within a step,
   sample ``j = (m * dp + d) * micro + i`` is row i of micro-batch m on data-parallel rank d.
4. Each row is cut zigzag for this CP rank (chunks r and 2P-1-r of 2P, Megatron's
   ``get_batch_on_this_cp_rank``): tokens, labels, loss mask and global position ids alike. A row
   whose length is not a multiple of ``2 * cp`` is padded at its end first (loss mask 0; under the
   causal mask no real token sees the padding), so ``seq_len`` may be any length; with sequence
   parallelism to a multiple of ``cp * tp`` too (:func:`row_length`).

Documents through a checkpoint's tokenizer (``data.kind`` ``documents`` / ``chat``,
:mod:`megatron_ring.training.tokenized`) take the packed path instead (Note [Packed training rows]).

Note [Packed training rows]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
:class:`DocumentRows` packs whole documents into rows (greedily, in order, up to ``seq_len``
input tokens a row; ``packing: false`` puts one document in a row). A document of ``n`` tokens
gives ``n - 1`` inputs and their next-token labels, its own target mask shifted onto the labels,
so no label crosses a document boundary. A micro-batch becomes *one* packed row of every document
of its rows (:func:`packed_batch`): each document padded at its end to a multiple of ``2 * cp``
(loss mask 0, positions continuing), positions restarting at 0 per document, the padded boundaries
in ``Batch.cu_seqlens``, and every document cut zigzag on its own (chunks r and 2P-1-r of every
document: the core's varlen sharding, Note [Packed documents (varlen)] in
:mod:`megatron_ring.attention.sharding`). Every rank therefore holds exactly ``total / cp`` tokens
and, per document, the same causal work up to one chunk; the ring attends within documents only.
The same rows at any cp give the same global loss: only the padding differs, and it carries no loss.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Protocol, Sequence

import torch

from megatron_ring.attention.sharding import shard_sequence


class ByteTokenizer:
    """Bytes as token ids; the last id of the vocabulary marks the end of a document.

    With ``vocab_size >= 257`` every byte keeps its value and EOD is 256. A smaller vocabulary
    (>= 128, e.g. a CPU-sized model with 128 ids) keeps the bytes below its EOD id and maps the
    others to ``'?'``: ASCII text survives unchanged.
    """

    UNKNOWN = ord("?")

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 128:
            raise ValueError(f"vocab_size = {vocab_size}: the byte tokenizer needs at least 128 ids (ASCII + EOD)")
        self.vocab_size = vocab_size
        self.eod_id = min(vocab_size, 257) - 1
        table = torch.arange(256)
        table[table >= self.eod_id] = self.UNKNOWN
        self._table = table

    def encode(self, text: str | bytes) -> torch.Tensor:
        """``[n]`` int64 ids of the UTF-8 bytes of ``text`` (no EOD appended)."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).long() if data else torch.empty(0, dtype=torch.long)
        return self._table[raw]

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of ``ids``; EOD becomes a newline, undecodable bytes the replacement character."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(10 if i == self.eod_id else i for i in values).decode("utf-8", errors="replace")


def text_corpus(files: Sequence[Path], tokenizer: ByteTokenizer) -> torch.Tensor:
    """``[n]`` int64: every file's tokens followed by EOD, in the given order."""
    eod = torch.tensor([tokenizer.eod_id])
    return torch.cat([t for f in files for t in (tokenizer.encode(f.read_bytes()), eod)])


class Samples(Protocol):
    """Indexable samples of ``seq_len + 1`` tokens."""

    seq_len: int

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> torch.Tensor: ...

    def fingerprint(self) -> str: ...


class PackedSequences:
    """A token stream cut into samples of ``seq_len + 1`` tokens (consecutive samples share one token)."""

    def __init__(self, stream: torch.Tensor, seq_len: int) -> None:
        self.stream = stream
        self.seq_len = seq_len
        self._len = (stream.numel() - 1) // seq_len
        if self._len < 1:
            raise ValueError(f"the corpus has {stream.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}")

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        return self.stream[start:start + self.seq_len + 1]

    def fingerprint(self) -> str:
        """Identifies the token stream and packing: a resumed run must see the same samples."""
        digest = hashlib.sha256(self.stream.numpy().tobytes()).hexdigest()[:16]
        return f"text:{self.stream.numel()}:{self.seq_len}:{digest}"


class SyntheticSequences:
    """``count`` samples of uniform random ids in ``[0, vocab_size)``, sample i drawn from ``seed + i``."""

    def __init__(self, vocab_size: int, seq_len: int, count: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.count, self.seed = vocab_size, seq_len, count, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed + index)
        return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=gen)

    def fingerprint(self) -> str:
        return f"synthetic:{self.vocab_size}:{self.seq_len}:{self.count}:{self.seed}"


@dataclass(frozen=True)
class Document:
    """One document: ``ids`` int64 ``[n]``, ``target`` float32 ``[n]`` (1 where the token is learned),
    and where it came from (``file:line`` or ``file``, for messages)."""

    ids: torch.Tensor
    target: torch.Tensor
    origin: str


class DocumentRows:
    """Rows of whole documents (Note [Packed training rows]): row i is ``self[i]``, a list of documents
    whose inputs (``n - 1`` tokens each) add up to at most ``seq_len``."""

    def __init__(self, docs: Sequence[Document], seq_len: int, *, packing: bool, source: str) -> None:
        self.docs, self.seq_len, self.packing, self.source = tuple(docs), seq_len, packing, source
        rows: list[list[int]] = []
        used = seq_len + 1
        for i, doc in enumerate(self.docs):
            n = doc.ids.numel() - 1
            if n > seq_len:
                raise ValueError(f"{doc.origin}: {n} input tokens, more than seq_len = {seq_len}")
            if not packing or used + n > seq_len:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += n
        if not rows:
            raise ValueError("the data holds no document")
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[Document]:
        return [self.docs[i] for i in self.rows[index]]

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for doc in self.docs:
            digest.update(doc.ids.numpy().tobytes())
            digest.update(doc.target.numpy().tobytes())
        return f"{self.source}:{len(self.docs)}:{self.seq_len}:packing={self.packing}:{digest.hexdigest()[:16]}"


@dataclass
class Batch:
    """One micro-batch on one rank; every tensor is ``[micro, seq_len / cp]`` (this CP rank's zigzag part).

    ``position_ids`` are the tokens' global positions (for RoPE / learned embeddings). A packed
    micro-batch (``cu_seqlens`` set: int32 ``[n_docs + 1]``, the documents' padded global boundaries)
    is one row ``[1, total / cp]`` of documents, positions restarting per document (Note [Packed training rows]).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: Optional[torch.Tensor] = None

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(t.to(device, non_blocking=True) for t in
                       (self.tokens, self.labels, self.loss_mask, self.position_ids)),
                     cu_seqlens=None if self.cu_seqlens is None else self.cu_seqlens.to(device))


def padded_length(n: int, cp: int) -> int:
    """``n`` rounded up to a multiple of ``2 * cp`` (zigzag sharding; the ring's packed path asks it at cp = 1 too)."""
    return -(-n // (2 * cp)) * 2 * cp


def row_length(seq_len: int, cp: int, split: int = 1) -> int:
    """The length of an unpacked row of ``seq_len`` tokens on the model: padded for zigzag at cp > 1, and
    so that each CP rank's ``row / cp`` tokens split evenly over ``split`` ranks (the TP ranks under
    sequence parallelism, which scatter a CP rank's tokens ``[s_local, b, h]`` along the sequence)."""
    multiple = math.lcm(2 * cp if cp > 1 else 1, cp * split)
    return -(-seq_len // multiple) * multiple


def pad_row(full: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """``[b, s]`` tokens/labels/loss_mask/position_ids padded at their end to ``length`` (id 0, loss mask
    0, positions continuing)."""
    s = full["tokens"].shape[1]
    if length == s:
        return full
    out = {k: torch.nn.functional.pad(v, (0, length - s)) for k, v in full.items() if k != "position_ids"}
    last = full["position_ids"][:, -1:]
    out["position_ids"] = torch.cat([full["position_ids"], last + torch.arange(1, length - s + 1)], dim=1)
    return out


def packed_batch(docs: Sequence[Document], cp: int, cp_rank: int) -> Batch:
    """This CP rank's part of one packed row of ``docs`` (Note [Packed training rows])."""
    parts: dict[str, list[torch.Tensor]] = {"tokens": [], "labels": [], "loss_mask": [], "position_ids": []}
    lengths = []
    for doc in docs:
        n = doc.ids.numel() - 1
        pad = padded_length(n, cp) - n
        parts["tokens"].append(torch.nn.functional.pad(doc.ids[:-1], (0, pad)))
        parts["labels"].append(torch.nn.functional.pad(doc.ids[1:], (0, pad)))
        parts["loss_mask"].append(torch.nn.functional.pad(doc.target[1:].float(), (0, pad)))
        parts["position_ids"].append(torch.arange(n + pad))
        lengths.append(n + pad)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    full = {k: torch.cat(v)[None] for k, v in parts.items()}
    if cp > 1:
        full = {k: shard_sequence(v, cp_rank, cp, dim=1, cu_seqlens=cu).contiguous() for k, v in full.items()}
    return Batch(**full, cu_seqlens=cu)


def masked_loss(per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``per_token`` ``[b, s_local]`` losses over valid tokens (``loss_mask`` 1), in fp32."""
    return (per_token.float() * loss_mask).sum()


class TrainData:
    """Which samples each step, data-parallel rank and micro-batch sees; see the module docstring."""

    def __init__(self, samples: Samples, *, micro_batch: int, grad_accum: int, dp: int, dp_rank: int,
                 cp: int, cp_rank: int, shuffle: bool, seed: int, split: int = 1) -> None:
        """``split``: the TP ranks sharing a row under sequence parallelism (:func:`row_length`)."""
        if not 0 <= dp_rank < dp or not 0 <= cp_rank < cp:
            raise ValueError(f"dp_rank = {dp_rank} / cp_rank = {cp_rank} out of range for dp = {dp}, cp = {cp}")
        self.samples = samples
        self.micro_batch, self.grad_accum, self.dp, self.dp_rank = micro_batch, grad_accum, dp, dp_rank
        self.cp, self.cp_rank, self.split = cp, cp_rank, split
        self.shuffle, self.seed = shuffle, seed
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def fingerprint(self) -> str:
        """The samples and their order: equal fingerprints give equal batches at every step."""
        return f"{self.samples.fingerprint()}:shuffle={self.shuffle}:seed={self.seed}"

    def tokens_per_step(self, step: int = 0) -> int:
        """Tokens (inputs, padding not counted) of the whole global batch of ``step``."""
        if not isinstance(self.samples, DocumentRows):
            return self.global_batch * self.samples.seq_len
        base = step * self.global_batch
        return sum(doc.ids.numel() - 1 for k in range(base, base + self.global_batch)
                   for doc in self.samples[self.sample_index(k)])

    def sample_index(self, k: int) -> int:
        """Index into ``samples`` of the k-th sample of the run."""
        n = len(self.samples)
        epoch, pos = divmod(k, n)
        if not self.shuffle:
            return pos
        perm = self._perms.get(epoch)
        if perm is None:
            self._perms = {epoch: torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))}
            perm = self._perms[epoch]
        return int(perm[pos])

    def step_slots(self, step: int) -> list[list[int]]:
        """Positions in the run's sample sequence of this DP rank's samples of ``step``: one list of
        ``micro`` per micro-batch."""
        base = step * self.global_batch
        return [[base + (m * self.dp + self.dp_rank) * self.micro_batch + i for i in range(self.micro_batch)]
                for m in range(self.grad_accum)]

    def step_sample_ids(self, step: int) -> list[list[int]]:
        """Sample indices of this DP rank for ``step``: one list of ``micro`` per micro-batch."""
        return [[self.sample_index(k) for k in slots] for slots in self.step_slots(step)]

    def step_batches(self, step: int, *, limit: Optional[int] = None) -> list[Batch]:
        """This rank's ``grad_accum`` micro-batches of ``step``, sharded zigzag for its CP rank; with
        ``limit``, samples at positions ``>= limit`` of the run (repeats, for a held-out pass) carry loss mask 0."""
        return [self._batch([self.sample_index(k) for k in slots],
                            [limit is None or k < limit for k in slots]) for slots in self.step_slots(step)]

    def _batch(self, ids: list[int], learned: Sequence[bool]) -> Batch:
        if isinstance(self.samples, DocumentRows):
            return packed_batch([doc if keep else replace(doc, target=torch.zeros_like(doc.target))
                                 for i, keep in zip(ids, learned) for doc in self.samples[i]], self.cp, self.cp_rank)
        rows = torch.stack([self.samples[i] for i in ids])  # [micro, seq_len + 1]
        seq_len = self.samples.seq_len
        full = {
            "tokens": rows[:, :-1],
            "labels": rows[:, 1:],
            "loss_mask": torch.tensor(learned, dtype=torch.float32)[:, None].expand(-1, seq_len).contiguous(),
            "position_ids": torch.arange(seq_len).expand(len(ids), -1),
        }
        full = pad_row(full, row_length(seq_len, self.cp, self.split))
        if self.cp > 1:  # cp 1 keeps a row of any length whole
            full = {k: shard_sequence(v, self.cp_rank, self.cp, dim=1).contiguous() for k, v in full.items()}
        return Batch(**full)


def build_samples(kind: str, *, vocab_size: int, seq_len: int, files: Sequence[Path] = (),
                  synthetic_samples: int = 0, seed: int = 0) -> Samples:
    """The samples of a ``data`` section: packed byte tokens of ``files`` or synthetic ones."""
    if kind == "synthetic":
        return SyntheticSequences(vocab_size, seq_len, synthetic_samples, seed)
    if kind == "text":
        return PackedSequences(text_corpus(files, ByteTokenizer(vocab_size)), seq_len)
    raise ValueError(f"data.kind = {kind!r}; allowed: 'text', 'synthetic'")
