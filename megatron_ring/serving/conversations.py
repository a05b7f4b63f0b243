"""The conversations whose K/V stay in the sharded cache between requests: :class:`ConversationStore`.

Note [Follow-up turns by prefix]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The OpenAI API is stateless: a follow-up request carries the whole conversation again (the
document, the first question, the model's answer, the new question). So a conversation is
found by its tokens: the cached conversation sharing the longest prefix with the new prompt, and
only the rest of the prompt is prefilled as a turn against it. When the prompt extends the whole
cached conversation (a follow-up), the request takes it over. When they share only a prefix (a
system prompt, a document asked about in two conversations), every rank copies its entries of
that prefix into a new cache, and the cached conversation stays for its own follow-ups. At least
the prompt's last token is always prefilled, for the logits of the first answer token. The store decides the same on every rank, because
every rank sees the same requests in the same order: it holds token lists and round numbers, and
each rank its own shard of each cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Conversation:
    """A conversation at rest: ``tokens`` whose K/V its ``cache`` holds (this rank's shard)."""

    tokens: list[int]
    cache: Any
    last_used: int = 0


@dataclass
class ConversationStore:
    """Finished conversations within ``budget_tokens`` (all conversations' tokens), least recently used out first."""

    budget_tokens: int
    conversations: list[Conversation] = field(default_factory=list)
    evicted: int = 0
    """Conversations evicted so far."""

    def take(self, prompt: list[int], now: int) -> tuple[Conversation | None, int, bool]:
        """The conversation sharing the longest prefix with ``prompt``, that prefix's length (at most
        ``len(prompt) - 1``) and whether the prompt extends all of it, so that the caller takes it over: it
        then leaves the store (Note [Follow-up turns by prefix]). ``(None, 0, False)`` if none shares a token."""
        best, best_len = None, 0
        for conv in self.conversations:
            n = _common_prefix(conv.tokens, prompt, len(prompt) - 1)
            if n > best_len:
                best, best_len = conv, n
        if best is None:
            return None, 0, False
        whole = best_len == len(best.tokens)
        if whole:
            self.conversations.remove(best)
        else:
            best.last_used = now
        return best, best_len, whole

    def put(self, conv: Conversation, now: int) -> list[Conversation]:
        """Keep ``conv``; return the conversations evicted to stay within the budget (oldest use first)."""
        conv.last_used = now
        self.conversations.append(conv)
        out = []
        while self.tokens() > self.budget_tokens and self.conversations:
            oldest = min(self.conversations, key=lambda c: c.last_used)
            self.conversations.remove(oldest)
            out.append(oldest)
        self.evicted += len(out)
        return out

    def tokens(self) -> int:
        return sum(len(c.tokens) for c in self.conversations)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    for x, y in zip(a, b):
        if n >= limit or x != y:
            break
        n += 1
    return n
