"""Which stateless agent answers a request that names none.

A request without an id is treated as a stateless client resending the whole conversation each
call. Its agent is the idle stateless agent (id ``stateless-...``, created by this resolver;
never an agent created by name) whose system prompt (and tools) equal the request's and whose
transcript the request's history (``messages[:-1]``) extends by at least one message,
comparing role and exact text, with the longest such transcript (ties: the most recently
used). The history the agent lacks is imported with the turn (a whole conversation is
answered as it is). A request that resends a conversation an idle stateless agent answered
last (its transcript is the request's messages plus one reply) goes to that agent before any
other, and is answered as a whole conversation: the reply replaces the agent's last one and
the cache is reused up to it, so identical requests keep resuming one agent. A client that
drops or rewrites the last reply it got (a retry, an empty reply left out, a system message in
its place) resumes the agent too: one whose transcript before its last reply is the longest
prefix of the history (at equal length, an agent whose whole transcript is goes first) answers
the request as a whole conversation, its last reply replaced, the cache reused up to where the
two differ. When no agent matches, a new stateless agent is created (with the server's idle TTL)
and the whole history imported with the turn.

Stateless agents are bounded: they expire after the server's idle TTL (an hour by default),
and when creating one makes more than ``max_stateless_agents`` (256 by default), the idle
ones used least recently are deleted first. Their cache blocks go only when no other cache
lists them: a conversation that starts like a kept one (the same system prompt, say) still
resumes from the stored blocks.

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
from dataclasses import dataclass
from typing import Any

from agentkv import (
    AgentNotFoundError,
    AgentRecord,
    AgentRuntime,
    MessageRecord,
    Reply,
    RuntimeClosedError,
)
from agentkv.prompt import Message
from agentkv.server.claims import AgentHolds, Claim
from agentkv.server.conversation import ChatMessage, TurnRequest
from agentkv.server.conversation_index import ConversationIndex, as_chat, prefix_digests
from agentkv.server.sessions import STATELESS_PREFIX
from agentkv.store import content_key

log = logging.getLogger(__name__)

DEFAULT_STATELESS_TTL_S = 3600
"""Idle TTL of the agents made for requests without an id (and of Claude Code sessions)."""
DEFAULT_MAX_STATELESS_AGENTS = 256
"""Stateless agents kept at most (the idle ones used least recently go first)."""


def _system_key(system: str, tools: list[dict[str, Any]] | None) -> str:
    """What a stateless agent's system prompt is matched on: the prompt and the tools."""
    if not tools:
        return system
    return f"{system}\0tools\0{json.dumps(tools, sort_keys=True)}"


def _key_of(agent: AgentRecord) -> str:
    """The system key a stateless agent was created under (its prompt and tools, stored)."""
    return _system_key(agent.system_prompt or "", agent.tools)


def _states(system: str, chat: list[ChatMessage]) -> tuple[bytes, bytes | None]:
    """An agent's index entry: the digest of its conversation and, when that ends with a
    reply, the digest of the conversation before it."""
    digests = prefix_digests(system, chat)
    asked = digests[-2] if chat and chat[-1].role == "assistant" else None
    return digests[-1], asked


def _transcript_states(
    agent: AgentRecord, transcript: list[MessageRecord]
) -> tuple[bytes, bytes | None]:
    """:func:`_states` of a stored agent (it grows with the transcript: run off the loop)."""
    return _states(_key_of(agent), as_chat(transcript))


@dataclass(slots=True, frozen=True)
class _Found:
    """A matched agent: it holds ``conversation[:matched]``; ``resent``: and a reply after
    the whole conversation, which the turn replaces; ``rewrites``: and a reply after
    ``conversation[:matched]`` that the request dropped or rewrote, which the turn replaces
    with the rest of the conversation and its answer."""

    agent_id: str
    matched: int
    resent: bool = False
    rewrites: bool = False


