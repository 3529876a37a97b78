"""``agentkv serve``: the server's configuration from its flags, its logging, and uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from agentkv.config import RuntimeConfig

PROG = "agentkv"
EXIT_BAD_INPUT = 2


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from agentkv import EngineConfig, RuntimeConfig
    from agentkv.models.directory import resolve_model_path
    from agentkv.server.app import create_app
    from agentkv.server.hosts import allowed_hosts, is_loopback
    from agentkv.server.stateless import DEFAULT_STATELESS_TTL_S
    from agentkv.server.worker import DrainingServer

    resolve_model_path(args.model)  # a bad spec fails here, as bad input, not in the server
    api_key = args.api_key or os.environ.get("AGENTKV_API_KEY") or None
    if api_key is None and not is_loopback(args.host):
        print(f"{PROG}: warning: serving on {args.host} without --api-key", file=sys.stderr)
    kv_bits = None if args.kv_bits == "none" else int(args.kv_bits)
    engine = EngineConfig(
        kv_budget_bytes=args.kv_budget_bytes,
        policy=args.policy,
        max_decode_stall=args.max_decode_stall,
        max_prefill_step_s=args.max_prefill_step_s,
        batch_kv_bits=None if args.batch_kv_bits == "none" else int(args.batch_kv_bits),
    )
    given_budget = args.disk_budget_bytes
    lease = {} if args.lease_s is None else {"lease_s": args.lease_s}
    config = RuntimeConfig(
        model=args.model,
        data_dir=args.data_dir,
        kv_bits=kv_bits,
        disk_budget_bytes="auto" if given_budget is None else given_budget or None,  # 0: none
        engine=engine,
        db_url=args.db_url,
        cache_dir=args.cache_dir,
        worker_id=args.worker_id,
        default_max_tokens=args.default_max_tokens,
        speculative=args.speculative,
        draft_model=args.draft_model,
        **lease,
    ).resolved()
    print(f"{PROG}: {_budgets(config, given_budget is None)}", file=sys.stderr)
    options: dict = {"max_body_bytes": args.max_body_bytes} if args.max_body_bytes else {}
    if args.max_messages:
        options["max_messages"] = args.max_messages
    options["allowed_hosts"] = allowed_hosts(args.host, args.allowed_hosts)
    ttl = DEFAULT_STATELESS_TTL_S if args.stateless_ttl is None else args.stateless_ttl
    options["stateless_ttl_s"] = ttl or None  # 0: never expire
    if args.responses_ttl is not None:
        options["responses_ttl_s"] = args.responses_ttl or None  # 0: keep
    if args.max_stateless_agents is not None:
        options["max_stateless_agents"] = args.max_stateless_agents or None  # 0: no cap
    options["keep_volatile"] = args.keep_volatile_metadata
    _log_to_stderr()
    app = create_app(config, api_key, **options)  # (it logs its worker id and registry)
    uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info")
    server = DrainingServer(uvicorn_config, app.state.drain, grace_s=args.drain_grace_s)
    try:
        server.run()
    except SystemExit:  # uvicorn exits when the app fails to start
        if getattr(app.state, "startup_error", None) is None:
            raise
    except KeyboardInterrupt:  # uvicorn raises Ctrl-C again once it has shut down cleanly
        print(f"{PROG}: stopped", file=sys.stderr)
    error = getattr(app.state, "startup_error", None)
    if error is not None:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def _budgets(config: RuntimeConfig, disk_auto: bool) -> str:
    """The resolved memory and disk budgets, said at start-up."""
    from agentkv.config import DISK_BUDGET_SHARE, HOT_CACHE_MAX_BYTES, HOT_CACHE_SHARE

    def gib(n: int) -> str:
        return f"{n / 1024**3:.2f} GiB"

    disk = config.disk_budget_bytes
    if disk is None:
        disk_text = "none"
    elif disk_auto:
        disk_text = f"{gib(disk)} ({DISK_BUDGET_SHARE:.0%} of the space for {config.caches_path})"
    else:
        disk_text = gib(disk)
    return (
        f"hot tier budget {gib(config.hot_cache_bytes)} ({HOT_CACHE_SHARE:.0%} of memory, at "
        f"most {gib(HOT_CACHE_MAX_BYTES)}), disk budget {disk_text}"
    )


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (not the stream it was then)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def _log_to_stderr() -> None:
    """agentkv's own INFO lines (one per turn: its cache source and costs) on stderr, next to
    uvicorn's."""
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    logger = logging.getLogger("agentkv")
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        logger.addHandler(handler)
