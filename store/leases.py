"""Agent leases: which worker process runs the turns of an agent now.

Workers sharing one registry take an agent's lease before a turn and give it back when the
turn's cache has been saved; a lease expires when its holder stops renewing it (it crashed or
lost the database), so another worker can take the agent over. Expiry compares the workers'
clocks with each other: keep them synchronized (NTP) to well under the lease time.

A lease only says who should be running the agent. What keeps a stale writer from storing a
turn is the agent's version (``Registry.append_messages(expected_version=)``).

:class:`LeaseIndex` runs on the registry's database (``Registry.leases``); like the registry,
each call runs in one session and one transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError

from agentkv.store import database
from agentkv.store.errors import AgentNotFoundError
from agentkv.store.ids import validate_agent_id
from agentkv.store.models import AgentLease, utcnow


@dataclass(slots=True, frozen=True)
class Lease:
    """A lease as stored: who holds the agent, since when and until when."""

    agent_id: str
    holder: str
    worker_id: str
    token: int
    acquired_at: datetime
    expires_at: datetime


class LeaseIndex:
    """The agents' leases in one registry's database; reach it as ``registry.leases``."""

    def __init__(self, db: database.Database) -> None:
        self._db = db

    async def acquire(
        self, agent_id: str, holder: str, worker_id: str, seconds: float
    ) -> Lease | None:
        """Take the agent's lease for ``seconds`` if it is free, expired, ``holder``'s own, or
        held by an earlier process of ``worker_id`` (which is gone: one live process runs as a
        worker id, see ``agentkv.leases.WorkerClaim``).

        Returns:
            The lease (its ``token`` is new with every call), or None: another holder has it.

        Raises:
            AgentNotFoundError: No such agent.
        """
        validate_agent_id(agent_id)
        now = utcnow()
        values = {
            "agent_id": agent_id,
            "holder": holder,
            "worker_id": worker_id,
            "token": 1,
            "acquired_at": now,
            "expires_at": now + timedelta(seconds=seconds),
        }
        try:
            async with self._db.write() as session:
                statement = database.upsert(session, AgentLease).values(values)
                taken = statement.excluded
                row = (
                    await session.execute(
                        statement.on_conflict_do_update(
                            index_elements=[AgentLease.agent_id],
                            set_={
                                "holder": taken.holder,
                                "worker_id": taken.worker_id,
                                "token": AgentLease.token + 1,
                                "acquired_at": taken.acquired_at,
                                "expires_at": taken.expires_at,
                            },
                            where=(AgentLease.holder == holder)
                            | (AgentLease.worker_id == worker_id)
                            | (AgentLease.expires_at < now),
                        ).returning(AgentLease.token)
                    )
                ).first()
        except IntegrityError as exc:  # the foreign key: no such agent
            raise AgentNotFoundError(agent_id) from exc
        if row is None:
            return None
        return Lease(**values | {"token": row[0]})

    async def release(self, agent_id: str, holder: str, token: int) -> bool:
        """Give back the lease ``holder`` took with ``token`` (not a later one). Returns
        whether it was still held so."""
        async with self._db.write() as session:
            gone = await session.scalar(
                delete(AgentLease)
                .where(
                    AgentLease.agent_id == agent_id,
                    AgentLease.holder == holder,
                    AgentLease.token == token,
                )
                .returning(AgentLease.agent_id)
            )
            return gone is not None

    async def renew(self, holder: str, seconds: float, agent_ids: Sequence[str]) -> set[str]:
        """Extend ``holder``'s leases of ``agent_ids`` by ``seconds`` from now, and give back
        its others taken before this call (a release that failed, a hold cancelled once it
        had taken the lease; not one a hold takes while this runs).

        Returns:
            The agents of ``agent_ids`` it still holds (a lease that expired and was taken by
            another holder is not among them).
        """
        ids, now = sorted(set(agent_ids)), utcnow()
        async with self._db.write() as session:
            await session.execute(
                delete(AgentLease).where(
                    AgentLease.holder == holder,
                    AgentLease.agent_id.not_in(ids),
                    AgentLease.acquired_at < now,
                )
            )
            if not ids:
                return set()
            rows = await session.scalars(
                update(AgentLease)
                .where(AgentLease.holder == holder, AgentLease.agent_id.in_(ids))
                .values(expires_at=now + timedelta(seconds=seconds))
                .returning(AgentLease.agent_id)
            )
            return set(rows)

    async def release_all(self, holder: str) -> int:
        """Give back every lease ``holder`` has (a worker closing). Returns how many."""
        async with self._db.write() as session:
            rows = await session.scalars(
                delete(AgentLease).where(AgentLease.holder == holder).returning(AgentLease.agent_id)
            )
            return len(list(rows))

    async def get(self, agent_ids: Sequence[str]) -> dict[str, Lease]:
        """The leases of these agents that are held now (expired ones are left out)."""
        now = utcnow()
        async with self._db.read() as session:
            rows = await session.scalars(
                select(AgentLease).where(
                    AgentLease.agent_id.in_(list(agent_ids)), AgentLease.expires_at >= now
                )
            )
            return {
                row.agent_id: Lease(
                    row.agent_id,
                    row.holder,
                    row.worker_id,
                    row.token,
                    row.acquired_at,
                    row.expires_at,
                )
                for row in rows
            }
