"""An in-memory index of conversations by content: a digest of (system prompt, transcript) for
every agent the server may match a stateless request to, and the agents in each state.

A request hashes each prefix of its history (:func:`prefix_digests`) and looks them up, longest
first (see ``server.identity``).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Sequence

from server.conversation import ChatMessage
from store import MessageRecord


def extend_digest(digest: bytes, role: str, content: str) -> bytes:
    """The digest of a conversation one message longer."""
    data = content.encode()
    return hashlib.sha256(b"%s%s\0%d\0%s" % (digest, role.encode(), len(data), data)).digest()


def prefix_digests(system: str, messages: Sequence[ChatMessage]) -> list[bytes]:
    """``result[k]`` is the digest of ``(system, messages[:k])``, for k = 0..len(messages)."""
    digests = [hashlib.sha256(b"system\0" + system.encode()).digest()]
    for m in messages:
        digests.append(extend_digest(digests[-1], m.role, m.content))
    return digests


def as_chat(transcript: Iterable[MessageRecord]) -> list[ChatMessage]:
    """Stored messages as the chat messages digests are taken of."""
    return [ChatMessage(str(m.role), m.content) for m in transcript]


class ConversationIndex:
    """Agent id -> digest of its (system, transcript), and back."""

    def __init__(self) -> None:
        self._digest_of: dict[str, bytes] = {}
        self._agents_at: dict[bytes, dict[str, int]] = {}  # digest -> {agent id: last use}
        self._clock = itertools.count()

    def __len__(self) -> int:
        return len(self._digest_of)

    def put(self, agent_id: str, digest: bytes) -> None:
        self.drop(agent_id)
        self._digest_of[agent_id] = digest
        self._agents_at.setdefault(digest, {})[agent_id] = next(self._clock)

    def drop(self, agent_id: str) -> None:
        old = self._digest_of.pop(agent_id, None)
        if old is not None:
            at = self._agents_at[old]
            del at[agent_id]
            if not at:
                del self._agents_at[old]

    def agents_at(self, digest: bytes) -> list[str]:
        """Agents in that state, most recently used first."""
        at = self._agents_at.get(digest, {})
        return sorted(at, key=at.__getitem__, reverse=True)
