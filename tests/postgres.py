"""A throwaway PostgreSQL server for the tests: initdb in a temp dir, one fresh database per use.

The server runs from the system's binaries (Debian's ``/usr/lib/postgresql/<version>/bin``, or
``initdb`` and ``pg_ctl`` on the PATH), listens on a free loopback port and keeps its socket in
its own temp dir; as root, it runs as the ``postgres`` system user, since PostgreSQL refuses to
run as root. Only for tests: fsync is off and every local connection is trusted. Its locale is
C, so text sorts by code point as on SQLite.

conftest.py's fixtures use it: ``postgres_server`` (one per session), ``postgres_url`` (a new
database per test) and ``registry_url`` (each test once on SQLite, once on PostgreSQL).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

INSTALL_HINT = "install it (Debian/Ubuntu: apt-get install postgresql)"
SUPERUSER = "postgres"
_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",  # a test cluster: speed over crash safety
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",  # many registries at once, each with its own pool
}


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server could be started; the message says what is missing."""


def find_bin_dir() -> Path:
    """The directory of ``initdb``, ``pg_ctl`` and ``psql``: the newest Debian cluster version,
    else the PATH's.

    Raises:
        PostgresUnavailable: None has all three.
    """
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0,
        reverse=True,
    )
    if initdb := shutil.which("initdb"):
        candidates.append(Path(initdb).resolve().parent)
    for candidate in candidates:
        if all((candidate / tool).is_file() for tool in ("initdb", "pg_ctl", "psql")):
            return candidate
    raise PostgresUnavailable(
        "PostgreSQL is not installed (no initdb, pg_ctl and psql under /usr/lib/postgresql/*/bin "
        f"or on the PATH): {INSTALL_HINT}"
    )


@dataclass(slots=True)
class PostgresServer:
    """One running test cluster; make it with :meth:`start`, end it with :meth:`stop`."""

    bin_dir: Path
    root: Path
    port: int
    run_as: list[str]

    @classmethod
    def start(cls) -> PostgresServer:
        """initdb a cluster in a new temp dir and start it on a free loopback port.

        Raises:
            PostgresUnavailable: The binaries are missing, or initdb or the server failed.
        """
        bin_dir = find_bin_dir()
        run_as = _run_as()
        root = Path(tempfile.mkdtemp(prefix="agentkv-postgres-"))
        if run_as:
            shutil.chown(root, SUPERUSER, SUPERUSER)
        server = cls(bin_dir, root, 0, run_as)
        try:
            server._run(
                "initdb", "-D", server.data, "-U", SUPERUSER, "-A", "trust", "-E", "UTF8",
                "--locale=C", "--no-sync", as_owner=True,
            )  # fmt: skip
            options = " ".join(f"-c {key}={value}" for key, value in _SETTINGS.items())
            for attempt in range(3):  # another process may take the free port first
                server.port = _free_port()
                try:
                    server._run(
                        "pg_ctl", "start", "-w", "-t", "60", "-D", server.data, "-l", server.log,
                        "-o", f"-p {server.port} -k {root} {options}", as_owner=True,
                    )  # fmt: skip
                    break
                except PostgresUnavailable:
                    if attempt == 2:
                        raise
        except PostgresUnavailable:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return server

    @property
    def data(self) -> str:
        return str(self.root / "data")

    @property
    def log(self) -> str:
        return str(self.root / "server.log")

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of one of the server's databases, as the superuser."""
        return f"postgresql+asyncpg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, prefix: str = "agentkv") -> str:
        """Create an empty database with a new name. Returns its URL."""
        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        self.sql(f'CREATE DATABASE "{name}" TEMPLATE template0')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        """Drop the database of ``url``, closing the connections still open to it."""
        name = url.rsplit("/", 1)[1]
        self.sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def sql(self, statement: str, database: str = SUPERUSER) -> str:
        """Run one SQL statement with psql as the superuser. Returns what it printed."""
        return self._run(
            "psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1",
            "-p", str(self.port), "-U", SUPERUSER, "-d", database, "-c", statement,
        )  # fmt: skip

    def stop(self) -> None:
        """Stop the server (fast shutdown) and delete its temp dir."""
        try:
            self._run("pg_ctl", "stop", "-w", "-m", "fast", "-D", self.data, as_owner=True)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def _run(self, tool: str, *args: str, as_owner: bool = False) -> str:
        command = [*(self.run_as if as_owner else []), str(self.bin_dir / tool), *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            log = Path(self.log).read_text() if Path(self.log).is_file() else ""
            raise PostgresUnavailable(
                f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}"
                + (f"\nserver log:\n{log[-2000:]}" if log else "")
            )
        return done.stdout


async def fetch(url: str, statement: str) -> list[tuple[Any, ...]]:
    """Run one SQL statement on the database of ``url`` with asyncpg itself, bypassing
    SQLAlchemy and the registry. Returns the rows it selected, as tuples."""
    connection = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
    try:
        return [tuple(row) for row in await connection.fetch(statement)]
    finally:
        await connection.close()


def _run_as() -> list[str]:
    """The command prefix that runs the server's tools as a user PostgreSQL accepts."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam(SUPERUSER)
    except KeyError:
        raise PostgresUnavailable(
            f"running as root, and there is no {SUPERUSER!r} system user to run PostgreSQL as "
            f"(it refuses to run as root): {INSTALL_HINT}, which creates that user"
        ) from None
    if (runuser := shutil.which("runuser")) is None:
        raise PostgresUnavailable(
            f"running as root without runuser (util-linux) to run PostgreSQL as {SUPERUSER!r}"
        )
    return [runuser, "-u", SUPERUSER, "--"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
