"""This worker's leases on agents: several workers may share one registry, and only the one
holding an agent's lease runs its turns (see ``store.leases``).

A turn holds the lease from before it reads the transcript until it is stored, and its save
holds it on until the cache is on disk, so the next worker to take the agent resumes from that
cache, not an older one. A worker that finds the lease held by another waits for it: turns of
one agent queue across workers as they do within one (``TurnRunner.lock``). Held leases are
renewed every third of the lease time; a worker that stops renewing (a crash, a lost
database) loses its agents once that time has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass

from agents.errors import RuntimeClosedError
from store import LeaseIndex

log = logging.getLogger(__name__)

POLL_FIRST_S = 0.02
POLL_MAX_S = 0.5
"""Waiting for another worker's lease: the first pause between tries, doubling up to this."""


@dataclass(slots=True)
class _Held:
    token: int
    count: int  # the turn and saves holding it
    lost: bool = False  # another worker took it (this one renewed too late): take it again


class Leases:
    """The leases of one worker process: held, renewed, given back."""

    def __init__(self, index: LeaseIndex, worker_id: str, seconds: float) -> None:
        """``seconds``: how long a lease outlives this process's last renewal."""
        self.worker_id = worker_id
        self.holder = f"{worker_id}#{secrets.token_hex(4)}"
        """This process among the workers: a restarted worker is a new holder."""
        self.seconds = seconds
        self.waits = 0
        """Holds that waited for another worker's lease."""
        self.lost = 0
        """Leases found taken by another worker at a renewal (this one renewed too late)."""
        self._index = index
        self._held: dict[str, _Held] = {}
        self._releases: dict[str, asyncio.Task[None]] = {}
        self._renewer: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def held(self) -> int:
        """Agents whose lease this worker holds now."""
        return len(self._held)

    async def hold(self, agent_id: str) -> None:
        """Hold the agent's lease (once more, if held): waits while another worker holds it.

        Callers of one agent must not race here (``TurnRunner.lock`` orders them). Raises
        AgentNotFoundError when there is no such agent.
        """
        if self._closed:
            raise RuntimeClosedError("the runtime is closed")
        held = self._held.get(agent_id)
        if held is not None and not held.lost:
            held.count += 1
            return
        pending = self._releases.get(agent_id)
        if pending is not None:  # a release of an earlier hold: let it finish first
            await asyncio.shield(pending)
        delay, waited = POLL_FIRST_S, False
        while True:
            lease = await self._index.acquire(agent_id, self.holder, self.worker_id, self.seconds)
            if lease is not None:
                break
            if not waited:
                waited = True
                self.waits += 1
                holder = (await self._index.get([agent_id])).get(agent_id)
                log.info(
                    "agent %r: its lease is held by worker %r; waiting",
                    agent_id,
                    holder.worker_id if holder else "?",
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)
        held = self._held.get(agent_id)
        if held is not None:  # lost, taken again: its saves in flight hold the new lease
            held.token, held.lost = lease.token, False
            held.count += 1
        else:
            self._held[agent_id] = _Held(lease.token, 1)
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew(), name="agentkv-lease-renewer")

    def hold_more(self, agent_id: str) -> None:
        """One more holder of a lease held now (a save, after its turn)."""
        held = self._held.get(agent_id)
        if held is None:
            raise RuntimeError(f"agent {agent_id!r}: hold_more without a hold")
        held.count += 1

    def drop(self, agent_id: str) -> None:
        """One holder fewer; the last gives the lease back (in the background)."""
        held = self._held.get(agent_id)
        if held is None:
            return
        held.count -= 1
        if held.count:
            return
        del self._held[agent_id]
        task = asyncio.get_running_loop().create_task(self._release(agent_id, held.token))
        self._releases[agent_id] = task
        task.add_done_callback(lambda _: self._forget_release(agent_id, task))

    def _forget_release(self, agent_id: str, task: asyncio.Task[None]) -> None:
        if self._releases.get(agent_id) is task:
            del self._releases[agent_id]

    async def _release(self, agent_id: str, token: int) -> None:
        try:
            await self._index.release(agent_id, self.holder, token)
        except Exception as exc:  # it expires anyway
            log.warning("agent %r: could not give its lease back (%s); it expires", agent_id, exc)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.seconds / 3)
            try:
                still = await self._index.renew(self.holder, self.seconds, list(self._held))
            except Exception as exc:
                log.warning("could not renew this worker's leases (%s); retrying", exc)
                continue
            for agent_id, held in self._held.items():
                if agent_id in still or held.lost:
                    continue
                held.lost = True
                self.lost += 1
                log.warning(
                    "agent %r: its lease expired and another worker took it; a turn of it "
                    "in flight here is stored only if that worker stores none first",
                    agent_id,
                )

    async def settled(self) -> None:
        """Wait for the leases given back so far to be released in the database."""
        if self._releases:
            await asyncio.gather(*self._releases.values(), return_exceptions=True)

    async def close(self) -> None:
        """Stop renewing and give every lease back (after the turns and saves are over)."""
        self._closed = True
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        await self.settled()
        self._held.clear()
        try:
            await self._index.release_all(self.holder)
        except Exception as exc:
            log.warning("could not give this worker's leases back (%s); they expire", exc)
