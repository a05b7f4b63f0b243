"""The serving loop on every rank of a gloo pool (no HTTP): rounds of plans through a real runner.

Each conversation is a first document then follow-up questions; each turn's prompt is the
conversation so far (prompt, answer, question), as an OpenAI client sends it.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from megatron_ring import ParallelLayout, init_parallel
from megatron_ring.serving.engine import GenRequest, Plan, ServeLoop

MAX_TOKENS = 5
EOS = 257


def conversations(seed: int = 5) -> list[list[list[int]]]:
    """Three conversations: documents of 41, 7 and 26 tokens, then questions of 6 and 1 tokens (the first two)."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(0, 256, (n,), generator=gen).tolist()  # noqa: E731
    return [[draw(41), draw(6), draw(1)], [draw(7), draw(6)], [draw(26)]]


def build(runner: str, model: dict[str, Any], sizes: dict[str, int]) -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if runner == "hf":
        from megatron_ring.inference.runners.hf import build_runner
    else:
        from megatron_ring.inference.runners.gpt import build_runner
    groups = init_parallel(ParallelLayout(**sizes))
    built = build_runner(model, groups, dtype=torch.float32, device=torch.device("cpu"), seed=0, batch=1,
                         prompt_len=2 * groups.layout.cp, new_tokens=2)
    built.init_deepspeed({"dtype": "fp32", "replace_with_kernel_inject": False,
                          "tensor_parallel": {"tp_size": sizes.get("tp", 1)}})
    return built


def serve_conversations(runner: str, model: dict[str, Any], sizes: dict[str, int], mode: str,
                        budget: int) -> dict[str, Any]:
    """Every conversation's turns through :class:`ServeLoop`: the first turns of all three in one round (ragged),
    then each follow-up as soon as its previous answer is done. Returns the prompts, answers and cached prefixes."""
    built = build(runner, model, sizes)
    events: dict[str, list] = {}
    loop = ServeLoop(built, budget_tokens=budget, turn_mode=mode,
                     emit=lambda rid, token, finish, info: events.setdefault(rid, []).append((token, finish, info)),
                     log=lambda msg: None)
    convs = conversations()
    prompts = {f"c{i}": list(turns[0]) for i, turns in enumerate(convs)}
    next_turn = {rid: 1 for rid in prompts}
    out: dict[str, list] = {rid: [] for rid in prompts}
    plan = Plan(new=[GenRequest(f"{rid}.0", prompts[rid], MAX_TOKENS, [EOS]) for rid in prompts])
    while plan.new or not loop.idle:
        loop.run_round(plan)
        plan = Plan()
        for rid in prompts:
            key = f"{rid}.{next_turn[rid] - 1}"
            done = events.get(key, [])
            if done and done[-1][1] is not None and len(out[rid]) < next_turn[rid]:
                answer = [t for t, _, _ in done if t is not None]
                cached = next(info["cached_tokens"] for t, _, info in done if "cached_tokens" in info)
                out[rid].append({"prompt": list(prompts[rid]), "answer": answer, "cached": cached})
                turns = convs[int(rid[1:])]
                if next_turn[rid] < len(turns):
                    prompts[rid] = prompts[rid] + answer + turns[next_turn[rid]]
                    plan.new.append(GenRequest(f"{rid}.{next_turn[rid]}", prompts[rid], MAX_TOKENS, [EOS]))
                    next_turn[rid] += 1
    return {"turns": out, "evicted": loop.store.evicted}


def alone(path: str, prompt: list[int]) -> list[int]:
    """transformers (eager, fp32, one process) greedy answer of ``prompt``, stopping at EOS or MAX_TOKENS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=EOS, pad_token_id=EOS)
    return out[0, ids.shape[1]:].tolist()


def shared_prefix(runner: str, model: dict[str, Any], sizes: dict[str, int]) -> dict[str, Any]:
    """Two conversations about one document, one after the other: the second copies the shared prefix from
    the first one's cache, which stays for the first one's follow-up."""
    built = build(runner, model, sizes)
    events: dict[str, list] = {}
    loop = ServeLoop(built, budget_tokens=10_000, turn_mode="auto",
                     emit=lambda rid, token, finish, info: events.setdefault(rid, []).append((token, finish, info)),
                     log=lambda msg: None)
    document, first_q, second_q, follow = conversations()[0][0], [1, 2, 3], [4, 5], [6, 7, 8]

    def serve(rid: str, prompt: list[int]) -> tuple[list[int], int]:
        loop.run_round(Plan(new=[GenRequest(rid, prompt, MAX_TOKENS, [EOS])]))
        while not loop.idle:
            loop.run_round(Plan())
        answer = [t for t, _, _ in events[rid] if t is not None]
        return answer, next(i["cached_tokens"] for _, _, i in events[rid] if "cached_tokens" in i)

    one = document + first_q
    answer_one, _ = serve("one", one)
    two = document + second_q
    answer_two, cached_two = serve("two", two)
    three = one + answer_one + follow
    answer_three, cached_three = serve("three", three)
    return {"prompts": [one, two, three], "answers": [answer_one, answer_two, answer_three],
            "cached": [cached_two, cached_three], "conversations": len(loop.store.conversations)}
