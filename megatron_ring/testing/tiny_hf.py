"""Tiny Hugging Face causal LMs (Llama, Qwen2, Mistral, Gemma 2, Gemma 3) made locally: nothing is downloaded.

Each model has grouped-query attention (4 query heads, 2 K/V heads) and RoPE, random weights from
a fixed seed, and a byte-level tokenizer built in code (256 byte tokens + ``<s>``, ``</s>``,
``<pad>``; left padding). The Gemma models alternate a sliding-window layer and a full layer
(window 4096 unless ``sliding_window=`` says otherwise) and have no attention-logit softcapping
unless ``attn_logit_softcapping=`` sets it::

    path = save_tiny_model("llama", "/tmp/tiny-llama")          # config + weights + tokenizer
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")

``sample_prompts`` and ``check_matches_eager`` give the tests their prompts and their comparison
with the single-process eager model; ``check_refused`` their check that a model is refused. Needs
``transformers`` (and ``tokenizers``, which it depends on). Used by tests and the example.
"""
from __future__ import annotations

import os
from typing import Any

import torch

FAMILIES: tuple[str, ...] = ("llama", "qwen2", "mistral")
GEMMA_FAMILIES: tuple[str, ...] = ("gemma2", "gemma3")
ALL_FAMILIES: tuple[str, ...] = FAMILIES + GEMMA_FAMILIES
SPECIAL_TOKENS: tuple[str, ...] = ("<s>", "</s>", "<pad>")
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
VOCAB_SIZE = 260  # 256 bytes + 3 specials, rounded up to an even size


def sample_prompts(seed: int = 1) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Random byte prompts of batch 2: ``plain`` (16 tokens, no mask: no padding at cp 2 or 4) and
    ``padded`` (13 tokens, row 1 left-padded by 5 ``<pad>``, with its mask)."""
    gen = torch.Generator().manual_seed(seed)
    plain = torch.randint(0, 256, (2, 16), generator=gen)
    padded = torch.randint(0, 256, (2, 13), generator=gen)
    mask = torch.ones_like(padded)
    mask[1, :5] = 0
    padded[1, :5] = PAD_ID
    return {"plain": (plain, None), "padded": (padded, mask)}


def check_matches_eager(eager: Any, prompts: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                        per_rank: list[dict[Any, tuple[torch.Tensor, torch.Tensor]]], key: Any, label: str, *,
                        new_tokens: int, tol: float) -> None:
    """Assert that every rank's ``(logits, greedy ids)`` for ``(key, prompt name)`` equal the single-process
    ``eager`` model's: logits of the real (unpadded) tokens within relative error ``tol``, ids exactly."""
    from megatron_ring.attention.reference import rel_err

    for name, (ids, mask) in prompts.items():
        with torch.no_grad():
            ref_logits = eager(ids, attention_mask=mask).logits
            ref_tokens = eager.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
        real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
        for rank, results in enumerate(per_rank):
            logits, tokens = results[key, name]
            err = rel_err(logits[real], ref_logits[real])
            assert err <= tol, f"{label} {name} rank {rank}: rel err {err:.2e}"
            assert torch.equal(tokens, ref_tokens), f"{label} {name} rank {rank}: {tokens} != {ref_tokens}"


def check_refused(build: Any, match: str, entry: str, ids: torch.Tensor, new_tokens: int) -> None:
    """``build(attn_implementation)`` makes a model the ring must refuse with an error matching
    ``match``: at load with ``"ring"`` when ``entry == "load"``, else (loaded with ``"eager"``) at
    ``entry``, one of ``enable_ring_attention``, ``ring_forward``, ``ring_generate`` (on ``ids``)."""
    import pytest

    from megatron_ring.hf import enable_ring_attention, ring_forward, ring_generate

    if entry == "load":
        with pytest.raises(ValueError, match=match):
            build("ring")
        return
    model = build("eager")
    calls = {"enable_ring_attention": lambda: enable_ring_attention(model),
             "ring_forward": lambda: ring_forward(model, ids),
             "ring_generate": lambda: ring_generate(model, ids, max_new_tokens=new_tokens)}
    with pytest.raises(ValueError, match=match):
        calls[entry]()


def tiny_config(family: str = "llama", **overrides: Any):
    """A ``PretrainedConfig`` for a 2-layer model: hidden 64, 4 heads, 2 K/V heads, head_dim 16."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config
    from transformers.models.gemma3 import Gemma3TextConfig

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "gemma2": Gemma2Config,
               "gemma3": Gemma3TextConfig}
    if family not in classes:
        raise ValueError(f"family must be one of {list(ALL_FAMILIES)}, got {family!r}")
    fields: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False,
        initializer_range=0.2,  # sharp attention and well-separated logits, so tests see real differences
    )
    if family == "mistral":
        fields["sliding_window"] = None  # full causal attention; set an int for a windowed model
    if family in GEMMA_FAMILIES:
        fields.update(query_pre_attn_scalar=16, attn_logit_softcapping=None,
                      layer_types=["sliding_attention", "full_attention"])
    fields.update(overrides)
    return classes[family](**fields)


def tiny_model(family: str = "llama", *, seed: int = 0, attn_implementation: str = "eager",
               dtype: torch.dtype = torch.float32, **overrides: Any):
    """A randomly initialised ``*ForCausalLM`` (eval mode) from :func:`tiny_config`; same seed, same weights."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()


def byte_tokenizer():
    """A fast byte-level tokenizer (ids 0-255 are bytes; specials 256-258), left padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", padding_side="left",
    )


def _byte_of(ch: str) -> int:
    """The byte that the GPT-2 byte-level alphabet maps to ``ch``."""
    code = ord(ch)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    if code in printable:
        return code
    missing = [b for b in range(256) if b not in printable]
    return missing[code - 256]


def save_tiny_model(family: str, path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> str:
    """Write config, random weights (``save_pretrained``) and the byte tokenizer to ``path``; return it."""
    path = os.fspath(path)
    tiny_model(family, seed=seed, **overrides).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] not in ALL_FAMILIES:
        sys.exit(f"usage: python -m megatron_ring.testing.tiny_hf {{{','.join(ALL_FAMILIES)}}} DIRECTORY")
    print(save_tiny_model(sys.argv[1], sys.argv[2]))
