"""Which agent answers a request.

A request names its agent with the ``x-agent-id`` header, or else Anthropic's
``metadata.user_id`` / OpenAI's ``user`` field. Then:

- the agent is created on first use, with that id and the request's system prompt (later
  requests' system prompts are ignored: the agent keeps its own);
- its transcript is the document: the request's last message (a user message) is the new turn
  and the earlier request messages are ignored, except when the agent's transcript is still
  empty, in which case they are imported with the turn (stored together with it, or not at all).

A request without an id is treated as a stateless client resending the whole conversation each
call. Its agent is the idle agent whose system prompt equals the request's and whose transcript
is a prefix of the request's history (``messages[:-1]``), comparing role and exact text, with
the longest such transcript (ties: the most recently used). The history the agent lacks is
imported with the turn. When no agent matches, a new agent is created and the whole history
imported with the turn.

Nothing of a turn that fails or is refused is stored: not its history, and not an agent the
request created (that agent is deleted again).

A client that resends the whole history after every reply thus keeps resuming one agent and
its KV cache. Two concurrent requests never share an agent: an agent with a turn in flight is
not idle, so a second request with the same history gets its own agent (its reply differs from
the first one's, so the two conversations have diverged anyway). Matching and creation run
under one lock, so two such requests cannot both take the same idle agent.

Matching does not read every transcript: an in-memory index maps a digest of (system prompt,
transcript) to the agents in that state, built once at startup and updated after every change
the server makes. A request hashes each prefix of its history and looks them up, longest
first; the chosen agent's transcript is then read and compared exactly, and a stale index entry
(an agent changed behind the server's back) is corrected and the match retried.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from agents import AgentNotFoundError, AgentRecord, AgentRuntime, MessageRecord
from server.conversation import ChatMessage, TurnRequest

log = logging.getLogger(__name__)


def _extend(digest: bytes, role: str, content: str) -> bytes:
    data = content.encode()
    return hashlib.sha256(b"%s%s\0%d\0%s" % (digest, role.encode(), len(data), data)).digest()


def prefix_digests(system: str, messages: Sequence[ChatMessage]) -> list[bytes]:
    """``result[k]`` is the digest of ``(system, messages[:k])``, for k = 0..len(messages)."""
    digests = [hashlib.sha256(b"system\0" + system.encode()).digest()]
    for m in messages:
        digests.append(_extend(digests[-1], m.role, m.content))
    return digests


def _as_chat(transcript: Iterable[MessageRecord]) -> list[ChatMessage]:
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


@dataclass(slots=True)
class Claim:
    """An agent reserved for one turn.

    Attributes:
        agent_id: the agent.
        digest: its state before the turn.
        index: where to record the state after it.
        history: messages the turn imports before its own (``chat(..., history=...)``).
        created: the agent was created for this request (deleted again if the turn fails).
        committed: the turn was stored.
    """

    agent_id: str
    digest: bytes
    index: ConversationIndex
    history: list[ChatMessage] = field(default_factory=list)
    created: bool = False
    committed: bool = False

    @property
    def history_dicts(self) -> list[dict[str, str]]:
        return [m.as_dict() for m in self.history]

    def commit(self, message: str, reply_text: str) -> None:
        """Record the turn (its history, the user message and the reply the runtime stored)."""
        digest = self.digest
        for m in self.history:
            digest = _extend(digest, m.role, m.content)
        self.digest = _extend(_extend(digest, "user", message), "assistant", reply_text)
        self.index.put(self.agent_id, self.digest)
        self.committed = True


class Identity:
    """Resolves requests to agents and holds each agent for the length of its turn."""

    def __init__(self, runtime: AgentRuntime, stateless_ttl_s: int | None = None):
        """``stateless_ttl_s``: idle TTL of the agents created for requests without an id."""
        self._runtime = runtime
        self._stateless_ttl_s = stateless_ttl_s
        self._index = ConversationIndex()
        self._match_lock = asyncio.Lock()
        self._agent_locks: dict[str, asyncio.Lock] = {}
        self._users: Counter[str] = Counter()  # requests holding or waiting for an agent

    async def load(self) -> None:
        """Index every agent in the registry (once, at startup)."""
        for agent in await self._runtime.list_agents():
            await self._reindex(agent)

    def created(self, agent: AgentRecord) -> None:
        """An agent created outside a turn (the agents REST API)."""
        self._index.put(agent.id, prefix_digests(agent.system_prompt or "", [])[0])

    def deleted(self, agent_id: str) -> None:
        self._index.drop(agent_id)
        if not self._users[agent_id]:
            self._agent_locks.pop(agent_id, None)

    @asynccontextmanager
    async def claim(self, request: TurnRequest) -> AsyncIterator[Claim]:
        """Find or create the request's agent, bring its transcript up to the new turn, and
        hold it until the block ends."""
        if request.agent_id is not None:
            await self._enter(request.agent_id)
            try:
                claim = await self._named(request)
            except BaseException:
                self._leave(request.agent_id)
                raise
        else:
            claim = await self._match(request)
        try:
            yield claim
        finally:
            try:
                if claim.created and not claim.committed:
                    await asyncio.shield(self._discard(claim.agent_id))
            finally:
                self._leave(claim.agent_id)

    async def _discard(self, agent_id: str) -> None:
        """Delete an agent a failed request created, so a refused request leaves nothing."""
        self._index.drop(agent_id)
        try:
            await self._runtime.delete_agent(agent_id)
        except Exception:
            log.exception("could not delete agent %r after its first turn failed", agent_id)

    async def _named(self, request: TurnRequest) -> Claim:
        agent_id, runtime = request.agent_id, self._runtime
        assert agent_id is not None
        created = False
        try:
            agent = await runtime.get_agent(agent_id)
            transcript = _as_chat(await runtime.transcript(agent_id))
        except AgentNotFoundError:
            agent = await runtime.create_agent(agent_id, system_prompt=request.system or None)
            transcript, created = [], True
        digest = prefix_digests(agent.system_prompt or "", transcript)[-1]
        self._index.put(agent_id, digest)
        history = request.history if not transcript else []
        return Claim(agent_id, digest, self._index, list(history), created)

    async def _match(self, request: TurnRequest) -> Claim:
        """Take the idle agent with the longest matching transcript, or a new one (entered)."""
        history = request.history
        digests = prefix_digests(request.system, history)
        while True:
            async with self._match_lock:
                found = self._longest_idle(digests)
                fresh = found is None
                if found is None:
                    agent = await self._runtime.create_agent(
                        system_prompt=request.system or None, idle_ttl_s=self._stateless_ttl_s
                    )
                    self.created(agent)
                    found = (agent.id, 0)
                agent_id, matched = found
                await self._enter(agent_id)  # idle: returns at once, before anyone can match it
            try:
                if fresh or await self._verified(agent_id, request.system, history[:matched]):
                    missing = list(history[matched:])
                    return Claim(agent_id, digests[matched], self._index, missing, fresh)
            except BaseException:
                self._leave(agent_id)
                raise
            self._leave(agent_id)

    def _longest_idle(self, digests: list[bytes]) -> tuple[str, int] | None:
        for matched in range(len(digests) - 1, -1, -1):
            for agent_id in self._index.agents_at(digests[matched]):
                if not self._users[agent_id]:
                    return agent_id, matched
        return None

    async def _verified(self, agent_id: str, system: str, expected: list[ChatMessage]) -> bool:
        """Whether the agent is in the state the index says; if not, fix its entry."""
        try:
            agent = await self._runtime.get_agent(agent_id)
        except AgentNotFoundError:
            log.info("agent %r was deleted outside this server", agent_id)
            self._index.drop(agent_id)
            return False
        transcript = await self._runtime.transcript(agent_id)
        if (agent.system_prompt or "") == system and _as_chat(transcript) == expected:
            return True
        log.info("agent %r changed outside this server; re-indexed it", agent_id)
        await self._reindex(agent, transcript)
        return False

    async def _reindex(
        self, agent: AgentRecord, transcript: list[MessageRecord] | None = None
    ) -> None:
        if transcript is None:
            transcript = await self._runtime.transcript(agent.id)
        digest = prefix_digests(agent.system_prompt or "", _as_chat(transcript))[-1]
        self._index.put(agent.id, digest)

    async def _enter(self, agent_id: str) -> None:
        """Wait for the agent's lock; the agent is not idle from this call on."""
        self._users[agent_id] += 1
        try:
            await self._agent_locks.setdefault(agent_id, asyncio.Lock()).acquire()
        except BaseException:
            self._users[agent_id] -= 1
            raise

    def _leave(self, agent_id: str) -> None:
        self._agent_locks[agent_id].release()
        self._users[agent_id] -= 1
        if not self._users[agent_id]:
            del self._users[agent_id]
