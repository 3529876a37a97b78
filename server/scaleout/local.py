"""Workers behind HAProxy on this machine, as processes on free loopback ports (tests,
benchmarks).

:func:`local_cluster` starts ``agentkv serve`` workers ``w1``, ``w2``... sharing one registry
database and one cache directory, then HAProxy with the shipped config (:data:`CONFIG`), its
``server`` lines made one per worker, and stops them all on exit.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

CONFIG = Path(__file__).with_name("haproxy.cfg")
SERVER_LINE = re.compile(r'^    server w(\d+) "\$\{AGENTKV_WORKER\1-[^}]*\}"\n', re.MULTILINE)
START_TIMEOUT_S = 120.0


class RouterNotInstalledError(RuntimeError):
    """There is no ``haproxy`` on the PATH."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Worker:
    """One ``agentkv serve`` process; its log (stderr) in ``log``."""

    id: str
    port: int
    log: Path
    args: list[str]
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "agentkv.server.cli", *self.args],
                stdout=subprocess.DEVNULL,
                stderr=out,
            )

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until ``/ready`` answers 200 (RuntimeError if the process exits first)."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, timeout=5) as http:
            while time.monotonic() < deadline:
                if self.process is None or self.process.poll() is not None:
                    raise RuntimeError(f"worker {self.id} exited:\n{self.log_tail()}")
                with contextlib.suppress(httpx.TransportError):
                    if http.get("/ready").status_code == 200:
                        return
                time.sleep(0.1)
        raise TimeoutError(f"worker {self.id} not ready after {timeout_s} s:\n{self.log_tail()}")

    def stop(self) -> int | None:
        """SIGTERM (a drain), SIGKILL if it still runs after 60 s; its exit status."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.terminate()
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


@dataclass
class Cluster:
    """Workers behind HAProxy: ``url`` is the router's, each worker's own is ``worker.url``."""

    url: str
    stats_url: str
    db_url: str
    cache_dir: Path
    router_log: Path
    workers: list[Worker] = field(default_factory=list)
    router: subprocess.Popen | None = None

    def http(self, **options) -> httpx.Client:
        """A client of the router (``timeout`` 60 s unless given)."""
        options.setdefault("timeout", 60)
        return httpx.Client(base_url=self.url, **options)

    def worker(self, worker_id: str) -> Worker:
        return next(w for w in self.workers if w.id == worker_id)

    def router_states(self) -> dict[str, str]:
        """HAProxy's state of each worker: ``UP``, ``DOWN``, ``NOLB`` (draining), ``UP 1/2``..."""
        text = httpx.get(f"{self.stats_url}/stats;csv", timeout=5).text.lstrip("# ")
        return {
            row["svname"]: row["status"]
            for row in csv.DictReader(io.StringIO(text))
            if row["pxname"] == "workers" and row["svname"] not in ("FRONTEND", "BACKEND")
        }

    def wait_router_state(self, worker_id: str, state: str, timeout_s: float) -> float:
        """Seconds until HAProxy says ``state`` of the worker (TimeoutError past timeout_s)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.router_states().get(worker_id) == state:
                return time.monotonic() - start
            time.sleep(0.05)
        raise TimeoutError(
            f"HAProxy did not mark {worker_id} {state} in {timeout_s} s: {self.router_states()}"
        )


def router_config(workers: int, log_requests: bool = False) -> str:
    """The shipped config with a ``server`` line per worker (``AGENTKV_WORKER1``...), and with
    every request logged to stderr if ``log_requests``."""
    config = CONFIG.read_text()
    template = SERVER_LINE.search(config)
    if template is None:
        raise ValueError(f"{CONFIG} has no 'server w1 \"${{AGENTKV_WORKER1-...}}\"' line")
    lines = "".join(f'    server w{n} "${{AGENTKV_WORKER{n}}}"\n' for n in range(1, workers + 1))
    config = SERVER_LINE.sub("", config)
    config = config[: template.start()] + lines + config[template.start() :]
    if log_requests:
        config = config.replace("\nglobal\n", "\nglobal\n    log stderr format short local0 info\n")
        config = config.replace("\ndefaults\n", "\ndefaults\n    log global\n    option httplog\n")
    return config


@contextlib.contextmanager
def local_cluster(
    root: Path,
    db_url: str,
    workers: int = 2,
    model: str = "tiny:gemma3",
    worker_args: Sequence[str] = (),
    log_requests: bool = True,
) -> Iterator[Cluster]:
    """Start the workers and the router; stop them (SIGTERM) on exit.

    Args:
        root: a directory for the config, logs (``w1.log``..., ``haproxy.log``), the workers'
            data dirs and the shared ``caches``.
        db_url: the registry every worker shares (``--db-url``).
        workers: how many.
        model: their ``--model``.
        worker_args: more ``agentkv serve`` options for each.
        log_requests: HAProxy logs every request (its worker, retries, timings).

    Raises:
        RouterNotInstalledError: no ``haproxy`` on the PATH (checked before anything starts).
    """
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        raise RouterNotInstalledError("haproxy is not installed (apt-get install haproxy)")
    (root / "haproxy.cfg").write_text(router_config(workers, log_requests))
    cluster = Cluster(
        url=f"http://127.0.0.1:{free_port()}",
        stats_url=f"http://127.0.0.1:{free_port()}",
        db_url=db_url,
        cache_dir=root / "caches",
        router_log=root / "haproxy.log",
    )
    for n in range(1, workers + 1):
        worker_id, port = f"w{n}", free_port()
        args = ["serve", "--model", model, "--data-dir", str(root / worker_id)]
        args += ["--db-url", db_url, "--cache-dir", str(cluster.cache_dir)]
        args += ["--worker-id", worker_id, "--port", str(port), *worker_args]
        cluster.workers.append(Worker(worker_id, port, root / f"{worker_id}.log", args))
    env = {
        **os.environ,
        "AGENTKV_LB_BIND": cluster.url.removeprefix("http://"),
        "AGENTKV_LB_STATS": cluster.stats_url.removeprefix("http://"),
        **{f"AGENTKV_WORKER{n}": f"127.0.0.1:{w.port}" for n, w in enumerate(cluster.workers, 1)},
    }
    try:
        for worker in cluster.workers:
            worker.start()
        for worker in cluster.workers:
            worker.wait_ready()
        with open(cluster.router_log, "ab") as out:
            cluster.router = subprocess.Popen(
                [haproxy, "-f", str(root / "haproxy.cfg")],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        _wait_all_up(cluster)
        yield cluster
    finally:
        if cluster.router is not None:
            cluster.router.terminate()
            cluster.router.wait(10)
        for worker in cluster.workers:
            worker.stop()


def _wait_all_up(cluster: Cluster, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert cluster.router is not None
        if cluster.router.poll() is not None:
            raise RuntimeError(f"haproxy exited:\n{cluster.router_log.read_text()}")
        with contextlib.suppress(httpx.TransportError):
            if set(cluster.router_states().values()) == {"UP"}:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"HAProxy did not see every worker up in {timeout_s} s")
        time.sleep(0.05)
