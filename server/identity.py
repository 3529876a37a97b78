"""Which agent answers a request.

A Claude Code session has an agent of its own, ``claude-code-<session id>-<tool set>``: the
session is named by the ``x-claude-code-session-id`` header or by the ``session_id`` inside the
JSON that Claude Code sends as ``metadata.user_id``; side requests of the session (a title, a
summary: another prompt, no tools) get a sibling agent, so they do not evict the main
conversation's cache. Like agents made for requests without an id, these expire after the
server's idle TTL. Its requests are whole conversations (see ``AgentRuntime.respond``):
each one is the document, and the agent's cache is reused up to the longest common token
prefix.

Otherwise a request names its agent with the ``x-agent-id`` header, or else Anthropic's
``metadata.user_id`` / OpenAI's ``user`` field when that is a valid agent id (any other
``user_id`` is not an agent id and is ignored). Then:

- the agent is created on first use, with that id and the request's system prompt (later
  requests' system prompts are ignored: the agent keeps its own);
- its transcript is the document: the request's last message (a user message) is the new turn
  and the earlier request messages are ignored, except when the agent's transcript is still
  empty, in which case they are imported with the turn (stored together with it, or not at
  all). A request with tools, tool calls or results, or system messages among its messages is a
  whole conversation instead: it replaces the agent's transcript.

A request without an id is treated as a stateless client resending the whole conversation each
call. Its agent is the idle stateless agent (id ``stateless-...``, created by this resolver;
never an agent created by name) whose system prompt (and tools) equal the request's and whose
transcript the request's history (``messages[:-1]``) extends by at least one message,
comparing role and exact text, with the longest such transcript (ties: the most recently
used). The history the agent lacks is imported with the turn (a whole conversation is
answered as it is). When no agent matches, a new stateless agent is created (with the server's
idle TTL) and the whole history imported with the turn.

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
import json
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from agents import AgentNotFoundError, AgentRecord, AgentRuntime, MessageRecord, Reply
from server.conversation import ChatMessage, TurnRequest
from server.conversation_index import ConversationIndex, as_chat, extend_digest, prefix_digests
from server.sessions import (
    STATELESS_PREFIX,
    session_agent_id,
)

log = logging.getLogger(__name__)


def _system_key(system: str, tools: list[dict[str, Any]] | None) -> str:
    """What a stateless agent's system prompt is matched on: the prompt and the tools."""
    if not tools:
        return system
    return f"{system}\0tools\0{json.dumps(tools, sort_keys=True)}"


