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

Stateless requests (no id): see ``agentkv.server.stateless``.

Nothing of a turn that fails or is refused is stored: not its history, and not an agent the
request created (deleted again, unless a turn of it was stored meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from agentkv import AgentChangedError, AgentExistsError, AgentNotFoundError, AgentRuntime
from agentkv.server.claims import AgentHolds, Claim
from agentkv.server.conversation import TurnRequest
from agentkv.server.sessions import session_agent_id
from agentkv.server.stateless import DEFAULT_MAX_STATELESS_AGENTS, StatelessAgents

log = logging.getLogger(__name__)

FIRST_USE_TRIES = 4
"""Times a request that creates its agent on first use tries to find or create it."""


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
        self._holds = AgentHolds()
        self._stateless = StatelessAgents(
            runtime, self._holds, stateless_ttl_s, max_stateless_agents
        )
        self._deleting: set[asyncio.Task] = set()  # deletions of agents over the cap

    async def load(self) -> None:
        """Index every stateless agent in the registry (once, at startup)."""
        await self._stateless.load()

    def deleted(self, agent_id: str) -> None:
        self._stateless.forget(agent_id)
        self._holds.forget(agent_id)

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
            await self._holds.enter(named)
            try:
                # A Claude Code session is a stateless client too: its agents expire when idle.
                ttl = self._stateless_ttl_s if request.agent_id is None else None
                claim = await self._named(named, request, ttl)
            except BaseException:
                self._holds.leave(named)
                raise
        else:
            claim = await self._stateless.match(request)
        try:
            yield claim
        finally:
            try:
                if claim.created and not claim.committed:
                    await asyncio.shield(self._discard(claim.agent_id))
            finally:
                self._holds.leave(claim.agent_id)
                if claim.retired:  # in the background: the reply need not wait for it
                    task = asyncio.create_task(self._stateless.retire(claim))
                    self._deleting.add(task)
                    task.add_done_callback(self._deleting.discard)

    async def _continued(
        self, request: TurnRequest, agent_id: str, message_id: int
    ) -> Claim | None:
        """The claim on the agent whose last message ``message_id`` is, checked once the agent
        is held (a branch sent meanwhile may have answered it); None: it is not (any more)."""
        await self._holds.enter(agent_id)
        try:
            if await self._runtime.responses.is_latest(agent_id, message_id):
                return Claim(agent_id, document=request.document)
        except BaseException:
            self._holds.leave(agent_id)
            raise
        self._holds.leave(agent_id)
        return None

    async def _discard(self, agent_id: str) -> None:
        """Delete an agent a failed request created, so a refused request leaves nothing;
        unless a turn of it was stored meanwhile (another request, on any worker, found it)."""
        self._stateless.forget(agent_id)
        try:
            await self._runtime.delete_agent(agent_id, expected_version=0)
        except AgentChangedError:  # another request's turn was stored: the agent is kept
            log.info("agent %r: kept after its first turn failed (another turn stored)", agent_id)
        except AgentNotFoundError:
            pass  # deleted meanwhile
        except Exception:
            log.exception("could not delete agent %r after its first turn failed", agent_id)

    async def _named(self, agent_id: str, request: TurnRequest, idle_ttl_s: int | None) -> Claim:
        """The claim on a named agent, created on first use."""
        runtime = self._runtime
        for attempt in range(1, FIRST_USE_TRIES + 1):
            # Another request (on any worker) may create or discard the agent in between.
            try:
                # Whether it holds a message is all that matters here: one row, not thousands
                # (its turn reads the transcript).
                held, created = bool(await runtime.transcript(agent_id, limit=1)), False
                break
            except AgentNotFoundError:
                pass
            try:
                await runtime.create_agent(
                    agent_id, system_prompt=request.system or None, idle_ttl_s=idle_ttl_s
                )
                held, created = False, True
                break
            except AgentExistsError:
                if attempt == FIRST_USE_TRIES:
                    raise
        imported = request.history if request.document is None and not held else []
        return Claim(
            agent_id,
            history=list(imported),
            document=request.document,
            created=created,
            on_first_use=True,
        )
