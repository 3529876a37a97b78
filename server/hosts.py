"""Which ``Host`` a request may name: the defence against DNS rebinding.

A server on a loopback address is reachable from any web page the user opens: the page's
script resolves a name of its own (``evil.example.com``) to 127.0.0.1 and calls the server,
and the browser sends ``Host: evil.example.com``. So a server bound to loopback answers only
requests whose Host is a loopback name (``localhost``, ``127.0.0.1``, ``::1``) or the bound
address, with any port; others get 421 naming the host and the option to allow it
(``agentkv serve --allowed-hosts``). A server bound to another address checks nothing unless
told which hosts to allow (it should have an API key instead).
"""

from __future__ import annotations

import ipaddress

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from agentkv.server.errors import MISDIRECTED, APIError, Dialect

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ANY = "*"


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind_host: str, extra: list[str] | None = None) -> frozenset[str] | None:
    """The hosts a server bound to ``bind_host`` answers (None: any). ``extra`` adds to them;
    ``*`` among them turns the check off."""
    extra = [h.strip().lower() for h in extra or [] if h.strip()]
    if ANY in extra:
        return None
    if not is_loopback(bind_host) and not extra:
        return None
    base = LOOPBACK_NAMES | {bind_host.strip("[]").lower()} if is_loopback(bind_host) else set()
    return frozenset(base | {h.strip("[]") for h in extra})


def host_of(header: str) -> str:
    """The host of a Host header, without its port: ``[::1]:8000`` -> ``::1``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostCheck:
    """ASGI middleware answering 421 to requests whose Host is not allowed (``open_paths``
    aside: health checks, which a router sends with a Host of its own)."""

    def __init__(
        self, app: ASGIApp, hosts: frozenset[str], open_paths: frozenset[str] = frozenset()
    ):
        self.app = app
        self.hosts = hosts
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        host = host_of(header)
        if host in self.hosts or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        shown = repr(header) if header else "no Host header"
        error = APIError(
            MISDIRECTED,
            f"Host {shown} is not allowed: this server answers "
            f"{', '.join(sorted(self.hosts))} (it is bound to a loopback address, and other "
            "names could be a web page rebinding its DNS); to allow it, start the server with "
            "--allowed-hosts NAME (or '*' for any)",
        )
        await error.response(Dialect.of(Request(scope)))(scope, receive, send)
