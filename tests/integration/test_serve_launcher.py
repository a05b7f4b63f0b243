"""megatron-ring serve under torchrun at cp 2, driven by the openai client: chat, streaming, two concurrent
conversations, a follow-up turn from the sharded cache (equal to one process recomputing it), refusals,
a client gone mid-stream, and SIGTERM draining every rank."""
from __future__ import annotations

import functools
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_ring.testing.tiny_hf import save_tiny_model
from tests.integration.hf_runner_workers import CHAT_TEMPLATE
from tests.integration.test_inference_launcher import start, stop

pytestmark = [pytest.mark.integration, pytest.mark.launcher]
openai = pytest.importorskip("openai")
if shutil.which("curl") is None:
    pytest.skip("curl not installed", allow_module_level=True)
TIMEOUT_S = 120
MODEL = "tiny"


def _url(log: Path, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"on (http://\S+/v1)", log.read_text(errors="replace"))
        if found:
            return found.group(1)
        time.sleep(0.2)
    raise AssertionError(f"the server did not start (exit {proc.poll()}):\n{log.read_text()[-3000:]}")


@functools.lru_cache(maxsize=1)
def _model(checkpoint: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval(),
            AutoTokenizer.from_pretrained(checkpoint))


def _reference(checkpoint: str, messages: list[dict], max_tokens: int) -> str:
    model, tokenizer = _model(checkpoint)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt = torch.tensor([ids["input_ids"]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)


def test_openai_client_against_the_launched_server(tmp_path):
    checkpoint = save_tiny_model("llama", tmp_path / "tiny")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(checkpoint)
    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"dtype": "fp32", "megatron_ring": {
        "model": {"runner": "hf", "config": {"checkpoint": checkpoint}}, "layout": {"cp": 2},
        "workload": {"batch": 1, "prompt_len": 4, "new_tokens": 2},
        "serve": {"port": 0, "served_model_name": MODEL, "max_tokens": 6, "cache_budget_tokens": 400}}}))
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = start([sys.executable, "-m", "megatron_ring.cli", "serve", str(config)], stdout=out)
    try:
        client = openai.OpenAI(base_url=_url(log, proc), api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [MODEL]
        first = [{"role": "user", "content": "the quick brown fox " * 8 + "what jumps?"}]
        answer = client.chat.completions.create(model=MODEL, messages=first, max_tokens=6)
        assert answer.choices[0].message.content == _reference(checkpoint, first, 6)
        # a follow-up turn: the conversation so far comes from the cache, only the rest is prefilled
        second = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                          {"role": "user", "content": "and then?"}]
        follow = client.chat.completions.create(model=MODEL, messages=second, max_tokens=6)
        assert follow.usage.prompt_tokens_details.cached_tokens > len(first[0]["content"])
        assert follow.choices[0].message.content == _reference(checkpoint, second, 6)
        # streaming gives the same text as one piece
        pieces = [c.choices[0].delta.content or "" for c in
                  client.chat.completions.create(model=MODEL, messages=first, max_tokens=6, stream=True)]
        assert "".join(pieces) == answer.choices[0].message.content
        # two conversations at once, each as it is alone
        other = [{"role": "user", "content": "a different and much shorter one"}]
        results = {}
        threads = [threading.Thread(target=lambda k, m: results.__setitem__(k, client.chat.completions.create(
            model=MODEL, messages=m, max_tokens=6).choices[0].message.content), args=(k, m))
            for k, m in (("first", first), ("other", other))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
        assert results == {"first": answer.choices[0].message.content, "other": _reference(checkpoint, other, 6)}
        # refusals name the field; the server goes on
        for kwargs, status, needle in ((dict(model="nope"), 404, "does not exist"),
                                       (dict(max_tokens=0), 400, "max_tokens = 0"),
                                       (dict(max_tokens=10 ** 6), 400, "max_tokens = 1000000"),
                                       (dict(temperature=0.7), 400, "greedily")):
            with pytest.raises(openai.APIStatusError) as err:
                client.chat.completions.create(**{"model": MODEL, "messages": first, "max_tokens": 6, **kwargs})
            assert err.value.status_code == status and needle in err.value.message, err.value.message
        too_long = [{"role": "user", "content": "x" * 600}]
        with pytest.raises(openai.BadRequestError, match="exceeds the model's window of 512"):
            client.chat.completions.create(model=MODEL, messages=too_long, max_tokens=6)
        # curl: a malformed body, then a plain request
        base = str(client.base_url).rstrip("/")
        curl = ["curl", "-s", "-w", "\n%{http_code}", "-H", "content-type: application/json", "-d"]
        body, code = subprocess.run(curl + ["{not json", base + "/chat/completions"], capture_output=True, text=True,
                                    timeout=60).stdout.rsplit("\n", 1)
        assert code == "400" and "not valid JSON" in json.loads(body)["error"]["message"]
        body, code = subprocess.run(curl + [json.dumps({"model": MODEL, "messages": first, "max_tokens": 6}),
                                           base + "/chat/completions"], capture_output=True, text=True,
                                    timeout=60).stdout.rsplit("\n", 1)
        assert code == "200" and json.loads(body)["choices"][0]["message"]["content"] == \
            answer.choices[0].message.content
        # a client that leaves mid-stream: its request is cancelled, the next one is served
        stream = client.chat.completions.create(model=MODEL, messages=other, max_tokens=6, stream=True)
        next(iter(stream))
        stream.close()
        again = client.chat.completions.create(model=MODEL, messages=first, max_tokens=6)
        assert again.choices[0].message.content == answer.choices[0].message.content
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) is not None
        text = log.read_text()
        assert "drained and stopped" in text, text[-3000:]
        assert "Traceback" not in text.split("drained and stopped")[0], text[-3000:]
    finally:
        stop(proc)
