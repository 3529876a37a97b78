"""The ``agentkv`` command line.

Each subcommand is a ``_cmd_<name>(args) -> int`` function registered in :func:`build_parser`;
it imports what it needs when it runs, so ``agentkv --help`` stays instant. Errors that mean
"bad input" print one line to stderr and exit with status 2, like argparse's own.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from agentkv import (
    KVBudgetError,
    ModelInstallError,
    ModelNotFoundError,
    OutputDirNotEmptyError,
    UnknownTinyModelError,
    UnsupportedModelError,
)
from agentkv.server.serve import EXIT_BAD_INPUT, PROG, cmd_serve

MODEL_SPEC = "a Hugging Face id (org/name[@revision]), a model dir, gemma3-270m or tiny:<name>"
BAD_INPUT = (
    KVBudgetError,
    ModelInstallError,
    ModelNotFoundError,
    OutputDirNotEmptyError,
    UnknownTinyModelError,
    UnsupportedModelError,
)


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from agentkv.models.directory import model_fingerprint
    from agentkv.models.tiny import build_tiny_model, tiny_model_dir

    # Without --out the model goes to (or comes from) the shared cache that "tiny:" specs use.
    path = tiny_model_dir(args.spec) if args.out is None else build_tiny_model(args.spec, args.out)
    print(f"path: {path}")
    print(f"fingerprint: {model_fingerprint(path)}")
    return 0


def _cmd_list_tiny(args: argparse.Namespace) -> int:
    from agentkv.models.tiny import TINY_SPECS

    width = max(map(len, TINY_SPECS))
    for name, spec in TINY_SPECS.items():
        print(f"{name:<{width}}  {spec.description}")
    return 0


def _cmd_import_gguf(args: argparse.Namespace) -> int:
    import time

    from agentkv.models.directory import model_fingerprint
    from agentkv.models.gguf import import_gguf

    start = time.perf_counter()
    path = import_gguf(args.file, args.out, dtype=args.dtype, progress=not args.quiet)
    print(f"path: {path}")
    print(f"fingerprint: {model_fingerprint(path)}")
    print(f"seconds: {time.perf_counter() - start:.1f}")
    return 0


def _cmd_fingerprint(args: argparse.Namespace) -> int:
    from agentkv.models.directory import model_fingerprint, resolve_model_path

    print(model_fingerprint(resolve_model_path(args.spec)))
    return 0


def _worker_id(text: str) -> str:
    from agentkv.config import WORKER_ID_PATTERN

    if re.fullmatch(WORKER_ID_PATTERN, text) is None:
        raise argparse.ArgumentTypeError(
            "must be 1 to 64 letters, digits, '.', '_', ':' or '-', starting with a letter or "
            f"digit, got {text!r}"
        )
    return text


def _float_between(text: str, low: float, high: float, what: str = "a number") -> float:
    """``text`` as a float from ``low`` to ``high``, or the argparse error saying so."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be between {low:g} and {high:g}, got {text}")
    return value


def _seconds(text: str) -> float:
    """Seconds from 0 to 3600."""
    return _float_between(text, 0, 3600, "a number of seconds")


