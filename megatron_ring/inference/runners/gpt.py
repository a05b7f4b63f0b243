"""A Megatron-core GPT served by the inference loop: TP/PP baseline or ring attention over CP.

The model is a real ``GPTModel`` built from a ``configs/megatron`` YAML (see
:mod:`megatron_ring.integrations.megatron.model`): random weights of the file's sizes, or a
transformers Llama / Qwen2 / Mistral checkpoint (``checkpoint:`` instead of ``model:``; a directory
or GGUF), its sizes read from its config and its tensors converted to this rank's TP shard and PP
stage, each rank reading only those (``integrations/megatron/hf_config.py``, ``hf_weights.py``,
``hf_checkpoint.py``). The baseline (tensor parallel heads, pipeline
stages, full sequence on every rank) takes ``attention: sdpa``, the core's fused block kernel
without a ring (the same kernel as the ring: a fair comparison), or ``attention: local``,
Megatron's own unfused ``DotProductAttention``; ``attention: ring`` gives
:class:`~megatron_ring.integrations.megatron.attention.RingAttention` (the prompt sharded zigzag
over the CP group). Each layer's ``core_attention`` is wrapped by
:class:`CachedCoreAttention`, which owns that layer's share of the KV cache; everything else
(layer norms, QKV and output projections with their TP collectives, MLP) is Megatron's code.

Note [Sharded KV cache]
~~~~~~~~~~~~~~~~~~~~~~~
Prefill: rank r of the CP group holds prompt chunks r and 2P-1-r; ring attention computes its
queries against every chunk, and the K/V of its own tokens stay in its cache. Decode step t: the
new token is computed on every CP rank (weights are replicated over CP), its K/V are appended on
CP rank t % P only (so the shards never differ by more than one token), and each rank attends the
query to its own shard; :func:`megatron_ring.decode_attention` merges the partial results by
log-sum-exp in one small collective. No K/V moves during decode::

    prompt 0..7, P = 2     rank 0 cache: 0 1 6 7 | 8 10 ..     rank 1 cache: 2 3 4 5 | 9 11 ..

Each cache row remembers its token's global position, so a sliding window (``config.window_size``)
applies in decode too: ``decode_attention(window_size=, q_positions=, k_positions=)``.

Pipeline parallel: each stage runs its layers and sends the activations ``[s, b, h]`` to the next
stage with send/recv; the last stage picks the greedy token and broadcasts it back along the PP
group, so every rank returns the same ids.

Note [Pipelined micro-batches]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With pp > 1 a batch runs as micro-batches, as Megatron's inference pipelines them: stage ``i``
sends micro-batch ``m`` and goes on to ``m + 1`` while stage ``i + 1`` works on ``m``, so the
stages overlap instead of waiting for the whole batch (a blocking send returns once the next stage
has posted its receive). Prefill, compute-bound, takes one sequence per micro-batch: ``b`` of them
cost ``b + pp - 1`` stage times of one sequence. A decode step is bound by per-layer costs that do
not shrink with the micro-batch (reading the weights, launching each layer), so it takes the fewest
micro-batches that fill the pipeline, ``pp`` of them: ``2 pp - 1`` stage times of ``b / pp``
sequences instead of ``pp`` of ``b``. At batch 1 there is nothing to overlap. Layouts without pp run
the batch at once.

Note [Sequence parallelism in the runner]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``parallel.sequence_parallel`` (tp > 1) prefill and scoring run as Megatron trains: the
embedding scatters a CP rank's ``s_local`` tokens over the TP ranks (``[s_local / tp, b, h]``, what
travels between pipeline stages too), each layer gathers them before its QKV projection (the core
attention and its cache see all ``s_local``: Note [Sequence parallelism and the ring] in
integrations/megatron/sequence_parallel.py) and reduce-scatters after its output projection; the
last stage gathers them before the final norm. A decode step's one token cannot split over tp, so
it runs with sequence parallelism off (:func:`sequence_parallel_off`): the same weights, no split.
``prompt_len`` must split evenly: a multiple of ``cp * tp``.

Weights are drawn per parameter from ``(seed, global parameter name)`` in the unsharded layout, or
come from the checkpoint, and are then cut for this rank's TP shard and PP stage, so every layout
serves the same global model.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
import zlib
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType

from megatron_ring.attention.decode import decode_attention
from megatron_ring.attention.sharding import local_positions, shard_sequence, unshard_sequence
from megatron_ring.attention.turn import turn_attention
from megatron_ring.config import Problems
from megatron_ring.config.gpt import GPTConfig, parse_model_file
from megatron_ring.integrations.megatron.attention import RingAttention
from megatron_ring.integrations.megatron.model import build_gpt_model, global_name, is_gated_fc1, \
    load_full_state_dict, shard_of, unwrap, weights_to_be_loaded
from megatron_ring.integrations.megatron.on_cpu import cuda_calls_on_cpu
from megatron_ring.integrations.megatron.sequence_parallel import sequence_parallel_off
from megatron_ring.integrations.megatron.state import init_megatron
from megatron_ring.inference.runners.checkpoint import gpt_config, load_weights
from megatron_ring.inference.runners.gpt_conversations import MegatronConversations
from megatron_ring.inference.runners.protocol import DeepSpeedPassThrough, block_kernel_name, refuse_padding
from megatron_ring.parallel.groups import ParallelGroups
from megatron_ring.parallel.layout import ParallelLayout

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
WHERE = "megatron model config (megatron_ring.model.config)"


def takes_text(model: dict[str, Any]) -> bool:
    """A checkpoint carries its tokenizer; random weights have none (see ``RunnerModule``)."""
    return isinstance(model, dict) and "checkpoint" in model


def check_model(model: dict[str, Any], layout: ParallelLayout, *, batch: int, prompt_len: int,
                new_tokens: int, dtype: Optional[str]) -> dict[str, Any]:
    """Validate a ``configs/megatron`` model against ``layout``, the workload and ``dtype`` (see ``RunnerModule``).

    A checkpoint's config is read (Note [GGUF conversion cache]: a GGUF file not yet converted is
    parsed, seconds); its tensors are checked when the runner loads them.
    """
    cfg = gpt_config(model, where=WHERE)
    problems = Problems(where=f"model config {cfg.name!r}")
    for axis in ("tp", "pp", "cp"):
        if getattr(cfg.parallel, axis) != getattr(layout, axis):
            problems.add(f"parallel.{axis} = {getattr(cfg.parallel, axis)} but megatron_ring.layout.{axis} = "
                         f"{getattr(layout, axis)}; they must be equal")
    problems.run(cfg.check_world_size, layout.world_size)
    total = prompt_len + new_tokens - 1
    if total > cfg.model.seq_length:
        problems.add(f"megatron_ring.workload: prompt_len + new_tokens - 1 = {prompt_len} + {new_tokens} - 1 = "
                     f"{total} exceeds model.seq_length = {cfg.model.seq_length}")
    if dtype is not None:
        problems.run(cfg.check_dtype, dtype, source="DeepSpeed's dtype")
    if cfg.parallel.sequence_parallel and prompt_len % (cfg.parallel.cp * cfg.parallel.tp):
        problems.add(f"parallel.sequence_parallel splits each CP rank's prompt_len / cp tokens over tp = "
                     f"{cfg.parallel.tp} ranks: megatron_ring.workload.prompt_len = {prompt_len} is not divisible by "
                     f"cp * tp = {cfg.parallel.cp * cfg.parallel.tp}; allowed: a multiple of it, or sequence_parallel "
                     "false")
    if cfg.model.dilation is not None:
        problems.add(f"model.dilation = {cfg.model.dilation}: the runner's decode attends to every cached token, "
                     "so a dilated model would be served another attention than it was trained with; allowed: no "
                     "dilation here (dilated attention runs in training and in the core's prefill)")
    problems.raise_if_any()
    m = cfg.model
    qkv = m.hidden_size * (m.num_attention_heads + 2 * m.query_groups) * m.kv_channels
    mlp = (3 if m.activation == "swiglu" else 2) * m.hidden_size * m.ffn_hidden_size
    per_layer = qkv + m.num_attention_heads * m.kv_channels * m.hidden_size + mlp
    embeddings = m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2)
    source = {key: model[key] for key in ("checkpoint", "gguf_file") if key in model}
    return {
        "runner": "megatron", "name": cfg.name, **source, "attention": cfg.attention, "num_layers": m.num_layers,
        "hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads, "head_dim": m.kv_channels,
        "num_query_groups": m.query_groups, "ffn_hidden_size": m.ffn_hidden_size, "vocab_size": m.vocab_size,
        "seq_length": m.seq_length, "position_embedding": m.position_embedding, "activation": m.activation,
        "parameters": m.num_layers * per_layer + embeddings,
    }


class CachedCoreAttention(torch.nn.Module):
    """A layer's ``core_attention`` plus this rank's KV cache for it (Note [Sharded KV cache]).

    Cache: K and V ``[capacity, batch, ng, hn]`` (Megatron's layout; ng = this TP rank's K/V heads).
    The runner sets :attr:`decoding`, :attr:`owner`, :attr:`check`, :attr:`rows` (the batch rows
    of the running micro-batch) and :attr:`positions` (the global positions of the call's tokens,
    int64 ``[sq]``) before each forward, and advances :attr:`length` after each decode step. ``check``: whether ``decode_attention`` runs its cross-rank handshake; the runner asks for
    it on the first decode step of a request only, since later steps repeat the same shapes and the
    handshake would double the step's collectives.
    """

    def __init__(self, inner: torch.nn.Module, *, batch: int, capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.inner = inner
        self.batch, self.capacity, self.dtype, self.device = batch, capacity, dtype, device
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.length = 0
        self.decoding = False
        self.owner = False
        self.check = True
        self.rows = slice(None)
        self.positions = torch.zeros(0, dtype=torch.long, device=device)
        self.k_positions = torch.zeros(capacity, dtype=torch.long, device=device)  # of the cache rows
        self.turn: Optional[tuple[int, str]] = None
        """A follow-up turn (``megatron-ring serve``): this rank's count of new tokens (the call may carry one
        placeholder more) and ``turn_attention``'s mode; :attr:`positions` are the new tokens' positions."""

    def _ensure(self, key: torch.Tensor) -> None:
        if self.k is None:
            shape = (self.capacity, self.batch, *key.shape[2:])
            self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    def _room(self, rows: int) -> None:
        """Grow the cache (doubling) so that ``rows`` more tokens fit."""
        need = self.length + rows
        if need <= self.capacity:
            return
        capacity = max(need, 2 * self.capacity)
        grown = [torch.zeros((capacity, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in (self.k, self.v)]
        for new, old in zip(grown, (self.k, self.v)):
            new[:self.length] = old[:self.length]
        positions = torch.zeros(capacity, dtype=torch.long, device=self.device)
        positions[:self.length] = self.k_positions[:self.length]
        self.k, self.v, self.k_positions, self.capacity = grown[0], grown[1], positions, capacity

    def state(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor, int, int]:
        """This layer's cache, to keep with a conversation (:meth:`load` puts it back)."""
        return self.k, self.v, self.k_positions, self.length, self.capacity

    def load(self, state: tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor, int, int]) -> None:
        self.k, self.v, self.k_positions, self.length, self.capacity = state

    def keep_first(self, tokens: int) -> None:
        """Drop the cached tokens at positions ``>= tokens``."""
        if self.k is None:
            return
        keep = torch.nonzero(self.k_positions[:self.length] < tokens)[:, 0]
        n = keep.numel()
        self.k[:n], self.v[:n] = self.k[keep], self.v[keep]
        self.k_positions[:n] = self.k_positions[keep]
        self.length = n

    def _turn(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A follow-up turn: this rank's new K/V appended, its queries against every shard (Note [Pass-KV or
        pass-Q]); ``[sq, b, np * hn]`` with zeros for a placeholder row."""
        n, mode = self.turn
        sq, b = query.shape[:2]
        self._room(n)
        self.k[self.length:self.length + n, self.rows] = key[:n]
        self.v[self.length:self.length + n, self.rows] = value[:n]
        self.k_positions[self.length:self.length + n] = self.positions[:n]
        self.length += n
        k, v = self.k[:self.length, self.rows], self.v[:self.length, self.rows]
        window = self.inner.ring_window(causal=True)
        out = turn_attention(query[:n].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), self.inner.cp_group,
                             q_positions=self.positions[:n], k_positions=self.k_positions[:self.length], mode=mode,
                             softmax_scale=self.inner.softmax_scale, window_size=(window[0], 0))
        out = out.transpose(0, 1).reshape(n, b, query.shape[2] * query.shape[3])
        return torch.cat([out, out.new_zeros(sq - n, b, out.shape[-1])]) if n < sq else out

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None) -> torch.Tensor:
        """``[sq, b, np, hn]``, ``[sq, b, ng, hn]`` x2 -> ``[sq, b, np * hn]``; sq = 1 when decoding."""
        self._ensure(key)
        sq, b = key.shape[:2]
        rows = self.rows
        if self.turn is not None:
            return self._turn(query, key, value)
        if not self.decoding:
            self.length = 0
            self._room(sq)
            self.k[:sq, rows], self.v[:sq, rows] = key, value
            self.k_positions[:sq] = self.positions
            self.length = sq
            return self.inner(query, key, value, None, attn_mask_type=AttnMaskType.causal)
        if self.owner:
            self._room(1)
            self.k[self.length, rows], self.v[self.length, rows] = key[0], value[0]
            self.k_positions[self.length] = self.positions[0]
        end = self.length + int(self.owner)
        k, v = self.k[:end, rows], self.v[:end, rows]
        if isinstance(self.inner, RingAttention):
            window = self.inner.ring_window(causal=True)
            out = decode_attention(query.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), self.inner.cp_group,
                                   softmax_scale=self.inner.softmax_scale, check_consistency=self.check,
                                   window_size=window, q_positions=self.positions, k_positions=self.k_positions[:end])
            return out.transpose(0, 1).reshape(sq, b, -1)
        # Megatron's DotProductAttention applies no causal mask to a single query (sq = 1); with a
        # window its window mask keeps the last left + 1 cached keys, the newest token's window.
        return self.inner(query, k.contiguous(), v.contiguous(), None, attn_mask_type=AttnMaskType.no_mask)


@torch.no_grad()
def draw_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill ``model`` (any TP/PP layout) with the global model of ``seed``.

    Each parameter is drawn whole, from a generator seeded by ``seed`` and its global name, then
    cut to this rank's TP shard: matrices ``N(0, 1/fan_in)`` (embeddings ``N(0, 1)``), norm
    weights 1, biases 0.
    """
    inner = unwrap(model)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for name, param in inner.named_parameters():
        key = global_name(inner, name)
        if key == "output_layer.weight" and inner.share_embeddings_and_output_weights:
            key = "embedding.word_embeddings.weight"  # the last stage's copy of tied embeddings (pp > 1)
        shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False):
            shape[param.partition_dim] *= tp
        if param.dim() == 1:
            full = torch.ones(shape) if "norm" in key and key.endswith("weight") else torch.zeros(shape)
        else:
            gen = torch.Generator(device=param.device).manual_seed(seed + zlib.crc32(key.encode()))
            full = torch.randn(shape, generator=gen, device=param.device, dtype=torch.float32)
            if "embedding" not in key:
                full /= math.sqrt(shape[1])
        param.copy_(shard_of(param, full.to(param.device), gated=is_gated_fc1(inner, key)))