class StatelessAgents:
    """The stateless agents this server may match requests to: their index, the matching, and
    the cap on how many are kept."""

    def __init__(
        self,
        runtime: AgentRuntime,
        holds: AgentHolds,
        ttl_s: int | None,
        max_agents: int | None,
    ):
        self._runtime = runtime
        self._holds = holds
        self._stateless_ttl_s = ttl_s
        self._max_stateless_agents = max_agents
        self._index = ConversationIndex()
        self._match_lock = asyncio.Lock()

    async def load(self) -> None:
        """Index every stateless agent in the registry, least recently used first, and delete
        the oldest beyond the cap (once, at startup; two queries)."""
        transcripts = await self._runtime.transcripts(STATELESS_PREFIX)
        agents = [a for a in await self._runtime.list_agents() if a.id.startswith(STATELESS_PREFIX)]
        for agent in sorted(agents, key=lambda a: a.updated_at):
            chat = [ChatMessage(str(role), text) for role, text in transcripts.get(agent.id, [])]
            self._index.put(agent.id, *_states(_key_of(agent), chat))
        await self._delete(await self._beyond_cap())

    def forget(self, agent_id: str) -> None:
        """The agent was deleted."""
        self._index.drop(agent_id)

    def _conversation(self, request: TurnRequest) -> tuple[str, list[ChatMessage]]:
        """(system key, messages as transcripts store them) of a request, new turn included."""
        if request.document is None:
            return request.system, [*request.history, ChatMessage("user", request.message)]
        document, system = request.document, ""
        if document[0]["role"] == "system":  # the runtime keeps it as the system prompt
            system, document = document[0]["content"], document[1:]
        stored = [ChatMessage(m["role"], self._stored(m)) for m in document]
        return _system_key(system, request.tools), stored

    def _stored(self, message: Message) -> str:
        """A message as transcripts store it, images named (``content_key``)."""
        if isinstance(message["content"], list):
            return content_key(message["content"])
        return self._runtime.stored_text(message)

    def _digested(self, request: TurnRequest) -> tuple[list[ChatMessage], list[bytes]]:
        """The request's messages as transcripts store them, and the digests of their
        prefixes (after its system key)."""
        system, conversation = self._conversation(request)
        return conversation, prefix_digests(system, conversation)

    def _stored_reply(self, reply: Reply) -> str:
        return self._runtime.stored_text(reply.content.as_message())

    async def match(self, request: TurnRequest) -> Claim:
        """Take the idle agent that resent the conversation, else the one with the longest
        matching transcript, else a new one (entered)."""
        # Reading and hashing grow with the conversation (ten thousand messages): off the loop.
        conversation, digests = await asyncio.to_thread(self._digested, request)
        while True:
            async with self._match_lock:
                found = self._resent_idle(digests) or self._longest_idle(digests[:-1])
                if found is None:
                    agent = await self._runtime.create_agent(
                        f"{STATELESS_PREFIX}{uuid.uuid4().hex[:24]}",
                        system_prompt=request.system or None,
                        tools=request.tools or None,
                        idle_ttl_s=self._stateless_ttl_s,
                    )
                    self._index.put(agent.id, digests[0])
                    await self._holds.enter(agent.id)
                    claim = self._claimed(_Found(agent.id, 0), request, digests, conversation)
                    claim.created, claim.retired = True, await self._beyond_cap()
                    return claim
                agent_id = found.agent_id
                await self._holds.enter(
                    agent_id
                )  # idle: returns at once, before anyone can match it
            try:
                if await self._verified(found, request, digests):
                    return self._claimed(found, request, digests, conversation)
            except BaseException:
                self._holds.leave(agent_id)
                raise
            self._holds.leave(agent_id)

    def _claimed(
        self,
        found: _Found,
        request: TurnRequest,
        digests: list[bytes],
        conversation: list[ChatMessage],
    ) -> Claim:
        """The claim on a matched (or new) agent: the turn adds ``conversation[matched:]``, the
        history the agent lacks imported with it (a whole conversation is answered as it is;
        a resent one too, replacing the agent's last reply)."""
        pending = conversation[found.matched :]
        document = request.document
        if (found.resent or found.rewrites) and document is None:
            document = self._document(request)
        claim = Claim(found.agent_id, digests[found.matched], pending, self._index)
        if document is not None:
            claim.stored = self._stored_reply
        else:
            claim.history = pending[:-1]
        claim.document = document
        return claim

    @staticmethod
    def _document(request: TurnRequest) -> list[Message]:
        """A next-user-turn request as the whole conversation it is."""
        head = [{"role": "system", "content": request.system}] if request.system else []
        messages = [*request.history, ChatMessage("user", request.message)]
        return [*head, *(m.as_dict() for m in messages)]

    def _resent_idle(self, digests: list[bytes]) -> _Found | None:
        """An idle agent whose transcript is the whole conversation and a reply."""
        for agent_id in self._index.agents_asked(digests[-1]):
            if self._holds.idle(agent_id):
                return _Found(agent_id, len(digests) - 2, resent=True)
        return None

    def _longest_idle(self, digests: list[bytes]) -> _Found | None:
        """The idle agent whose transcript is the longest prefix of the history (``digests``
        of its prefixes), or whose transcript before its last reply is (a client that dropped
        or rewrote that reply: a retry, a system message in its place); at equal length, one
        that holds nothing more first."""
        # At least one message: an agent with an empty transcript is nobody's conversation yet.
        for matched in range(len(digests) - 1, 0, -1):
            if not self._index.known(digests[matched]):
                continue
            for agent_id in self._index.agents_at(digests[matched]):
                if self._holds.idle(agent_id):
                    return _Found(agent_id, matched)
            for agent_id in self._index.agents_asked(digests[matched]):
                if self._holds.idle(agent_id):
                    return _Found(agent_id, matched, rewrites=True)
        return None

    async def _beyond_cap(self) -> list[str]:
        """The idle stateless agents used least recently, as many as there are beyond the
        cap: taken out of the index and entered, for :meth:`_delete`."""
        if self._max_stateless_agents is None:
            return []
        excess = len(self._index) - self._max_stateless_agents
        oldest = [a for a in self._index.oldest() if self._holds.idle(a)][: max(0, excess)]
        for agent_id in oldest:
            self._index.drop(agent_id)
            await self._holds.enter(agent_id)  # idle: returns at once
        return oldest

    async def retire(self, claim: Claim) -> None:
        """Delete the agents over the cap once the claim's turn has saved its cache: until
        then they may be alone in listing the stored blocks that turn resumed from."""
        try:
            await self._runtime.flush(claim.agent_id)
        finally:
            await self._delete(claim.retired)

    async def _delete(self, agent_ids: list[str]) -> None:
        """Delete agents :meth:`_beyond_cap` took (their blocks stay while others list them)."""
        for agent_id in agent_ids:
            try:
                await self._runtime.delete_agent(agent_id)
            except (AgentNotFoundError, RuntimeClosedError):
                pass  # expired meanwhile, or shutting down (the next start deletes it)
            except Exception:  # a full disk, say: it expires with its TTL instead
                log.exception("could not delete stateless agent %r over the cap", agent_id)
            finally:
                self._holds.leave(agent_id)
                self.forget(agent_id)
                self._holds.forget(agent_id)
        if agent_ids:
            log.info(
                "deleted %d stateless agents used least recently (cap: %d)",
                len(agent_ids),
                self._max_stateless_agents,
            )

    async def _verified(self, found: _Found, request: TurnRequest, digests: list[bytes]) -> bool:
        """Whether the agent is in the state the index says; if not, fix its entry."""
        agent_id = found.agent_id
        try:
            agent = await self._runtime.get_agent(agent_id)
        except AgentNotFoundError:
            log.info("agent %r was deleted outside this server", agent_id)
            self._index.drop(agent_id)
            return False
        transcript = await self._runtime.transcript(agent_id)
        digest, asked = await asyncio.to_thread(_transcript_states, agent, transcript)
        if found.resent or found.rewrites:  # it holds a reply the turn replaces
            state, expected = asked, digests[-1] if found.resent else digests[found.matched]
        else:
            state, expected = digest, digests[found.matched]
        if state == expected:
            return True
        log.info("agent %r changed outside this server; re-indexed it", agent_id)
        await self._reindex(agent, transcript)
        return False

    async def _reindex(
        self, agent: AgentRecord, transcript: list[MessageRecord] | None = None
    ) -> None:
        if transcript is None:
            transcript = await self._runtime.transcript(agent.id)
        states = await asyncio.to_thread(_transcript_states, agent, transcript)
        self._index.put(agent.id, *states)
