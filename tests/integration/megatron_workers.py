"""Workers for the Megatron integration tests, run on every rank of a GlooPool (module-level so they pickle)."""
from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from megatron_ring.integrations.megatron.equivalence import compare_to_reference, cp1_reference, rel_max
from megatron_ring.integrations.megatron.state import init_megatron
from megatron_ring.parallel.layout import ParallelLayout


def _attention_config(**overrides: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _expect_error(fn: Callable[[], Any]) -> str:
    """Run ``fn``; return ``"TypeName: message"`` of the ValueError/TypeError it raises ("" if none)."""
    try:
        fn()
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return ""


def _reference_key(cfg_data: Mapping[str, Any], docs: Optional[tuple[int, ...]]) -> str:
    """What the cp = 1 reference depends on: everything but the name, the attention and the parallel
    sizes, and the packed documents' lengths (None: the unpacked batch)."""
    return json.dumps([{k: v for k, v in cfg_data.items() if k not in ("name", "attention", "parallel")}, docs],
                      sort_keys=True)


def _layout_key(cfg_data: Mapping[str, Any], world: int) -> str:
    from megatron_ring.config.gpt import GPTConfig

    return repr(GPTConfig.parse(cfg_data).check_world_size(world))


def compare_cases(cases: Mapping[str, tuple[Any, ...]]) -> dict[str, tuple[bool, Any]]:
    """Every case of this pool's world size, in one call: ``name -> (world, cfg)`` runs
    ``compare_to_reference(cfg)``, ``name -> (world, cfg, doc_lengths)`` runs
    ``compare_packed_to_reference(cfg, doc_lengths)``.

    Each distinct cp = 1 reference (configs with the same model and dtype share one) is made once,
    all of them first under one ``dp = world`` parallel_state; the cases then run grouped by layout,
    so Megatron's parallel_state is re-initialised once per layout, not twice per case. Results per
    case as ``megatron_ring.testing.gloo.run_cases`` gives them: ``(True, result)`` or ``(False, traceback)``.
    """
    from megatron_ring.integrations.megatron.equivalence import compare_packed_to_reference, cp1_packed_reference
    from megatron_ring.testing.gloo import run_cases

    world = dist.get_world_size()
    mine = {name: (case[1], tuple(case[2]) if len(case) > 2 else None)
            for name, case in cases.items() if case[0] == world}
    layouts: dict[str, list[str]] = {}
    for name, (cfg, _) in mine.items():
        layouts.setdefault(_layout_key(cfg, world), []).append(name)
    order = [name for names in layouts.values() for name in names]
    references: dict[str, Any] = {}

    def one(name: str) -> dict[str, Any]:
        for cfg, docs in mine.values():  # every reference before the first layout switch
            key = _reference_key(cfg, docs)
            if key not in references:
                references[key] = cp1_reference(cfg) if docs is None else cp1_packed_reference(cfg, docs)
        cfg, docs = mine[name]
        reference = references[_reference_key(cfg, docs)]
        if docs is None:
            return compare_to_reference(cfg, reference=reference)
        return compare_packed_to_reference(cfg, docs, reference=reference)

    return dict(zip(order, run_cases(one, [((name,), {}) for name in order])))


def case_results(per_rank: list[dict[str, tuple[bool, Any]]], case: str) -> list[Any]:
    """Every rank's result of ``case`` from :func:`compare_cases`; WorkerError with each failed rank's traceback."""
    from megatron_ring.testing.gloo import WorkerError

    failed = {rank: out[case][1] for rank, out in enumerate(per_rank) if not out[case][0]}
    if failed:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
        raise WorkerError(f"{case} failed on ranks {sorted(failed)}:\n{text}")
    return [out[case][1] for out in per_rank]


def core_attention_cp1_cases(seq: int = 16, batch: int = 2) -> dict[str, Any]:
    """cp = 1: RingAttention vs Megatron's DotProductAttention on the same q/k/v, and its refusals.

    Returns relative errors per case and the error message of each unsupported call.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ring.megatron import RingAttention

    init_megatron(ParallelLayout(dp=dist.get_world_size()))
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(seq, batch, 4, 16, generator=gen)
    k = torch.randn(seq, batch, 2, 16, generator=gen)
    v = torch.randn(seq, batch, 2, 16, generator=gen)
    causal_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    errors: dict[str, float] = {}
    for case, mask_type, scale, mask in (("causal", AttnMaskType.causal, None, None),
                                         ("no_mask", AttnMaskType.no_mask, None, None),
                                         ("causal_scale", AttnMaskType.causal, 0.3, None),
                                         ("causal_explicit_mask", AttnMaskType.causal, None, causal_mask)):
        config = _attention_config()
        ref = DotProductAttention(config, 1, mask_type, "self", softmax_scale=scale)
        ring = RingAttention(config, 1, mask_type, "self", softmax_scale=scale)
        errors[case] = rel_max(ring(q, k, v, mask), ref(q, k, v, mask))
    ring = RingAttention(_attention_config(), 1, AttnMaskType.causal, "self")
    training = RingAttention(_attention_config(attention_dropout=0.1), 1, AttnMaskType.causal, "self")
    training.train()
    refusals = {
        "attention_bias": _expect_error(lambda: ring(q, k, v, None, attention_bias=torch.zeros(1))),
        "arbitrary_mask": _expect_error(lambda: ring(q, k, v, torch.rand(1, 1, seq, seq) > 0.5)),
        "packed_seq_params": _expect_error(lambda: ring(q, k, v, None, packed_seq_params=object())),
        "window_size": _expect_error(
            lambda: RingAttention(_attention_config(window_size=(4, -2)), 1, AttnMaskType.causal, "self")),
        "dropout_training": _expect_error(lambda: training(q, k, v, None)),
        "padding_mask_type": _expect_error(lambda: RingAttention(_attention_config(), 1, AttnMaskType.padding, "self")),
        "cp_comm_type_unknown": _expect_error(
            lambda: RingAttention(_attention_config(), 1, AttnMaskType.causal, "self", cp_comm_type="ulysses")),
    }
    training.eval()
    errors["dropout_eval"] = rel_max(training(q, k, v, None), ring(q, k, v, None))
    return {"errors": errors, "refusals": refusals}


def core_attention_window_cp1_cases(seq: int = 16, batch: int = 2) -> dict[str, float]:
    """cp = 1: windowed RingAttention vs windowed DotProductAttention, per layer of ``window_attn_skip_freq``."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ring.megatron import RingAttention

    init_megatron(ParallelLayout(dp=dist.get_world_size()))
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(seq, batch, 4, 16, generator=gen)
    k, v = (torch.randn(seq, batch, 2, 16, generator=gen) for _ in range(2))
    errors = {}
    for window, skip in (((3, 0), None), ((5, 0), 2), ((0, 0), None), ((20, 0), None)):
        config = _attention_config(window_size=window, window_attn_skip_freq=skip)
        for layer in (1, 2):
            ref = DotProductAttention(config, layer, AttnMaskType.causal, "self")
            ring = RingAttention(config, layer, AttnMaskType.causal, "self")
            errors[f"window{window}-skip{skip}-layer{layer}"] = rel_max(ring(q, k, v, None), ref(q, k, v, None))
    return errors


def thd_refusals(tokens: int = 16) -> dict[str, str]:
    """cp = 1: the packed_seq_params that RingAttention refuses, each with its error message."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ring.megatron import RingAttention

    init_megatron(ParallelLayout(dp=dist.get_world_size()))
    q = torch.randn(tokens, 4, 16)
    k = v = torch.randn(tokens, 2, 16)
    cu = torch.tensor([0, 6, tokens], dtype=torch.int32)
    ring = RingAttention(_attention_config(), 1, AttnMaskType.causal, "self")

    def call(mask: Any = None, query: torch.Tensor = q, **fields: Any) -> Callable[[], Any]:
        params = PackedSeqParams(**{"qkv_format": "thd", "cu_seqlens_q": cu, "cu_seqlens_kv": cu, **fields})
        return lambda: ring(query, k, v, mask, packed_seq_params=params)

    return {
        "sbhd": _expect_error(call(qkv_format="sbhd")),
        "cross": _expect_error(call(cu_seqlens_kv=torch.tensor([0, 8, tokens], dtype=torch.int32))),
        "hybrid": _expect_error(call(local_cp_size=2)),
        "mask": _expect_error(call(mask=torch.ones(1, 1, tokens, tokens, dtype=torch.bool))),
        "4d_query": _expect_error(call(query=q[:, None])),
        "short": _expect_error(call(cu_seqlens_q=torch.tensor([0, 6, tokens - 2], dtype=torch.int32),
                                    cu_seqlens_kv=torch.tensor([0, 6, tokens - 2], dtype=torch.int32))),
        "overlong": _expect_error(call(cu_seqlens_q_padded=torch.tensor([0, 4, tokens], dtype=torch.int32),
                                       cu_seqlens_kv_padded=torch.tensor([0, 4, tokens], dtype=torch.int32))),
        "float": _expect_error(call(cu_seqlens_q=cu.float(), cu_seqlens_kv=cu.float())),
    }


def thd_core_attention_cases(doc_lengths: tuple[int, ...] = (6, 9, 4), window: tuple[int, int] = (3, 2)) -> dict[str, float]:
    """cp = world: RingAttention on a packed THD row (documents padded to 2·cp) vs the float64 reference
    of each document's real tokens alone, causal and no-mask, with and without a window; padding outputs
    must be 0. Returns the relative error per case (padding: max |output|)."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ring.attention.reference import attention_reference, rel_err
    from megatron_ring.attention.sharding import unshard_sequence
    from megatron_ring.megatron import RingAttention, get_thd_batch_on_this_cp_rank, pack_documents

    cp = dist.get_world_size()
    init_megatron(ParallelLayout(cp=cp))
    gen = torch.Generator().manual_seed(5)
    docs = [{"q": torch.randn(n, 64, generator=gen), "k": torch.randn(n, 32, generator=gen),
             "v": torch.randn(n, 32, generator=gen)} for n in doc_lengths]
    batch, params = pack_documents(docs, 2 * cp)
    part = get_thd_batch_on_this_cp_rank(batch, params.cu_seqlens_q_padded)
    q, k, v = part["q"][0].view(-1, 4, 16), part["k"][0].view(-1, 2, 16), part["v"][0].view(-1, 2, 16)
    real = batch["loss_mask"][0].bool()
    errors: dict[str, float] = {}
    for mask_type in (AttnMaskType.causal, AttnMaskType.no_mask):
        for win in (None, window):
            config = _attention_config(context_parallel_size=cp, window_size=win)
            out = RingAttention(config, 1, mask_type, "self")(q, k, v, None, packed_seq_params=params)
            parts = [torch.empty_like(out) for _ in range(cp)]
            dist.all_gather(parts, out.contiguous())
            full = unshard_sequence(parts, dim=0, cu_seqlens=params.cu_seqlens_q_padded)
            causal = mask_type == AttnMaskType.causal
            ref = attention_reference(*(torch.cat([d[key] for d in docs]).view(sum(doc_lengths), -1, 16).double()
                                        for key in ("q", "k", "v")), causal=causal, cu_seqlens=params.cu_seqlens_q,
                                      window_size=(-1, -1) if win is None else (win[0], 0 if causal else win[1]))
            name = f"{mask_type.name}-window{win}"
            errors[name] = rel_err(full[real].view(-1, 4, 16), ref)
            errors[f"{name}-padding"] = float(full[~real].abs().max())
    return errors


def core_attention_mask_cp_cases(seq: int = 16, batch: int = 2) -> dict[str, Any]:
    """cp = world: the CP-sharded causal mask is accepted (same output as no mask); others are refused."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ring.megatron import RingAttention, get_batch_on_this_cp_rank

    cp = dist.get_world_size()
    init_megatron(ParallelLayout(cp=cp))
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(seq // cp, batch, 4, 16, generator=gen) for _ in range(3))
    full_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    mask = get_batch_on_this_cp_rank({"attention_mask": full_mask})["attention_mask"]
    ring = RingAttention(_attention_config(num_query_groups=4, context_parallel_size=cp), 1,
                         AttnMaskType.causal, "self")
    return {
        "cp_rank": ps.get_context_parallel_rank(),
        "mask_err": rel_max(ring(q, k, v, mask), ring(q, k, v, None)),
        "unsharded_mask": _expect_error(lambda: ring(q, k, v, full_mask)),
        "wrong_mask": _expect_error(lambda: ring(q, k, v, ~mask)),
    }


def batch_split_matches_megatron(seq: int = 16) -> bool:
    """Our get_batch_on_this_cp_rank equals megatron.core.utils.get_batch_on_this_cp_rank on this rank."""
    from megatron.core import utils as mcore_utils

    from megatron_ring.megatron import get_batch_on_this_cp_rank

    init_megatron(ParallelLayout(cp=dist.get_world_size()))
    batch = {
        "tokens": torch.arange(2 * seq).view(2, seq),
        "labels": torch.arange(2 * seq).view(2, seq) + 1,
        "loss_mask": torch.rand(2, seq),
        "position_ids": torch.arange(seq).expand(2, -1),
        "attention_mask": torch.rand(1, 1, seq, seq) > 0.5,
    }
    ours = get_batch_on_this_cp_rank(batch)
    theirs = mcore_utils.get_batch_on_this_cp_rank(dict(batch))
    return all(torch.equal(ours[key], theirs[key]) for key in batch)


def model_module_types(cfg_data: dict[str, Any]) -> dict[str, Any]:
    """Build ``cfg_data``'s model on this rank; return ``{module name: class name}`` and parameter names/shapes."""
    from megatron_ring.config.gpt import GPTConfig
    from megatron_ring.megatron import build_gpt_model

    cfg = GPTConfig.parse(cfg_data)
    init_megatron(cfg.check_world_size(dist.get_world_size()))
    model = build_gpt_model(cfg)
    return {
        "modules": {name: type(mod).__name__ for name, mod in model.named_modules()},
        "params": {name: tuple(p.shape) for name, p in model.named_parameters()},
    }


def generate_with_runner(cfg_data: dict[str, Any], layout: ParallelLayout, *, batch: int = 2, prompt_len: int = 16,
                         new_tokens: int = 6, seed: int = 1234, dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Greedy tokens ``[batch][new_tokens]`` from :class:`MegatronRunner` (prefill + decode) for ``layout``."""
    from megatron_ring.inference.runners.gpt import build_runner
    from megatron_ring.parallel.groups import init_parallel

    groups = init_parallel(layout)
    runner = build_runner(cfg_data, groups, dtype=dtype, device=torch.device("cpu"), seed=seed, batch=batch,
                          prompt_len=prompt_len, new_tokens=new_tokens)
    prompt = torch.randint(0, runner.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    out = [runner.prefill(prompt)]
    for _ in range(new_tokens - 1):
        out.append(runner.decode(out[-1]))
    return torch.stack(out, dim=1).tolist()


def greedy_across_layouts(cases: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, tuple[bool, Any]]]:
    """Every case's greedy tokens, in one pool call: ``{case: {"reference": cfg, "layouts": {name: (cfg, layout)}}}``
    -> ``{case: {"reference" or layout name: (ok, tokens or traceback)}}``.

    All references (:func:`generate_without_cache`, one dp = world parallel_state) run first, then
    every case of one layout (:func:`generate_with_runner`) back to back, so parallel_state and the
    runner's process groups are made once per layout instead of once per layout and case.
    """
    from megatron_ring.testing.gloo import run_cases

    out: dict[str, dict[str, tuple[bool, Any]]] = {case: {} for case in cases}
    for case, spec in cases.items():
        out[case]["reference"] = run_cases(generate_without_cache, [((spec["reference"],), {})])[0]
    names = list(dict.fromkeys(name for spec in cases.values() for name in spec["layouts"]))
    for name in names:
        for case, spec in cases.items():
            if name in spec["layouts"]:
                cfg, layout = spec["layouts"][name]
                out[case][name] = run_cases(generate_with_runner, [((cfg, layout), {})])[0]
    return out


def generate_without_cache(cfg_data: dict[str, Any], *, batch: int = 2, prompt_len: int = 16, new_tokens: int = 6,
                           seed: int = 1234) -> list[list[int]]:
    """Reference greedy tokens: Megatron's plain GPTModel forward over the whole sequence at every step.

    tp = pp = cp = 1 on every rank, local attention, no KV cache, weights of
    :func:`megatron_ring.inference.runners.gpt.draw_weights`.
    """
    from megatron_ring.config.gpt import GPTConfig
    from megatron_ring.inference.runners.gpt import draw_weights
    from megatron_ring.megatron import build_gpt_model

    cfg = GPTConfig.parse({**cfg_data, "attention": "local", "parallel": {"tp": 1, "pp": 1, "cp": 1}})
    init_megatron(ParallelLayout(dp=dist.get_world_size()), seed=seed)
    model = build_gpt_model(cfg)
    model.eval()
    draw_weights(model, seed)
    vocab = cfg.model.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for _ in range(new_tokens):
            positions = torch.arange(ids.shape[1]).expand(batch, -1)
            logits = model(ids, positions, None)
            ids = torch.cat([ids, logits[:, -1].float().argmax(dim=-1, keepdim=True)], dim=1)
    return ids[:, prompt_len:].tolist()


def parallel_view_matches_layout(layout: ParallelLayout) -> dict[str, Any]:
    """``parallel_from_megatron()`` after Megatron's init for ``layout``: its ranks and ring vs ``layout``'s."""
    from megatron_ring.megatron import parallel_from_megatron

    init_megatron(layout)
    view = parallel_from_megatron()
    rank = dist.get_rank()
    expected = {axis: layout.group_of(axis, rank) for axis in view.ranks}
    ring = layout.group_of("cp", rank)
    me = ring.index(rank)
    return {
        "layout_equal": view.layout == layout,
        "ranks_equal": view.ranks == expected,
        "ring_equal": (view.cp_rank, view.ring_next, view.ring_prev)
        == (me, ring[(me + 1) % len(ring)], ring[(me - 1) % len(ring)]),
    }


def group_timeouts(layout: ParallelLayout, timeout_s: float) -> dict[str, float]:
    """Seconds of the timeout of each group Megatron created in ``init_megatron(layout, timeout_s=)``,
    read from the gloo backend's options (torch exposes ``Backend.options._timeout``)."""
    groups = init_megatron(layout, timeout_s=timeout_s)
    return {axis: group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for axis, group in groups.groups.items()}


def per_layer_comm_types() -> dict[str, Any]:
    """cp 4 = a2a 2 x ring 2: RingAttention of each layer takes its entry of a ``config.cp_comm_type``
    list, whatever comm megatron-core's TransformerLayer passes (one layer off), and ``a2a+p2p`` runs
    over Megatron's hierarchical groups."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ring.attention.comms import CPGroups
    from megatron_ring.megatron import RingAttention

    init_megatron(ParallelLayout(cp=4, cp_a2a=2))
    comms = ["a2a+p2p", "a2a", "all_gather"]
    config = _attention_config(num_layers=3, context_parallel_size=4, cp_comm_type=comms,
                               hierarchical_context_parallel_sizes=[2, 2])
    layers = [RingAttention(config, n, AttnMaskType.causal, "self", cp_comm_type=comms[n % 3]) for n in (1, 2, 3)]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(4, 2, 4, 16, generator=gen) for _ in range(3))
    try:
        outs = [layer(q, k, v, None) for layer in layers]
        return {"comms": [layer.cp_comm_type for layer in layers],
                "hierarchical": [isinstance(layer.ring_group, CPGroups) for layer in layers],
                "same_output": all(torch.allclose(o, outs[0], atol=1e-5) for o in outs)}
    finally:
        del layers


def core_attention_dilated_cases(seq: int = 24, batch: int = 2) -> dict[str, Any]:
    """cp = world: RingAttention built from ``get_gpt_layer_ring_spec(dilation={1: pairs})`` vs the
    float64 dilated reference (layer 1) and plain attention (layer 2, absent from the dict); and
    the refusals of dilation with a window and with tp > 1."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from megatron_ring import shard_sequence
    from megatron_ring.attention.reference import attention_reference, dilated_reference
    from megatron_ring.megatron import RingAttention, get_gpt_layer_ring_spec

    rank, size = dist.get_rank(), dist.get_world_size()
    init_megatron(ParallelLayout(cp=size))
    pairs = ((5, 1), (12, 2), (24, 4))
    leaf = get_gpt_layer_ring_spec(dilation={1: pairs}).submodules.self_attention.submodules.core_attention
    config = _attention_config(num_layers=2, context_parallel_size=size)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(batch, seq, 4, 16, generator=gen)
    k, v = (torch.randn(batch, seq, 2, 16, generator=gen) for _ in range(2))

    def sbhd_shard(t: torch.Tensor) -> torch.Tensor:  # [b, s, h, d] global -> [s_local, b, h, d]
        return shard_sequence(t, rank, size).transpose(0, 1)

    errors = {}
    refs = {1: dilated_reference(q, k, v, pairs, causal=True), 2: attention_reference(q, k, v, causal=True)}
    for layer, ref in refs.items():
        ring = build_module(leaf, config=config, layer_number=layer, attn_mask_type=AttnMaskType.causal,
                            attention_type="self")
        out = ring(sbhd_shard(q), sbhd_shard(k), sbhd_shard(v), None)
        expected = sbhd_shard(ref).reshape(out.shape)
        errors[f"layer{layer}"] = rel_max(out, expected)
    refusals = {
        "window": _expect_error(lambda: RingAttention(_attention_config(window_size=(4, 0), context_parallel_size=size),
                                                     1, AttnMaskType.causal, "self", dilation=pairs)),
        "heads": _expect_error(lambda: RingAttention(_attention_config(context_parallel_size=size), 1,
                                                     AttnMaskType.causal, "self", dilation=((8, 5),))),
    }
    return {"errors": errors, "refusals": refusals}


def dilated_model_layers(cfg_data: dict[str, Any]) -> list[Any]:
    """Build ``cfg_data``'s model on this rank; every RingAttention's ``(dilation, cp_comm_type)``."""
    from megatron_ring.config.gpt import GPTConfig
    from megatron_ring.megatron import RingAttention, build_gpt_model

    cfg = GPTConfig.parse(cfg_data)
    init_megatron(cfg.check_world_size(dist.get_world_size()))
    return [(m.dilation, m.cp_comm_type) for m in build_gpt_model(cfg).modules() if isinstance(m, RingAttention)]