class MegatronRunner(DeepSpeedPassThrough, MegatronConversations):
    """:class:`~megatron_ring.inference.runners.protocol.ScoringRunner` of a Megatron-core GPT (Note [Sharded KV
    cache])."""

    takes_padding = False

    def __init__(self, cfg: GPTConfig, groups: ParallelGroups, *, dtype: torch.dtype, device: torch.device,
                 seed: int, batch: int, prompt_len: int, new_tokens: int,
                 weights: Optional[Mapping[str, torch.Tensor]] = None, tokenizer: Any = None) -> None:
        """``weights``: the unsharded state dict to load (a checkpoint's :class:`HFWeights`), None: drawn
        from ``seed`` (:func:`draw_weights`); ``tokenizer``: the checkpoint's."""
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype {dtype} is not supported; allowed: {list(_DTYPE_NAMES)}")
        self.cfg = cfg.model_copy(update={"dtype": _DTYPE_NAMES[dtype]})
        self.groups = groups
        self.device = device
        self.dtype = dtype
        self.vocab_size = cfg.model.vocab_size
        timeout_s = None if groups.timeout is None else groups.timeout.total_seconds()
        init_megatron(groups.layout, device=device, seed=seed, timeout_s=timeout_s)
        ps = parallel_state
        self.cp_rank, self.cp_size = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.module = unwrap(build_gpt_model(self.cfg, **({} if weights is None else weights_to_be_loaded())))
        self.sequence_parallel = cfg.parallel.sequence_parallel  # Note [Sequence parallelism in the runner]
        if self.last:
            self.module.output_layer.sequence_parallel = False  # _logits gets whole (gathered) hidden states
        self.attention_kernel = "megatron-local" if cfg.attention == "local" else \
            block_kernel_name(device, dtype, cfg.model.kv_channels)
        self.module.eval()
        if weights is None:
            draw_weights(self.module, seed)
        else:
            load_full_state_dict(self.module, weights)
        self.tokenizer = tokenizer
        self.capacity = prompt_len // self.cp_size + -(-(new_tokens - 1) // self.cp_size)
        self.caches = []
        for layer in self.module.decoder.layers:
            attention = layer.self_attention
            attention.core_attention = CachedCoreAttention(
                attention.core_attention, batch=batch, capacity=self.capacity, dtype=dtype, device=device)
            self.caches.append(attention.core_attention)
        self._rope = None  # [seq_length, 1, 1, head_dim] RoPE angles of every global position
        if cfg.model.position_embedding == "rope":
            self._rope = self.module.rotary_pos_emb.get_emb(cfg.model.seq_length).to(device)
        self._pos = -1
        self._step = 0

    # -- pieces of GPTModel.forward, with explicit global positions -----------------------------

    def _pipelined(self, ids: torch.Tensor, positions: torch.Tensor, micro_batches: int, *,
                   every_position: bool = False) -> Optional[torch.Tensor]:
        """:meth:`_stage` over ``micro_batches`` micro-batches of ``ids`` ``[b, s]`` (Note [Pipelined
        micro-batches]); the last stage returns the final hidden state of the last position ``[1, b, h]``
        (``every_position``: of every position, ``[s, b, h]``)."""
        b = ids.shape[0]
        step = -(-b // micro_batches)
        outs = []
        for start in range(0, b, step):
            rows = slice(start, start + step)
            for cache in self.caches:
                cache.rows, cache.positions = rows, positions
            # Megatron's sequence-parallel collectives allocate on CUDA (Note [Megatron-core on CPU])
            with cuda_calls_on_cpu() if self.module.config.sequence_parallel else nullcontext():
                outs.append(self._stage(ids[rows], positions, every_position=every_position))
        return torch.cat(outs, dim=1) if self.last else None

    def _stage(self, ids: torch.Tensor, positions: torch.Tensor, *, every_position: bool = False
               ) -> Optional[torch.Tensor]:
        """This PP stage on ``ids`` ``[b, s]`` at global ``positions`` ``[s]``; the last stage returns
        the final hidden state of the last position ``[1, b, h]`` (``every_position``: ``[s, b, h]``)."""
        b, s = ids.shape
        model = self.module
        split = model.config.sequence_parallel  # [s / tp, b, h] between the TP regions
        if self.first:
            hidden = model.embedding(input_ids=ids, position_ids=positions.expand(b, -1))
        else:
            hidden = torch.empty(s // self.groups.layout.tp if split else s, b, model.config.hidden_size,
                                 dtype=self.dtype, device=self.device)
            dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        rope = None if self._rope is None else self._rope[positions]
        for layer in model.decoder.layers:
            hidden, _ = layer(hidden, attention_mask=None, rotary_pos_emb=rope)
        if not self.last:
            dist.send(hidden.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            return None
        if split:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return model.decoder.final_layernorm(hidden if every_position else hidden[-1:])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Whole-vocabulary fp32 logits ``[s, b, vocab]`` of the last stage's ``hidden`` ``[s, b, h]``
        (the output layer's TP shards all-gathered)."""
        model = self.module
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        logits, _ = model.output_layer(hidden, weight=weight)
        logits = logits.float()
        tp_group = parallel_state.get_tensor_model_parallel_group()
        if tp_group.size() > 1:
            parts = [torch.empty_like(logits) for _ in range(tp_group.size())]
            dist.all_gather(parts, logits.contiguous(), group=tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits

    def _greedy(self, hidden: Optional[torch.Tensor], src_cp_rank: Optional[int], b: int) -> torch.Tensor:
        """Greedy ids ``[b]`` on all ranks from the last stage's ``hidden`` ``[1, b, h]``.

        ``src_cp_rank``: the CP rank whose ``hidden`` counts (None: all CP ranks agree already).
        """
        ps = parallel_state
        ids = torch.empty(b, dtype=torch.int64, device=self.device)
        if self.last:
            ids.copy_(self._logits(hidden)[-1].argmax(dim=-1))
            if src_cp_rank is not None and self.cp_size > 1:
                cp_group = ps.get_context_parallel_group()
                dist.broadcast(ids, src=dist.get_global_rank(cp_group, src_cp_rank), group=cp_group)
        pp_group = ps.get_pipeline_model_parallel_group()
        if pp_group.size() > 1:
            dist.broadcast(ids, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group)
        return ids

    # -- ModelRunner -----------------------------------------------------------------------------

    def kv_cache_bytes(self) -> int:
        return sum(cache.nbytes() for cache in self.caches)

    def reset(self) -> None:
        for cache in self.caches:
            cache.length, cache.decoding = 0, False
        self._pos, self._step = -1, 0

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        refuse_padding('megatron', attention_mask)
        b, length = prompt_ids.shape
        self.reset()
        ids = shard_sequence(prompt_ids.to(self.device), self.cp_rank, self.cp_size)
        positions = local_positions(length, self.cp_rank, self.cp_size, device=self.device)
        hidden = self._pipelined(ids, positions, b if self.groups.layout.pp > 1 else 1)
        self._pos = length
        # Zigzag puts the last global token (chunk 2P-1) last on CP rank 0.
        return self._greedy(hidden, 0, b)

    @torch.no_grad()
    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        if self._pos < 0:
            raise RuntimeError("decode() before prefill(): call reset() then prefill(prompt) first")
        owner = self._pos % self.cp_size == self.cp_rank  # round-robin (a prefill's length is a multiple of cp)
        for cache in self.caches:
            cache.decoding, cache.owner, cache.check = True, owner, self._step == 0
        positions = torch.tensor([self._pos], device=self.device)
        with sequence_parallel_off(self.module):  # one token cannot split over TP
            hidden = self._pipelined(ids.to(self.device)[:, None], positions,
                                     min(self.groups.layout.pp, ids.shape[0]))
        for cache in self.caches:
            cache.length += int(owner)
        self._pos += 1
        self._step += 1
        # Every CP rank computed the same token, so the ids agree without a CP broadcast.
        return self._greedy(hidden, None, ids.shape[0])


    @torch.no_grad()
    def score(self, ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
              chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``ScoringRunner.score``. Rows of different lengths come right-padded (Note [Right padding
        for scores] in protocol.py); the sequence is right-padded here to a multiple of ``2 cp`` too (with
        sequence parallelism of ``cp * tp`` as well)."""
        refuse_padding("megatron", attention_mask)
        b, length = ids.shape
        ids = ids.to(self.device)
        multiple = math.lcm(2 * self.cp_size, self.cp_size * self.groups.layout.tp) if self.sequence_parallel \
            else 2 * self.cp_size
        full = torch.cat([ids, ids[:, -1:].expand(b, -length % multiple)], dim=1)
        self.reset()
        positions = local_positions(full.shape[1], self.cp_rank, self.cp_size, device=self.device)
        hidden = self._pipelined(shard_sequence(full, self.cp_rank, self.cp_size), positions,
                                 b if self.groups.layout.pp > 1 else 1, every_position=True)
        both = torch.empty(b, positions.shape[0], 2, dtype=torch.float32, device=self.device)
        if self.last:  # hidden [s_local, b, h]; the target of local position i is the token after it
            targets = full[:, (positions + 1).clamp(max=full.shape[1] - 1)].t()  # [s_local, b]
            for start in range(0, positions.shape[0], chunk):
                part = slice(start, start + chunk)
                logits = self._logits(hidden[part])  # [chunk, b, vocab]
                logprob = torch.log_softmax(logits, dim=-1).gather(-1, targets[part, :, None])[..., 0]
                both[:, part] = torch.stack([logprob, logits.argmax(-1).float()], -1).transpose(0, 1)  # ids < 2**24
        ps = parallel_state
        if ps.get_pipeline_model_parallel_group().size() > 1:
            dist.broadcast(both, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        if self.cp_size > 1:
            parts = [torch.empty_like(both) for _ in range(self.cp_size)]
            dist.all_gather(parts, both, group=ps.get_context_parallel_group())
            both = unshard_sequence(parts, dim=1)
        self.reset()
        return both[:, :length - 1, 0], both[:, :length, 1].long()


def build_runner(model: dict[str, Any], groups: ParallelGroups, *, dtype: torch.dtype, device: torch.device,
                 seed: int, batch: int, prompt_len: int, new_tokens: int) -> MegatronRunner:
    """:class:`~megatron_ring.inference.runners.protocol.RunnerFactory` of a ``configs/megatron`` GPT: random
    weights from ``seed``, or a transformers checkpoint's (each rank reads its TP shard of its PP stage, Note
    [Sharded loading] in ``integrations/megatron/hf_checkpoint.py``)."""
    sizes = dict(dtype=dtype, device=device, seed=seed, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens)
    file = parse_model_file(model, where=WHERE)
    if isinstance(file, GPTConfig):
        return MegatronRunner(file, groups, **sizes)
    weights, tokenizer = load_weights(file, where=WHERE)
    return MegatronRunner(file.with_model(weights.fields, where=WHERE), groups, weights=weights, tokenizer=tokenizer,
                          **sizes)