@dataclass(slots=True)
class Claim:
    """An agent reserved for one turn.

    Attributes:
        agent_id: the agent.
        digest: its state before the turn's ``pending`` messages, which the turn adds.
        pending: the messages the turn adds before its reply (imported history included).
        index: where to record the state after the turn; None: the agent is not tracked.
        stored: the reply's text as the transcript stores it.
        history: messages the turn imports before its own (``chat(..., history=...)``).
        created: the agent was created for this request (deleted again if the turn fails).
        committed: the turn was stored.
    """

    agent_id: str
    digest: bytes = b""
    pending: list[ChatMessage] = field(default_factory=list)
    index: ConversationIndex | None = None
    stored: Callable[[Reply], str] = field(default=lambda reply: reply.text)
    history: list[ChatMessage] = field(default_factory=list)
    created: bool = False
    committed: bool = False

    @property
    def history_dicts(self) -> list[dict[str, str]]:
        return [m.as_dict() for m in self.history]

    def commit(self, reply: Reply) -> None:
        """Record the turn (its messages and the reply as the runtime stored it)."""
        self.committed = True
        if self.index is None:
            return
        for m in [*self.pending, ChatMessage("assistant", self.stored(reply))]:
            self.digest = extend_digest(self.digest, m.role, m.content)
        self.pending = []
        self.index.put(self.agent_id, self.digest)


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
        """Index every stateless agent in the registry (once, at startup; two queries)."""
        transcripts = await self._runtime.transcripts(STATELESS_PREFIX)
        for agent in await self._runtime.list_agents():
            if agent.id.startswith(STATELESS_PREFIX):
                chat = [
                    ChatMessage(str(role), text) for role, text in transcripts.get(agent.id, [])
                ]
                self._index.put(agent.id, prefix_digests(agent.system_prompt or "", chat)[-1])

    def deleted(self, agent_id: str) -> None:
        self._index.drop(agent_id)
        if not self._users[agent_id]:
            self._agent_locks.pop(agent_id, None)

    @asynccontextmanager
    async def claim(self, request: TurnRequest) -> AsyncIterator[Claim]:
        """Find or create the request's agent, bring its transcript up to the new turn, and
        hold it until the block ends."""
        named = request.agent_id
        if named is None and request.session is not None:
            named = session_agent_id(request.session, request.tools)
        if named is not None:
            await self._enter(named)
            try:
                # A Claude Code session is a stateless client too: its agents expire when idle.
                ttl = self._stateless_ttl_s if request.agent_id is None else None
                claim = await self._named(named, request, ttl)
            except BaseException:
                self._leave(named)
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

    def _conversation(self, request: TurnRequest) -> tuple[str, list[ChatMessage]]:
        """(system key, messages as transcripts store them) of a request, new turn included."""
        if request.document is None:
            return request.system, [*request.history, ChatMessage("user", request.message)]
        document, system = request.document, ""
        if document[0]["role"] == "system":  # the runtime keeps it as the system prompt
            system, document = document[0]["content"], document[1:]
        stored = [ChatMessage(m["role"], self._runtime.stored_text(m)) for m in document]
        return _system_key(system, request.tools), stored

    def _stored_reply(self, reply: Reply) -> str:
        return self._runtime.stored_text(reply.content.as_message())

    async def _named(self, agent_id: str, request: TurnRequest, idle_ttl_s: int | None) -> Claim:
        runtime = self._runtime
        created = False
        try:
            await runtime.get_agent(agent_id)
            transcript = as_chat(await runtime.transcript(agent_id))
        except AgentNotFoundError:
            await runtime.create_agent(
                agent_id, system_prompt=request.system or None, idle_ttl_s=idle_ttl_s
            )
            transcript, created = [], True
        imported = request.history if request.document is None and not transcript else []
        return Claim(agent_id, history=list(imported), created=created)

    async def _match(self, request: TurnRequest) -> Claim:
        """Take the idle agent with the longest matching transcript, or a new one (entered)."""
        system, conversation = self._conversation(request)
        history = conversation[:-1]
        digests = prefix_digests(system, history)
        while True:
            async with self._match_lock:
                found = self._longest_idle(digests)
                fresh = found is None
                if found is None:
                    agent = await self._runtime.create_agent(
                        f"{STATELESS_PREFIX}{uuid.uuid4().hex[:24]}",
                        system_prompt=request.system or None,
                        idle_ttl_s=self._stateless_ttl_s,
                    )
                    self._index.put(agent.id, digests[0])
                    found = (agent.id, 0)
                agent_id, matched = found
                await self._enter(agent_id)  # idle: returns at once, before anyone can match it
            try:
                if fresh or await self._verified(agent_id, request, digests[matched]):
                    return self._claimed(agent_id, request, digests, matched, conversation, fresh)
            except BaseException:
                self._leave(agent_id)
                raise
            self._leave(agent_id)

    def _claimed(
        self,
        agent_id: str,
        request: TurnRequest,
        digests: list[bytes],
        matched: int,
        conversation: list[ChatMessage],
        created: bool,
    ) -> Claim:
        """The claim on a matched (or new) agent: the turn adds ``conversation[matched:]``, the
        history the agent lacks imported with it (a whole conversation is answered as it is)."""
        pending = conversation[matched:]
        imported = [] if request.document is not None else pending[:-1]
        claim = Claim(agent_id, digests[matched], pending, self._index)
        if request.document is not None:
            claim.stored = self._stored_reply
        claim.history, claim.created = imported, created
        return claim

    def _longest_idle(self, digests: list[bytes]) -> tuple[str, int] | None:
        # At least one message: an agent with an empty transcript is nobody's conversation yet.
        for matched in range(len(digests) - 1, 0, -1):
            for agent_id in self._index.agents_at(digests[matched]):
                if not self._users[agent_id]:
                    return agent_id, matched
        return None

    async def _verified(self, agent_id: str, request: TurnRequest, expected: bytes) -> bool:
        """Whether the agent is in the state the index says; if not, fix its entry."""
        try:
            agent = await self._runtime.get_agent(agent_id)
        except AgentNotFoundError:
            log.info("agent %r was deleted outside this server", agent_id)
            self._index.drop(agent_id)
            return False
        transcript = await self._runtime.transcript(agent_id)
        system = _system_key(agent.system_prompt or "", request.tools)
        if prefix_digests(system, as_chat(transcript))[-1] == expected:
            return True
        log.info("agent %r changed outside this server; re-indexed it", agent_id)
        await self._reindex(agent, transcript)
        return False

    async def _reindex(
        self, agent: AgentRecord, transcript: list[MessageRecord] | None = None
    ) -> None:
        if transcript is None:
            transcript = await self._runtime.transcript(agent.id)
        digest = prefix_digests(agent.system_prompt or "", as_chat(transcript))[-1]
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
