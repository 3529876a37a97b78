"""A tiny random-weight gpt-oss model with the real o200k_harmony tokenizer, for harmony tests.

``build_harmony_model(out)`` writes a directory that ``mlx_lm.load`` loads: mlx-lm's ``gpt_oss``
architecture at toy size (2 layers, hidden size 64, 4 experts, float32, random weights saved by
``tests.architectures``), and the tokenizer of OpenAI's gpt-oss models: o200k_base's 199,998
byte-level BPE tokens plus the 1,090 special tokens of o200k_harmony (ids 199998 to 201087, e.g.
``<|start|>`` = 200006), converted by ``transformers``' ``TikTokenConverter``, with a short
harmony chat template. No BOS is prepended, as with gpt-oss.

The BPE ranks come from the npm package js-tiktoken (``npm install -g js-tiktoken@1.0.21``),
which ships them as JavaScript; ``o200k_vocab`` rewrites them as OpenAI's ``o200k_base.tiktoken``
and checks its published sha256. The directory holds that file too, so
``TIKTOKEN_ENCODINGS_BASE=<dir>`` lets openai-harmony load its encoding offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.architectures import ARCHITECTURES, _write_weights

O200K_FILE = "o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
JS_TIKTOKEN = "js-tiktoken@1.0.21"
_COMPLETE = ".harmony-model-complete"
_BUILD_VERSION = "1"
"""Written into the marker file; a build of another version is rebuilt."""

# o200k's split regex, as in tiktoken.
_PREFIX = r"[^\r\n\p{L}\p{N}]?"
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_SUFFIX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
PATTERN = "|".join(
    [
        _PREFIX + _UPPER + "*" + _LOWER + "+" + _SUFFIX,
        _PREFIX + _UPPER + "+" + _LOWER + "*" + _SUFFIX,
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

FIRST_SPECIAL_ID = 199998
VOCAB_SIZE = 201088
_NAMED_SPECIAL = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
    200018: "<|endofprompt|>",
}
BOS, EOS, PAD = "<|startoftext|>", "<|return|>", "<|endoftext|>"
EOS_IDS = [200002, 199999, 200012]  # <|return|>, <|endoftext|>, <|call|>

SYSTEM_TEXT = (
    "You are a tiny model.\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)
CHAT_TEMPLATE = "".join(
    [
        "<|start|>system<|message|>" + SYSTEM_TEXT + "<|end|>",
        "{%- for message in messages -%}",
        "{%- if message.role in ('system', 'developer') -%}",
        "{%- if not loop.first -%}",
        "{{ raise_exception('Only the first message can be a system or developer message.') }}",
        "{%- endif -%}",
        "<|start|>developer<|message|># Instructions\n\n{{ message.content }}<|end|>",
        "{%- elif message.role == 'user' -%}",
        "<|start|>user<|message|>{{ message.content }}<|end|>",
        "{%- elif message.role == 'assistant' -%}",
        "<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>",
        "{%- elif message.role == 'tool' -%}",
        "<|start|>functions.{{ message.name or 'tool' }} to=assistant<|channel|>commentary",
        "<|message|>{{ message.content }}<|end|>",
        "{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}",
    ]
)


def special_tokens() -> list[str]:
    """The special tokens of o200k_harmony, in id order from ``FIRST_SPECIAL_ID``."""
    return [_NAMED_SPECIAL.get(i, f"<|reserved_{i}|>") for i in range(FIRST_SPECIAL_ID, VOCAB_SIZE)]


def js_tiktoken() -> Path | None:
    """js-tiktoken's ``o200k_base.cjs`` under npm's global root, or None (no npm, no package)."""
    try:
        root = subprocess.run(
            ["npm", "root", "-g"], capture_output=True, text=True, check=True, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    path = Path(root) / "js-tiktoken" / "dist" / "ranks" / "o200k_base.cjs"
    return path if root and path.is_file() else None


def o200k_vocab(out_dir: Path) -> Path:
    """Write ``o200k_base.tiktoken`` into ``out_dir`` from the installed js-tiktoken.

    Raises:
        FileNotFoundError: js-tiktoken is not installed.
        ValueError: The ranks do not rebuild OpenAI's file (its sha256 differs).
    """
    source = js_tiktoken()
    if source is None:
        raise FileNotFoundError(f"js-tiktoken is not installed (npm install -g {JS_TIKTOKEN})")
    data = _tiktoken_bytes(source)
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_SHA256:
        raise ValueError(
            f"{source} does not rebuild OpenAI's {O200K_FILE}: sha256 {digest}, expected "
            f"{O200K_SHA256} (install {JS_TIKTOKEN})"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / O200K_FILE
    partial = path.with_name(f".{O200K_FILE}.{os.getpid()}")
    partial.write_bytes(data)
    partial.replace(path)
    return path


def _tiktoken_bytes(source: Path) -> bytes:
    """The ``.tiktoken`` file of the ranks in a js-tiktoken ``.cjs`` file."""
    text = source.read_text(encoding="utf-8")
    ranks = json.loads(text[text.index("{") : text.rindex("}") + 1])["bpe_ranks"]
    entries: list[tuple[int, str]] = []
    for line in ranks.split("\n"):
        fields = line.split(" ")
        if len(fields) < 2:
            continue
        offset = int(fields[1])
        entries += [(offset + i, token) for i, token in enumerate(fields[2:])]
    entries.sort()
    return "".join(f"{token} {rank}\n" for rank, token in entries).encode("ascii")


def build_harmony_model(out: Path) -> Path:
    """Write the tiny gpt-oss model into ``out``, unless a complete build is already there.

    The files are written into a temporary sibling directory renamed to ``out`` at the end, so an
    aborted or concurrent build leaves no half-written ``out``.

    Returns:
        ``out``, which ``mlx_lm.load`` loads.

    Raises:
        FileNotFoundError: js-tiktoken is not installed.
        ValueError: Its ranks are not OpenAI's o200k_base.
    """
    out = Path(out)
    if _complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write_model(partial)
        _move_into_place(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def _complete(out: Path) -> bool:
    marker = out / _COMPLETE
    return marker.is_file() and marker.read_text(encoding="utf-8") == _BUILD_VERSION


def _move_into_place(partial: Path, out: Path) -> None:
    if out.exists() and not _complete(out):
        shutil.rmtree(out)  # an incomplete or outdated build
    try:
        partial.rename(out)
    except OSError:
        if not _complete(out):  # else a concurrent build finished first
            raise


def _write_model(out: Path) -> None:
    config = model_config()
    _write_weights(config, out / "model.safetensors")
    _write_json(out / "config.json", config)
    _write_tokenizer(out)
    _write_json(
        out / "generation_config.json",
        {field: config[field] for field in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    (out / _COMPLETE).write_text(_BUILD_VERSION, encoding="utf-8")


def model_config() -> dict:
    """The ``config.json`` of the tiny model: ``tests.architectures``' gpt_oss, resized."""
    return ARCHITECTURES["gpt_oss"] | {
        "architectures": ["GptOssForCausalLM"],
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "head_dim": 64,
        "sliding_window": 128,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        "bos_token_id": 199998,
        "eos_token_id": EOS_IDS,
        "pad_token_id": 199999,
    }


def _write_tokenizer(out: Path) -> None:
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = special_tokens()
    vocab = o200k_vocab(out)
    tokenizer = TikTokenConverter(
        vocab_file=str(vocab), pattern=PATTERN, extra_special_tokens=specials
    ).converted()
    for token_id, token in enumerate(specials, FIRST_SPECIAL_ID):
        if tokenizer.token_to_id(token) != token_id:
            raise ValueError(f"{token} got id {tokenizer.token_to_id(token)}, not {token_id}")
    tokenizer.save(str(out / "tokenizer.json"))
    tokens = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    _write_json(out / "special_tokens_map.json", tokens)
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **tokens,
            "add_bos_token": False,
            "add_eos_token": False,
            "model_max_length": 131072,
            "chat_template": CHAT_TEMPLATE,
        },
    )


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
