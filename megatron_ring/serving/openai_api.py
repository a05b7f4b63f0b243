"""Rank 0's HTTP API, OpenAI-compatible: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with
``stream: true`` as server-sent events), ``GET /v1/models``, ``GET /health``.

Greedy decoding only (every rank must pick the same token): ``temperature`` 0 or absent, ``top_p`` 1 or
absent, ``n`` 1. A request is checked here, before it reaches any rank: the model name (404), the
messages, ``max_tokens`` (1 to the server's limit) and the prompt plus ``max_tokens`` against the
model's window (400, each naming the field and what is allowed); a full queue or a draining server
gives 503. ``usage.prompt_tokens_details.cached_tokens`` (and the ``x-megatron-ring-cached-tokens``
header of a non-streamed answer) say how much of the prompt came from the cache.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from megatron_ring.serving.bridge import Bridge, Busy, Event, Sink
from megatron_ring.serving.engine import GenRequest


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send options we need not read (user, seed, ...)

    model: str
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    stream: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Request):
    messages: list[Message] = Field(..., min_length=1)


class CompletionRequest(_Request):
    prompt: str = Field(..., min_length=1)


@dataclass(frozen=True)
class ServedModel:
    """What the API serves: its name, tokenizer, window and limits."""

    name: str
    tokenizer: Any
    max_model_len: int
    default_max_tokens: int
    max_tokens_limit: int
    stop_ids: tuple[int, ...]


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _error(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def _check(body: _Request, served: ServedModel, prompt_len: int) -> int:
    """The request's ``max_tokens`` once every field is acceptable (ApiError naming the first that is not)."""
    if body.model != served.name:
        raise ApiError(404, f"model {body.model!r} does not exist; this server serves {[served.name]}", "model",
                       "model_not_found")
    if body.n != 1:
        raise ApiError(400, f"n = {body.n}: one choice per request; allowed: 1", "n")
    if body.temperature not in (None, 0, 0.0):
        raise ApiError(400, f"temperature = {body.temperature}: the server decodes greedily; allowed: 0 or absent",
                       "temperature")
    if body.top_p not in (None, 1, 1.0):
        raise ApiError(400, f"top_p = {body.top_p}: the server decodes greedily; allowed: 1 or absent", "top_p")
    if body.stop:
        raise ApiError(400, "stop sequences are not supported; generation ends at the model's end-of-text token or "
                       "max_tokens", "stop")
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = served.default_max_tokens if asked is None else asked
    if not 1 <= max_tokens <= served.max_tokens_limit:
        raise ApiError(400, f"{name} = {max_tokens}; allowed: 1 to {served.max_tokens_limit}", name)
    if prompt_len + max_tokens > served.max_model_len:
        raise ApiError(400, f"the prompt has {prompt_len} tokens and {name} = {max_tokens}: {prompt_len + max_tokens} "
                       f"exceeds the model's window of {served.max_model_len} tokens", name, "context_length_exceeded")
    return max_tokens


def _chat_tokens(served: ServedModel, body: ChatRequest) -> list[int]:
    tokenizer = served.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "the model's tokenizer has no chat template; use /v1/completions", "messages")
    ids = tokenizer.apply_chat_template([m.model_dump() for m in body.messages], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


class _Text:
    """A request's answer as text, released as it becomes whole (no half UTF-8 character)."""

    def __init__(self, tokenizer: Any, stop_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.stop_ids, self.tokens, self.sent = tokenizer, stop_ids, [], 0

    def add(self, token: int) -> str:
        if token not in self.stop_ids:
            self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        piece, self.sent = text[self.sent:], len(text)
        return piece


def _rss_mb() -> Optional[float]:
    """This process's resident memory in MiB (Linux), None elsewhere."""
    try:
        with open("/proc/self/status") as status:
            kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None
    return round(kb / 1024, 1)


def build_app(bridge: Bridge, served: ServedModel) -> FastAPI:
    """The FastAPI app of rank 0."""
    app = FastAPI(title="megatron-ring serve")

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'malformed')})")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(400, f"invalid request: {where or 'body'}: {first.get('msg', 'malformed')}", where or None)

    @app.exception_handler(ApiError)
    async def refused(_: Request, err: ApiError) -> JSONResponse:
        return _error(err.status, err.message, err.param, err.code)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "draining" if bridge.draining else "ok", **bridge.stats, "rank0_rss_mb": _rss_mb()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                            "owned_by": "megatron-ring", "max_model_len": served.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> Any:
        tokens = _chat_tokens(served, body)
        return await _serve(body, tokens, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        tokens = [int(t) for t in served.tokenizer(body.prompt, add_special_tokens=False)["input_ids"]]
        if not tokens:
            raise ApiError(400, "prompt tokenizes to no token", "prompt")
        return await _serve(body, tokens, chat=False)

    async def _serve(body: _Request, tokens: list[int], *, chat: bool) -> Any:
        max_tokens = _check(body, served, len(tokens))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        sink = Sink(asyncio.get_running_loop())
        try:
            bridge.submit(GenRequest(rid, tokens, max_tokens, list(served.stop_ids)), sink)
        except Busy as err:
            raise ApiError(503, str(err)) from None
        shape = _Shape(rid, served.name, chat, len(tokens))
        if body.stream:
            return StreamingResponse(_stream(sink, shape, rid), media_type="text/event-stream")
        text, finish, info = _Text(served.tokenizer, served.stop_ids), None, {}
        try:
            while finish is None:
                event: Event = await sink.queue.get()
                if event.token is not None:
                    text.add(event.token)
                info.update(event.info)
                finish = event.finish
        except asyncio.CancelledError:
            bridge.cancel(rid)
            raise
        body_json = shape.whole(text.tokenizer.decode(text.tokens, skip_special_tokens=True), finish, info)
        headers = {"x-megatron-ring-cached-tokens": str(info.get("cached_tokens", 0)),
                   "x-megatron-ring-evicted": str(info.get("evicted", 0))}
        return JSONResponse(body_json, headers=headers)

    async def _stream(sink: Sink, shape: "_Shape", rid: str) -> AsyncIterator[str]:
        text, info, done = _Text(served.tokenizer, served.stop_ids), {}, False
        try:
            while not done:
                event: Event = await sink.queue.get()
                info.update(event.info)
                piece = text.add(event.token) if event.token is not None else ""
                if piece or event.finish:
                    yield "data: " + json.dumps(shape.chunk(piece, event.finish, info if event.finish else None)) + "\n\n"
                done = event.finish is not None
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                bridge.cancel(rid)  # the client went away mid-stream

    return app


@dataclass
class _Shape:
    """The OpenAI response objects of one request."""

    rid: str
    model: str
    chat: bool
    prompt_tokens: int

    def __post_init__(self) -> None:
        self.created = int(time.time())

    def usage(self, info: dict) -> dict[str, Any]:
        completion = int(info.get("completion_tokens", 0))
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": int(info.get("cached_tokens", 0))}}

    def whole(self, text: str, finish: Optional[str], info: dict) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(info)}

    def chunk(self, piece: str, finish: Optional[str], info: Optional[dict]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        choice.update({"delta": {"role": "assistant", "content": piece}} if self.chat else {"text": piece})
        out = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice]}
        if info is not None:
            out["usage"] = self.usage(info)
        return out
