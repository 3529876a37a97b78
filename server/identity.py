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
answered as it is). A request that resends a conversation an idle stateless agent answered
last (its transcript is the request's messages plus one reply) goes to that agent before any
other, and is answered as a whole conversation: the reply replaces the agent's last one and
the cache is reused up to it, so identical requests keep resuming one agent. When no agent
matches, a new stateless agent is created (with the server's idle TTL) and the whole history
imported with the turn.

Stateless agents are bounded: they expire after the server's idle TTL (an hour by default),
and when creating one makes more than ``max_stateless_agents`` (256 by default), the idle
ones used least recently are deleted first. Their cache blocks go only when no other cache
lists them: a conversation that starts like a kept one (the same system prompt, say) still
resumes from the stored blocks.

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

from agentkv import (
    AgentChangedError,
    AgentExistsError,
    AgentNotFoundError,
    AgentRecord,
    AgentRuntime,
    MessageRecord,
    Reply,
    RuntimeClosedError,
)
from agentkv.prompt import Message
from agentkv.server.conversation import ChatMessage, TurnRequest
from agentkv.server.conversation_index import (
    ConversationIndex,
    as_chat,
    extend_digest,
    prefix_digests,
)
from agentkv.server.sessions import (
    STATELESS_PREFIX,
    session_agent_id,
)

log = logging.getLogger(__name__)

DEFAULT_STATELESS_TTL_S = 3600
"""Idle TTL of the agents made for requests without an id (and of Claude Code sessions)."""
DEFAULT_MAX_STATELESS_AGENTS = 256
"""Stateless agents kept at most (the idle ones used least recently go first)."""
FIRST_USE_TRIES = 4
"""Times a request that creates its agent on first use tries to find or create it."""


def _system_key(system: str, tools: list[dict[str, Any]] | None) -> str:
    """What a stateless agent's system prompt is matched on: the prompt and the tools."""
    if not tools:
        return system
    return f"{system}\0tools\0{json.dumps(tools, sort_keys=True)}"


def _states(system: str, chat: list[ChatMessage]) -> tuple[bytes, bytes | None]:
    """An agent's index entry: the digest of its conversation and, when that ends with a
    reply, the digest of the conversation before it."""
    digests = prefix_digests(system, chat)
    asked = digests[-2] if chat and chat[-1].role == "assistant" else None
    return digests[-1], asked


@dataclass(slots=True, frozen=True)
class _Found:
    """A matched agent: it holds ``conversation[:matched]``; ``resent``: and a reply after
    the whole conversation, which the turn replaces."""

    agent_id: str
    matched: int
    resent: bool = False


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
        document: the conversation to answer whole (``AgentRuntime.respond``); None: the turn
            is the next user message (``AgentRuntime.stream``).
        created: the agent was created for this request (deleted again if the turn fails
            before any turn of it is stored).
        on_first_use: the request names its agent and creates it when there is none: a turn
            that finds it gone (discarded by a failed request that created it) is run again.
        retired: stateless agents over the cap, deleted once the turn is over (it may resume
            from their blocks first).
        committed: the turn was stored.
    """

    agent_id: str
    digest: bytes = b""
    pending: list[ChatMessage] = field(default_factory=list)
    index: ConversationIndex | None = None
    stored: Callable[[Reply], str] = field(default=lambda reply: reply.text)
    history: list[ChatMessage] = field(default_factory=list)
    document: list[Message] | None = None
    created: bool = False
    on_first_use: bool = False
    retired: list[str] = field(default_factory=list)
    committed: bool = False

    @property
    def history_dicts(self) -> list[dict[str, str]]:
        return [m.as_dict() for m in self.history]

    def commit(self, reply: Reply) -> None:
        """Record the turn (its messages and the reply as the runtime stored it)."""
        self.committed = True
        if self.index is None:
            return
        for m in self.pending:
            self.digest = extend_digest(self.digest, m.role, m.content)
        asked, self.pending = self.digest, []
        self.digest = extend_digest(asked, "assistant", self.stored(reply))
        self.index.put(self.agent_id, self.digest, asked)


class Identity:
    """Resolves requests to agents and holds each agent for the length of its turn."""

    def __init__(
        self,
        runtime: AgentRuntime,
        stateless_ttl_s: int | None = None,
        max_stateless_agents: int | None = DEFAULT_MAX_STATELESS_AGENTS,
    ):
        """
        Args:
            runtime: the runtime whose agents answer.
            stateless_ttl_s: idle TTL of the agents created for requests without an id.
            max_stateless_agents: when creating a stateless agent makes more, the idle ones
                used least recently are deleted (None: no cap).
        """
        if max_stateless_agents is not None and max_stateless_agents < 1:
            raise ValueError(
                "max_stateless_agents must be at least 1 (None: no cap), "
                f"got {max_stateless_agents}"
            )
        self._runtime = runtime
        self._stateless_ttl_s = stateless_ttl_s
        self._max_stateless_agents = max_stateless_agents
        self._index = ConversationIndex()
        self._match_lock = asyncio.Lock()
        self._agent_locks: dict[str, asyncio.Lock] = {}
        self._users: Counter[str] = Counter()  # requests holding or waiting for an agent
        self._deleting: set[asyncio.Task] = set()  # deletions of agents over the cap

    async def load(self) -> None:
        """Index every stateless agent in the registry, least recently used first, and delete
        the oldest beyond the cap (once, at startup; two queries)."""
        transcripts = await self._runtime.transcripts(STATELESS_PREFIX)
        agents = [a for a in await self._runtime.list_agents() if a.id.startswith(STATELESS_PREFIX)]
        for agent in sorted(agents, key=lambda a: a.updated_at):
            chat = [ChatMessage(str(role), text) for role, text in transcripts.get(agent.id, [])]
            self._index.put(agent.id, *_states(agent.system_prompt or "", chat))
        await self._delete(await self._beyond_cap())

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
            named = session_agent_id(request.session, request.tools, request.session_prefix)
        continued = None
        if named is None and request.continues is not None:
            continued = await self._continued(request, *request.continues)
        if continued is not None:
            claim = continued
        elif named is not None:
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
                if claim.retired:  # in the background: the reply need not wait for it
                    task = asyncio.create_task(self._retire(claim))
                    self._deleting.add(task)
                    task.add_done_callback(self._deleting.discard)

    async def _continued(
        self, request: TurnRequest, agent_id: str, message_id: int
    ) -> Claim | None:
        """The claim on the agent whose last message ``message_id`` is, checked once the agent
        is held (a branch sent meanwhile may have answered it); None: it is not (any more)."""
        await self._enter(agent_id)
        try:
            if await self._runtime.responses.is_latest(agent_id, message_id):
                return Claim(agent_id, document=request.document)
        except BaseException:
            self._leave(agent_id)
            raise
        self._leave(agent_id)
        return None

    async def _discard(self, agent_id: str) -> None:
        """Delete an agent a failed request created, so a refused request leaves nothing;
        unless a turn of it was stored meanwhile (another request, on any worker, found it)."""
        self._index.drop(agent_id)
        try:
            await self._runtime.delete_agent(agent_id, expected_version=0)
        except AgentChangedError:  # another request's turn was stored: the agent is kept
            log.info("agent %r: kept after its first turn failed (another turn stored)", agent_id)
        except AgentNotFoundError:
            pass  # deleted meanwhile
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

    def _digested(self, request: TurnRequest) -> tuple[list[ChatMessage], list[bytes]]:
        """The request's messages as transcripts store them, and the digests of their
        prefixes (after its system key)."""
        system, conversation = self._conversation(request)
        return conversation, prefix_digests(system, conversation)

    def _stored_reply(self, reply: Reply) -> str:
        return self._runtime.stored_text(reply.content.as_message())

    async def _named(self, agent_id: str, request: TurnRequest, idle_ttl_s: int | None) -> Claim:
        """The claim on a named agent, created on first use."""
        runtime = self._runtime
        for attempt in range(1, FIRST_USE_TRIES + 1):
            # Another request (on any worker) may create or discard the agent in between.
            try:
                transcript, created = as_chat(await runtime.transcript(agent_id)), False
                break
            except AgentNotFoundError:
                pass
            try:
                await runtime.create_agent(
                    agent_id, system_prompt=request.system or None, idle_ttl_s=idle_ttl_s
                )
                transcript, created = [], True
                break
            except AgentExistsError:
                if attempt == FIRST_USE_TRIES:
                    raise
        imported = request.history if request.document is None and not transcript else []
        return Claim(
            agent_id,
            history=list(imported),
            document=request.document,
            created=created,
            on_first_use=True,
        )

    async def _match(self, request: TurnRequest) -> Claim:
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
                        idle_ttl_s=self._stateless_ttl_s,
                    )
                    self._index.put(agent.id, digests[0])
                    await self._enter(agent.id)
                    claim = self._claimed(_Found(agent.id, 0), request, digests, conversation)
                    claim.created, claim.retired = True, await self._beyond_cap()
                    return claim
                agent_id = found.agent_id
                await self._enter(agent_id)  # idle: returns at once, before anyone can match it
            try:
                if await self._verified(found, request, digests):
                    return self._claimed(found, request, digests, conversation)
            except BaseException:
                self._leave(agent_id)
                raise
            self._leave(agent_id)

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
        if found.resent and document is None:
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
            if not self._users[agent_id]:
                return _Found(agent_id, len(digests) - 2, resent=True)
        return None

    def _longest_idle(self, digests: list[bytes]) -> _Found | None:
        """The idle agent whose transcript is the longest prefix of the history (``digests``
        of its prefixes)."""
        # At least one message: an agent with an empty transcript is nobody's conversation yet.
        for matched in range(len(digests) - 1, 0, -1):
            if digests[matched] not in self._index:
                continue
            for agent_id in self._index.agents_at(digests[matched]):
                if not self._users[agent_id]:
                    return _Found(agent_id, matched)
        return None

    async def _beyond_cap(self) -> list[str]:
        """The idle stateless agents used least recently, as many as there are beyond the
        cap: taken out of the index and entered, for :meth:`_delete`."""
        if self._max_stateless_agents is None:
            return []
        excess = len(self._index) - self._max_stateless_agents
        oldest = [a for a in self._index.oldest() if not self._users[a]][: max(0, excess)]
        for agent_id in oldest:
            self._index.drop(agent_id)
            await self._enter(agent_id)  # idle: returns at once
        return oldest

    async def _retire(self, claim: Claim) -> None:
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
                self._leave(agent_id)
                self.deleted(agent_id)
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
        system = _system_key(agent.system_prompt or "", request.tools)
        digest, asked = await asyncio.to_thread(_states, system, as_chat(transcript))
        state, expected = (asked, digests[-1]) if found.resent else (digest, digests[found.matched])
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
        states = await asyncio.to_thread(_states, agent.system_prompt or "", as_chat(transcript))
        self._index.put(agent.id, *states)

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
