"""The ``serve`` section of an inference config: how ``megatron-ring serve`` serves its model."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from megatron_ring.config import StrictModel


class ServeSection(StrictModel):
    """``megatron_ring.serve`` (every key optional; the command's flags override them)."""

    host: str = Field("127.0.0.1", description="address the HTTP server binds")
    port: int = Field(8000, ge=0, le=65535, description="its port (0: any free port, printed at start)")
    served_model_name: Optional[str] = Field(None, description="the model id of the API; None: the config's name")
    max_tokens: int = Field(256, ge=1, description="completion tokens when a request does not say; also its maximum "
                                                   "unless max_tokens_limit is set")
    max_tokens_limit: Optional[int] = Field(None, ge=1, description="largest max_tokens a request may ask for")
    cache_budget_tokens: int = Field(65536, ge=1, description="tokens of finished conversations kept in the "
                                                              "sharded cache; least recently used evicted first")
    turn_mode: Literal["auto", "pass_kv", "pass_q"] = Field(
        "auto", description="how a follow-up turn meets the cache (Note [Pass-KV or pass-Q])")
    max_batch: int = Field(8, ge=1, description="requests decoded in one round; more wait in the queue")
    queue_limit: int = Field(64, ge=1, description="requests waiting; beyond it a request gets 503")
    idle_poll_s: float = Field(0.2, gt=0, le=5, description="how often an idle rank 0 tells the others it is alive")


def parse_serve(raw: Any, where: str) -> ServeSection:
    """The ``serve`` mapping (None: defaults), strict (ConfigError naming ``where``)."""
    return ServeSection.parse(raw or {}, where=where, key="megatron_ring.serve")
