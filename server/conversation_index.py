"""An in-memory index of conversations by content: a digest of (system prompt, transcript) for
every agent the server may match a stateless request to, and the agents in each state.

A request hashes each prefix of its history (:func:`prefix_digests`) and looks them up, longest
first (see ``agentkv.server.identity``). An agent whose transcript ends with a reply is also found
by its state before that reply (``asked``): a request that resends the very conversation it
answered. The index keeps its agents in the order of their last use, oldest first.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator, Sequence

from agentkv.server.conversation import ChatMessage
from agentkv.store import MessageRecord, content_key


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
    return [
        ChatMessage(str(m.role), m.content if m.parts is None else content_key(m.parts))
        for m in transcript
    ]


class ConversationIndex:
    """Agent id -> digest of its (system, transcript) and of the state before its last reply,
    and back."""

    def __init__(self) -> None:
        self._digest_of: dict[str, bytes] = {}  # in the order of last use, oldest first
        self._asked_of: dict[str, bytes] = {}
        self._agents_at: dict[bytes, dict[str, int]] = {}  # digest -> {agent id: last use}
        self._agents_asked: dict[bytes, dict[str, int]] = {}
        self._clock = itertools.count()

    def __len__(self) -> int:
        return len(self._digest_of)

    def __contains__(self, digest: object) -> bool:
        """Whether some agent is in that state (cheap: checked for every prefix of a long
        conversation)."""
        return digest in self._agents_at

    def known(self, digest: bytes) -> bool:
        """Whether some agent is in that state, or was before its last reply (as cheap)."""
        return digest in self._agents_at or digest in self._agents_asked

    def put(self, agent_id: str, digest: bytes, asked: bytes | None = None) -> None:
        """Record the agent's state (``asked``: its state before its last message, when that
        is a reply) as its latest use."""
        self.drop(agent_id)
        use = next(self._clock)
        self._digest_of[agent_id] = digest
        self._agents_at.setdefault(digest, {})[agent_id] = use
        if asked is not None:
            self._asked_of[agent_id] = asked
            self._agents_asked.setdefault(asked, {})[agent_id] = use

    def drop(self, agent_id: str) -> None:
        old = self._digest_of.pop(agent_id, None)
        if old is not None:
            _remove(self._agents_at, old, agent_id)
        asked = self._asked_of.pop(agent_id, None)
        if asked is not None:
            _remove(self._agents_asked, asked, agent_id)

    def agents_at(self, digest: bytes) -> list[str]:
        """Agents in that state, most recently used first."""
        return _newest_first(self._agents_at.get(digest, {}))

    def agents_asked(self, digest: bytes) -> list[str]:
        """Agents whose state before their last reply is that one, most recently used first."""
        return _newest_first(self._agents_asked.get(digest, {}))

    def oldest(self) -> Iterator[str]:
        """Every agent, least recently used first."""
        return iter(list(self._digest_of))


def _remove(buckets: dict[bytes, dict[str, int]], digest: bytes, agent_id: str) -> None:
    at = buckets[digest]
    del at[agent_id]
    if not at:
        del buckets[digest]


def _newest_first(at: dict[str, int]) -> list[str]:
    return sorted(at, key=at.__getitem__, reverse=True)
