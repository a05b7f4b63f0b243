"""What the planner plans: a model's sizes, a workload, a layout (:class:`PlanInput`), and its alternative.

:func:`layer_costs` holds the per-layer FLOPs and bytes of Note [The cost model] (cost_model.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ring.costs.comm_choice import attention_flops
from megatron_ring.attention.comms import COMM_CHOICES
from megatron_ring.parallel.layout import ParallelLayout
from megatron_ring.perf.planner.hardware import DTYPE_BYTES, HardwareProfile


def _int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a dense decoder-only transformer that the cost model needs."""

    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    num_kv_heads: int = 0
    """K/V heads (GQA); 0 means ``num_heads``."""
    head_dim: int = 0
    """0 means ``hidden_size // num_heads``."""
    gated_mlp: bool = False
    vocab_size: int = 0
    """0 leaves the embeddings out of the memory count."""
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size"):
            _int(f"model.{name}", getattr(self, name))
        for name in ("num_kv_heads", "head_dim", "vocab_size"):
            _int(f"model.{name}", getattr(self, name), minimum=0)
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"model.hidden_size = {self.hidden_size} is not divisible by model.num_heads = "
                                 f"{self.num_heads}; set model.head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_heads = {self.num_heads} must be a multiple of model.num_kv_heads = "
                             f"{self.num_kv_heads}")

    def params_per_layer(self) -> int:
        """Weights of one layer (QKV, output projection, MLP; norms and biases left out)."""
        d, dh = self.hidden_size, self.head_dim
        mlp_mats = 3 if self.gated_mlp else 2
        return d * (self.num_heads + 2 * self.num_kv_heads) * dh + self.num_heads * dh * d + mlp_mats * d * \
            self.ffn_hidden_size

    def embedding_params(self) -> int:
        """Input embedding plus output head (one matrix when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)


@dataclass(frozen=True)
class Workload:
    """``batch`` prompts of ``prompt_len`` tokens per data-parallel replica, ``new_tokens`` generated each."""

    batch: int
    prompt_len: int
    new_tokens: int = 1
    micro_batch: int = 1
    """Sequences per prefill forward pass (bounds activation memory; PP pipelines these)."""

    def __post_init__(self) -> None:
        for name in ("batch", "prompt_len", "new_tokens", "micro_batch"):
            _int(f"workload.{name}", getattr(self, name))
        if self.batch % self.micro_batch:
            raise ValueError(f"workload.batch = {self.batch} is not divisible by workload.micro_batch = "
                             f"{self.micro_batch}")


CP_COMMS: tuple[str, ...] = COMM_CHOICES
"""The planner's ``cp_comm`` choices (ring_attention's ``comm``)."""


@dataclass(frozen=True)
class PlanInput:
    """One job to plan: model, layout, workload, dtype, mask and the ring's communication."""

    name: str
    model: ModelDims
    layout: ParallelLayout
    workload: Workload
    dtype: str = "bf16"
    causal: bool = True
    cp_comm: str = "p2p"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.cp_comm not in CP_COMMS:
            raise ValueError(f"cp_comm must be one of {list(CP_COMMS)}, got {self.cp_comm!r}")
        m, lay = self.model, self.layout
        problems = []
        if m.num_layers % lay.pp:
            problems.append(f"model.num_layers = {m.num_layers} is not divisible by layout.pp = {lay.pp}")
        for name in ("num_heads", "ffn_hidden_size"):
            if getattr(m, name) % lay.tp:
                problems.append(f"model.{name} = {getattr(m, name)} is not divisible by layout.tp = {lay.tp}")
        if lay.cp > 1 and self.workload.prompt_len % (2 * lay.cp):
            problems.append(f"workload.prompt_len = {self.workload.prompt_len} is not divisible by 2*layout.cp = "
                            f"{2 * lay.cp} (zigzag)")
        if problems:
            raise ValueError(f"plan {self.name!r}: " + "; ".join(problems))

    @property
    def element_size(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def label(self) -> str:
        """``tp=8 pp=2`` style name of the layout (axes of size 1 left out)."""
        parts = [f"{k}={v}" for k, v in self.layout.sizes().items() if v > 1]
        return " ".join(parts) or "single"


def layer_costs(model: ModelDims, batch: int, seq: int, element_size: int, causal: bool) -> dict[str, dict[str, float]]:
    """FLOPs and HBM bytes of one layer's forward over ``batch`` x ``seq`` tokens (whole layer, one device)."""
    d, dh, h, hkv, f = model.hidden_size, model.head_dim, model.num_heads, model.num_kv_heads, model.ffn_hidden_size
    tok = batch * seq
    s = element_size
    mats = 3 if model.gated_mlp else 2
    qkv_w = d * (h + 2 * hkv) * dh
    return {
        "qkv_proj": {"flops": 2.0 * tok * qkv_w, "bytes": s * (qkv_w + tok * d + tok * (h + 2 * hkv) * dh)},
        "attention": {"flops": attention_flops(batch=batch, q_len=seq, k_len=seq, heads=h, head_dim=dh, causal=causal),
                      "bytes": s * tok * (2 * h + 2 * hkv) * dh},
        "out_proj": {"flops": 2.0 * tok * h * dh * d, "bytes": s * (h * dh * d + tok * h * dh + tok * d)},
        "mlp": {"flops": 2.0 * tok * mats * d * f, "bytes": s * (mats * d * f + 2 * tok * d + 2 * (mats - 1) * tok * f)},
    }


MAX_TP = 8
"""Largest tensor-parallel size the alternative baseline uses (one 8-GPU node, as Megatron recommends)."""


def alternative_layout(layout: ParallelLayout, hw: HardwareProfile) -> ParallelLayout:
    """The other scheme at the same world size: a ring of all model-parallel ranks, or TP (in a node) x PP."""
    ranks = layout.tp * layout.pp * layout.cp
    if layout.cp == 1:
        return ParallelLayout(cp=ranks, dp=layout.dp)
    tp = math.gcd(ranks, min(hw.devices_per_node, MAX_TP))
    return ParallelLayout(tp=tp, pp=ranks // tp, dp=layout.dp)
