"""What a request holds of its agent while its turn runs (:class:`Claim`), and the holds on
agents within this server (:class:`AgentHolds`).

Three locks order an agent's turns, one a level: the database lease (across workers,
``agentkv.leases``), the runtime's turn lock (turns of one agent within a process, in call
order), and the holds here, which the request resolver takes before it reads the agent:
a stateless agent with a request on it is not idle, so no second request matches it, and a
request creating a named agent on first use decides what history to import against the
transcript no turn is about to change.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from agentkv import Reply
from agentkv.prompt import Message
from agentkv.server.conversation import ChatMessage
from agentkv.server.conversation_index import ConversationIndex, extend_digest


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


class AgentHolds:
    """The agents requests hold or wait for in this server (see the module docstring)."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: Counter[str] = Counter()  # requests holding or waiting for an agent

    def idle(self, agent_id: str) -> bool:
        """No request holds the agent or waits for it."""
        return not self._users[agent_id]

    async def enter(self, agent_id: str) -> None:
        """Wait for the agent; it is not idle from this call on."""
        self._users[agent_id] += 1
        try:
            await self._locks.setdefault(agent_id, asyncio.Lock()).acquire()
        except BaseException:
            self._users[agent_id] -= 1
            raise

    def leave(self, agent_id: str) -> None:
        self._locks[agent_id].release()
        self._users[agent_id] -= 1
        if not self._users[agent_id]:
            del self._users[agent_id]

    def forget(self, agent_id: str) -> None:
        """The agent was deleted: drop its lock unless a request still holds it."""
        if not self._users[agent_id]:
            self._locks.pop(agent_id, None)
