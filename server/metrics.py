"""Prometheus metrics of one app, in a registry of its own (never the global one)."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentkv import Reply

CACHE_SOURCES = ("hot", "disk", "prefix", "rebuilt", "none")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    """Request, token, latency and engine metrics; ``render()`` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "agentkv_http_requests",
            "HTTP requests by route template, method and status code.",
            ["route", "method", "status"],
            registry=r,
        )
        self.input_tokens = Counter(
            "agentkv_input_tokens",
            "Prompt tokens of finished turns: cached (resumed) or prefilled.",
            ["kind"],
            registry=r,
        )
        self.output_tokens = Counter(
            "agentkv_output_tokens", "Generated tokens of finished turns.", registry=r
        )
        self.turns = Counter(
            "agentkv_turns",
            "Finished turns by where the cache came from (hot, disk, prefix, rebuilt, none).",
            ["cache_source"],
            registry=r,
        )
        self.ttft = Histogram(
            "agentkv_time_to_first_token_seconds",
            "From the call to the first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "agentkv_engine_queue_depth", "Requests waiting for a place in the batch.", registry=r
        )
        self.batch_size = Gauge(
            "agentkv_engine_batch_size",
            "Sequences in the engine's latest decode step (0 when idle).",
            registry=r,
        )
        self.active = Gauge(
            "agentkv_engine_active_requests", "Requests admitted and not finished.", registry=r
        )
        self.engine_gauges = {
            name: Gauge(f"agentkv_engine_{name}", text, registry=r)
            for name, text in (
                ("kv_budget_bytes", "KV memory budget of the running batch."),
                ("kv_reserved_bytes", "Budget set aside for the turns in the batch."),
                ("kv_held_bytes", "Bytes of the batch's KV buffers, padding included."),
                ("kv_padding_bytes", "Of those, bytes no turn owns (padding, growth room)."),
                ("kv_groups", "Length groups the batch's sequences are in."),
                ("waiting_for_memory", "Queued turns a free slot awaits but the KV budget not."),
                ("paused", "Turns preempted from the batch, waiting to rejoin."),
                ("kv_paused_bytes", "Bytes of paused turns' caches, outside the budget."),
                ("preemptions", "Turns preempted since the server started."),
                ("tokens_generated", "Tokens generated since the server started."),
                ("decode_tokens_per_second", "Generated tokens per second over the stats window."),
                ("prefill_tokens_per_step", "Prefill tokens a step beside decoding may run."),
                ("batch_kv_bits", "Precision of the batch's KV (0: the model's)."),
                ("kv_token_bytes", "K+V bytes a token of history holds in the batch."),
                ("drafted_tokens", "Drafts fed by speculative decoding since the server started."),
                ("accepted_tokens", "Of them, those kept: tokens generated without a step."),
            )
        }
        self.policy = Gauge(
            "agentkv_engine_policy",
            "The scheduling policy (1 for the one in use).",
            ["policy"],
            registry=r,
        )
        self.disk_bytes = Gauge(
            "agentkv_cache_disk_bytes", "Bytes of the agents' current cache files.", registry=r
        )
        self.disk_files = Gauge(
            "agentkv_cache_disk_files",
            "Cache files on disk: agents' tails, shared blocks and their window files.",
            registry=r,
        )
        self.disk_blocks = Gauge(
            "agentkv_cache_disk_blocks", "Blocks stored once and shared by caches.", registry=r
        )
        self.blocks_written = Gauge(
            "agentkv_cache_blocks_written",
            "Blocks written since the server started (a block is written once).",
            registry=r,
        )
        self.blocks_shared = Gauge(
            "agentkv_cache_blocks_shared",
            "Blocks saves found already stored (not written again) since the server started.",
            registry=r,
        )
        self.bytes_written = Gauge(
            "agentkv_cache_bytes_written",
            "Bytes of cache files written since the server started.",
            registry=r,
        )
        self.prefix_lookups = Gauge(
            "agentkv_cache_prefix_lookups",
            "Turns that looked for another conversation's cache to start from.",
            registry=r,
        )
        self.prefix_hits = Gauge(
            "agentkv_cache_prefix_hits",
            "Turns that started from another conversation's cache (stored or in memory).",
            registry=r,
        )
        self.prefix_tokens = Gauge(
            "agentkv_cache_prefix_tokens",
            "Prompt tokens taken from shared prefixes instead of prefilled.",
            registry=r,
        )
        self.disk_budget = Gauge(
            "agentkv_cache_disk_budget_bytes",
            "The disk budget for cache files (0: none).",
            registry=r,
        )
        self.evictions = Gauge(
            "agentkv_cache_evictions",
            "Cache files evicted to keep within the disk budget since the server started.",
            registry=r,
        )
        self.hot_bytes = Gauge(
            "agentkv_cache_hot_bytes", "Bytes of caches held in memory (hot tier).", registry=r
        )
        self.hot_precision = {
            name: Gauge(f"agentkv_cache_hot_{name}", text, ["precision"], registry=r)
            for name, text in (
                ("precision_agents", "Agents held in memory, by the precision of their KV."),
                ("precision_bytes", "Bytes they hold (turn checkpoints in, shared heads not)."),
                ("precision_tokens", "Tokens those caches hold."),
                ("token_bytes", "K+V bytes a token of history holds in the hot tier."),
            )
        }
        self.hot_budget = Gauge(
            "agentkv_cache_hot_budget_bytes",
            "The memory budget of the hot tier.",
            registry=r,
        )
        for kind in ("cached", "prefilled"):
            self.input_tokens.labels(kind)
        for source in CACHE_SOURCES:
            self.turns.labels(source)

    def observe_turn(self, reply: Reply) -> None:
        usage = reply.usage
        self.input_tokens.labels("cached").inc(usage.cached_tokens)
        self.input_tokens.labels("prefilled").inc(usage.prefilled_tokens)
        self.output_tokens.inc(usage.completion_tokens)
        self.turns.labels(reply.cache_source).inc()
        self.ttft.observe(max(0.0, reply.timings.ttft_s))

    def render(self, runtime_stats: dict[str, Any]) -> bytes:
        engine, disk = runtime_stats["engine"], runtime_stats["disk"]
        self.disk_bytes.set(disk["bytes"])
        self.disk_files.set(disk["files"])
        self.disk_blocks.set(disk["blocks"])
        self.blocks_written.set(disk["blocks_written"])
        self.blocks_shared.set(disk["blocks_shared"])
        self.bytes_written.set(disk["bytes_written"])
        self.prefix_lookups.set(disk["prefix_lookups"])
        self.prefix_hits.set(disk["prefix_hits"])
        self.prefix_tokens.set(disk["prefix_tokens"])
        self.disk_budget.set(disk["budget_bytes"] or 0)
        self.evictions.set(disk["evictions"])
        self.hot_bytes.set(runtime_stats["hot_tier"]["bytes"])
        by_precision = runtime_stats["hot_tier"]["by_precision"]
        for gauge in self.hot_precision.values():
            gauge.clear()  # a precision no agent is held in any more is not reported
        for precision, row in by_precision.items():
            for name, gauge in self.hot_precision.items():
                field = "token_bytes" if name == "token_bytes" else name.removeprefix("precision_")
                gauge.labels(precision).set(row[field])
        self.hot_budget.set(runtime_stats["hot_tier"]["budget_bytes"])
        self.queue_depth.set(engine.queued)
        self.batch_size.set(engine.batch_size)
        self.active.set(engine.active)
        for name, gauge in self.engine_gauges.items():
            attribute = "decode_tps" if name == "decode_tokens_per_second" else name
            gauge.set(getattr(engine, attribute))
        self.policy.labels(engine.policy).set(1)
        return generate_latest(self.registry)


class RequestMetricsMiddleware:
    """Counts every HTTP request by its route template (not the raw path) and status."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(route, scope["method"], str(status)).inc()