def _lease_seconds(text: str) -> float:
    value = _seconds(text)
    if value <= 0.5:  # RuntimeConfig.lease_s's bound
        raise argparse.ArgumentTypeError(f"must be over 0.5, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def _byte_size(text: str) -> int:
    """Bytes as an integer with an optional binary unit: 123456, 512M, 8G, 1.5GiB."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"must be a size in bytes like 8G or 512M, got {text!r}")
    value = int(float(match[1]) * _UNITS[match[2].lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def _stall_factor(text: str) -> float:
    return _float_between(text, 1.1, 100)


def _step_seconds(text: str) -> float:
    return _float_between(text, 0.01, 3600, "a number of seconds")


def _byte_size_or_zero(text: str) -> int:
    """Like :func:`_byte_size`, and 0."""
    return 0 if text.strip() == "0" else _byte_size(text)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Persistent LLM agents with KV caches on disk."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    tiny = commands.add_parser(
        "tiny-model",
        help="build an offline tiny model and print its path and fingerprint",
        description="Build a random-weight tiny model deterministically, with no network.",
    )
    tiny.add_argument("spec", metavar="SPEC", help="a tiny model spec, e.g. tiny:gemma3")
    tiny.add_argument(
        "--out",
        metavar="DIR",
        help="directory to write (new or empty); default: the shared cache in $AGENTKV_HOME",
    )
    tiny.set_defaults(func=_cmd_tiny_model)

    listing = commands.add_parser("list-tiny", help="list the built-in tiny model specs")
    listing.set_defaults(func=_cmd_list_tiny)

    importer = commands.add_parser(
        "import-gguf",
        help="convert a GGUF file (Gemma 3, Llama family) into an mlx-lm model directory",
        description="Dequantize a GGUF file and write config.json, model.safetensors, "
        "tokenizer.json and tokenizer_config.json (with a chat template) into a new directory "
        "that mlx_lm.load and `agentkv serve --model DIR` accept.",
    )
    importer.add_argument("file", metavar="FILE", help="the .gguf file")
    importer.add_argument("--out", required=True, metavar="DIR", help="directory to create")
    importer.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default="float32",
        help="weight dtype (default: float32, the fast one on CPU)",
    )
    importer.add_argument("--quiet", action="store_true", help="no progress bar")
    importer.set_defaults(func=_cmd_import_gguf)

    fingerprint = commands.add_parser("fingerprint", help="print a model's fingerprint")
    fingerprint.add_argument("spec", metavar="SPEC", help=MODEL_SPEC)
    fingerprint.set_defaults(func=_cmd_fingerprint)

    serve = commands.add_parser(
        "serve",
        help="serve the Anthropic and OpenAI chat APIs over HTTP",
        description="Serve Anthropic Messages, OpenAI Chat Completions, an agents API and "
        "Prometheus metrics for one model.",
    )
    serve.add_argument("--model", required=True, metavar="SPEC", help=MODEL_SPEC)
    serve.add_argument("--data-dir", default="data", metavar="DIR", help="default: ./data")
    serve.add_argument(
        "--db-url",
        metavar="URL",
        help="the registry database, shared by every worker: a SQLAlchemy URL "
        "(postgresql+asyncpg://user@host/agentkv, sqlite+aiosqlite:///path) or a SQLite file; "
        "default: DATA_DIR/agentkv.sqlite",
    )
    serve.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="the KV cache files, shared by every worker; default: DATA_DIR/caches",
    )
    serve.add_argument(
        "--worker-id",
        type=_worker_id,
        metavar="ID",
        help="this worker's name among those sharing the registry (in leases, logs, /ready "
        "and the x-agentkv-worker header); default: HOSTNAME-PID",
    )
    serve.add_argument(
        "--lease-s",
        type=_lease_seconds,
        metavar="SECONDS",
        help="how long an agent's lease outlives a worker that stops renewing it (a crashed "
        "worker's agents pass to another after this long; default: 10)",
    )
    serve.add_argument(
        "--drain-grace-s",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="on SIGTERM, /ready answers 503 at once and requests in flight finish; go on "
        "accepting requests at least this long, so that a router's health checks take the "
        "worker out before its port closes (default: 0)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="default: 8000")
    serve.add_argument(
        "--allowed-hosts",
        type=lambda value: value.split(","),
        default=[],
        metavar="NAMES",
        help="Host names requests may carry besides the loopback ones, comma-separated ('*': "
        "any). Bound to loopback, other names get 421 (DNS rebinding); bound elsewhere, "
        "nothing is checked unless this is given",
    )
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        help="require this key (x-api-key or Authorization: Bearer); default: $AGENTKV_API_KEY",
    )
    serve.add_argument(
        "--kv-bits",
        choices=("8", "4", "none"),
        default="8",
        help="quantization of KV caches saved to disk (default: 8)",
    )
    serve.add_argument(
        "--batch-kv-bits",
        choices=("8", "4", "none"),
        default="none",
        help="hold the running batch's KV quantized (8: 0.52x the bytes of "
        "float16), so one KV budget holds more long-history agents (default: none)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        metavar="N",
        help="refuse request bodies over N bytes with 413 (default: 32 MiB)",
    )
    serve.add_argument(
        "--keep-volatile-metadata",
        action="store_true",
        help="keep per-request metadata lines in system prompts (Claude Code's "
        "x-anthropic-billing-header line); by default they are dropped, so that a new session "
        "resumes the cached system prompt and tools instead of prefilling them again",
    )
    serve.add_argument(
        "--max-messages",
        type=_positive_int,
        metavar="N",
        help="refuse chat requests with more than N messages with 413 (default: 10000)",
    )
    serve.add_argument(
        "--disk-budget-bytes",
        type=_byte_size_or_zero,
        metavar="SIZE",
        help="keep cache files under SIZE (e.g. 20G), evicting the caches of the agents idle "
        "longest (their transcripts stay); default: 25%% of the space free for the cache "
        "directory at start-up (plus what it holds); 0: no budget",
    )
    serve.add_argument(
        "--kv-budget-bytes",
        type=_byte_size,
        metavar="SIZE",
        help="KV memory the running batch may hold (e.g. 8G); a turn reserves its history and "
        "prompt, more as it decodes, and the turns last in line wait while it has no room; one "
        "whose prompt can never fit is refused (413). Default: 60%% of the device memory left "
        "after the weights",
    )
    serve.add_argument(
        "--speculative",
        choices=("off", "lookup", "draft"),
        help="lookup: replies feed drafts from the agent's own history, several tokens a step "
        "where they restate it (the same tokens greedy, the same distribution sampled; the "
        "default without --draft-model); draft: those, and --draft-model's where the history "
        "has none (the default with it); off: one token a step",
    )
    serve.add_argument(
        "--draft-model",
        metavar="ID",
        help="a small model of the same tokenizer that drafts replies' next tokens (a Hugging "
        "Face id, a local directory; attention layers only)",
    )
    serve.add_argument(
        "--default-max-tokens",
        type=_positive_int,
        metavar="N",
        help="cap the replies of requests that set no max_tokens at N tokens (default: none, "
        "a reply runs until the model stops or the context is full, as OpenAI's API does)",
    )
    serve.add_argument(
        "--policy",
        choices=("fair", "latency_first", "throughput_first"),
        default="fair",
        help="how turns share the batch: fair (round robin, default), latency_first (new and "
        "short turns first), throughput_first (fill the batch, large prefill chunks)",
    )
    serve.add_argument(
        "--max-decode-stall",
        type=_stall_factor,
        default=2.0,
        metavar="X",
        help="while a prompt prefills beside decoding turns, keep their inter-token gap within X "
        "times a decode-only step (default: 2)",
    )
    serve.add_argument(
        "--max-prefill-step-s",
        type=_step_seconds,
        default=0.5,
        metavar="SECONDS",
        help="a step that only prefills holds about this much prompt (default: 0.5)",
    )
    serve.add_argument(
        "--stateless-ttl",
        type=_non_negative_int,
        metavar="SECONDS",
        help="delete agents created for requests that name no agent after this long without "
        "a turn (default: 3600, an hour; 0: never)",
    )
    serve.add_argument(
        "--responses-ttl",
        type=_non_negative_int,
        metavar="SECONDS",
        help="delete stored Responses API responses (store: true) this long after they were "
        "made (default: 2592000, 30 days; 0: never)",
    )
    serve.add_argument(
        "--max-stateless-agents",
        type=_non_negative_int,
        metavar="N",
        help="keep at most N agents created for requests that name no agent, deleting the idle "
        "ones used least recently (default: 256; 0: no cap)",
    )
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``agentkv`` command line.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The exit status: 0 on success, 2 for bad input.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    drafts = getattr(args, "speculative", None)
    if (drafts == "draft" and not args.draft_model) or (
        drafts in ("off", "lookup") and getattr(args, "draft_model", None)
    ):
        parser.error("--speculative draft and --draft-model go together")
    try:
        return args.func(args)
    except BAD_INPUT as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
