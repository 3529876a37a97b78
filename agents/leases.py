"""This worker's leases on agents: several workers may share one registry, and only the one
holding an agent's lease runs its turns (see ``agentkv.store.leases``).

A turn holds the lease from before it reads the transcript until it is stored, and its save
holds it on until the cache is on disk, so the next worker to take the agent resumes from that
cache, not an older one. A worker that finds the lease held by another waits for it: turns of
one agent queue across workers as they do within one (``TurnRunner.lock``). Held leases are
renewed every third of the lease time; a worker that stops renewing (a crash, a lost
database) loses its agents once that time has passed.

A worker id names one live process: :class:`WorkerClaim` holds a lock file for it in the data
directory while the process runs. A worker restarted on the same data directory (the same
explicit id, or the default ``<hostname>-<dir>-<n>``, the lowest ``n`` free) therefore knows its
predecessor is gone, and takes back at once the leases it left behind rather than waiting for
them to expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import re
import secrets
import socket
from dataclasses import dataclass
from itertools import count
from pathlib import Path

from agentkv.errors import RuntimeClosedError, WorkerIdInUseError
from agentkv.store import LeaseIndex

log = logging.getLogger(__name__)

POLL_FIRST_S = 0.02
POLL_MAX_S = 0.5
"""Waiting for another worker's lease: the first pause between tries, doubling up to this."""


WORKERS_DIR = "workers"
"""Under the data directory: one lock file per worker id, held by the process running it."""


class WorkerClaim:
    """This process's hold on its worker id in a data directory (a lock file, released when
    :meth:`release` is called or the process dies)."""

    def __init__(self, worker_id: str, fd: int | None) -> None:
        self.worker_id = worker_id
        self._fd: int | None = fd

    @classmethod
    def take(cls, data_dir: Path, worker_id: str | None) -> WorkerClaim:
        """Claim ``worker_id``, or (None) the first free ``<hostname>-<dir>-<n>`` (``dir``: six hex
        digits of the data directory's path, so workers of other directories sharing one
        registry get other names). Where no lock file
        can be written (a full or read-only disk) the id goes unclaimed: the default is then
        ``<hostname>-<pid>``, and leases wait for a predecessor's to expire.

        Raises:
            WorkerIdInUseError: another live process (or runtime) has ``worker_id``.
        """
        folder = data_dir / WORKERS_DIR
        host = re.sub(r"[^A-Za-z0-9._:-]", "-", socket.gethostname())[:48] or "host"
        # Workers on other data directories (sharing one registry) get other names.
        place = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:6]
        names = [worker_id] if worker_id is not None else (f"{host}-{place}-{n}" for n in count())
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for name in names:
                fd = _locked(folder / f"{name}.lock")
                if fd is not None:
                    return cls(name, fd)
        except OSError as exc:
            log.warning("cannot hold a worker id lock in %s (%s); running unclaimed", folder, exc)
            return cls(worker_id or f"{host}-{os.getpid()}", None)
        raise WorkerIdInUseError(
            f"worker id {worker_id!r} is in use by another process on data directory "
            f"{data_dir}; give each worker its own id (--worker-id)"
        )

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file gives its lock back
            self._fd = None


def _locked(path: Path) -> int | None:
    """An open descriptor of ``path`` holding its exclusive lock, or None: it is held (by any
    open file description, this process's included)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass(slots=True)
class _Held:
    token: int
    count: int  # the turn and saves holding it
    lost: bool = False  # another worker took it (this one renewed too late): take it again


class Leases:
    """The leases of one worker process: held, renewed, given back."""

    def __init__(self, index: LeaseIndex, claim: WorkerClaim, seconds: float) -> None:
        """``claim``: this process's worker id (released at :meth:`close`); ``seconds``: how
        long a lease outlives this process's last renewal."""
        self.worker_id = claim.worker_id
        self.holder = f"{claim.worker_id}#{secrets.token_hex(4)}"
        """This process among the workers: a restarted worker is a new holder."""
        self.seconds = seconds
        self.waits = 0
        """Holds that waited for another worker's lease."""
        self.lost = 0
        """Leases found taken by another worker at a renewal (this one renewed too late)."""
        self._claim = claim
        self._index = index
        self._held: dict[str, _Held] = {}
        self._taking: set[str] = set()  # holds between taking a lease and recording it
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
            self._taking.add(agent_id)  # a renewal meanwhile must not give it back
            try:
                lease = await self._index.acquire(
                    agent_id, self.holder, self.worker_id, self.seconds
                )
            finally:
                self._taking.discard(agent_id)
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
            asked = {agent_id: held.token for agent_id, held in self._held.items()}
            try:
                still = await self._index.renew(self.holder, self.seconds, [*asked, *self._taking])
            except Exception as exc:
                log.warning("could not renew this worker's leases (%s); retrying", exc)
                continue
            for agent_id, token in asked.items():
                held = self._held.get(agent_id)
                if agent_id in still or held is None or held.lost or held.token != token:
                    continue  # renewed, given back or taken again meanwhile
                with contextlib.suppress(Exception):  # (the next renewal tries again)
                    await self._recheck(agent_id, held)

    async def _recheck(self, agent_id: str, held: _Held) -> None:
        """A lease the renewal did not find: take it again if no one else holds it (it had
        expired), else mark it lost."""
        lease = await self._index.acquire(agent_id, self.holder, self.worker_id, self.seconds)
        if self._held.get(agent_id) is not held:
            if lease is not None:  # given back meanwhile: so is this
                await self._index.release(agent_id, self.holder, lease.token)
            return
        if lease is not None:
            held.token = lease.token
            return
        held.lost = True
        self.lost += 1
        log.warning(
            "agent %r: its lease expired and another worker took it; a turn of it in flight "
            "here is stored only if that worker stores none first",
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
        finally:
            self._claim.release()
