"""Tiny offline models, model specs, fingerprints and the `agentkv tiny-model` command.

Everything here runs real code on real files: models are built into a temporary AGENTKV_HOME
(one per module, so user caches are neither used nor touched), the CLI runs as a subprocess,
and mlx-lm loads and runs what was built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

import agentkv.models.directory
from agentkv.engine.errors import ModelNotFoundError, OutputDirNotEmptyError, UnknownTinyModelError
from agentkv.engine.models.loading import load_model
from agentkv.models.directory import model_fingerprint, resolve_model_path
from agentkv.models.tiny import TINY_SPECS, build_tiny_model, models_home, tiny_model_dir
from agentkv.server.cli import main

SPECS = ["tiny:gemma3", "tiny:llama"]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": [{"type": "text", "text": "Count: 1 2 3"}]},
    {"role": "assistant", "content": "4 5 6"},
]
RENDERED = {
    "tiny:gemma3": "<bos><start_of_turn>system\nYou are terse.<end_of_turn>\n"
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
    "<start_of_turn>user\nCount: 1 2 3<end_of_turn>\n<start_of_turn>model\n4 5 6<end_of_turn>\n",
    "tiny:llama": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse."
    "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nCount: 1 2 3<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n4 5 6<|eot_id|>",
}
GENERATION_PROMPT = {
    "tiny:gemma3": "<start_of_turn>model\n",
    "tiny:llama": "<|start_header_id|>assistant<|end_header_id|>\n\n",
}


@pytest.fixture(scope="module", autouse=True)
def agentkv_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("agentkv_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENTKV_HOME", str(home))
        yield home


@pytest.fixture(scope="module", params=SPECS)
def spec(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def cli_build(spec, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("cli") / "model"
    proc = run_cli("tiny-model", spec, "--out", str(out))
    return out, proc


@pytest.fixture(scope="module")
def loaded(spec):
    return load_model(spec)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agentkv.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def file_digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def greedy_tokens(model, prompt: list[int], n: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def test_cli_prints_path_and_fingerprint(cli_build):
    out, proc = cli_build
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"path: {out}", f"fingerprint: {model_fingerprint(out)}"]


def test_cli_build_is_byte_identical_to_in_process_builds(spec, cli_build, tmp_path):
    out, _ = cli_build
    cached = tiny_model_dir(spec)
    rebuilt = build_tiny_model(spec, tmp_path / "again")
    assert sorted(file_digests(out)) == [
        "agentkv_tiny.json",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert file_digests(out) == file_digests(cached) == file_digests(rebuilt)


def test_cache_dir_is_named_by_definition_hash(spec, agentkv_home):
    name = spec.removeprefix("tiny:")
    expected = agentkv_home / "models" / f"{name}-{TINY_SPECS[spec].definition_hash}"
    assert models_home() == agentkv_home / "models"
    assert tiny_model_dir(spec) == expected
    assert resolve_model_path(spec) == expected


def test_mlx_lm_loads_cli_build_and_generates(spec, cli_build, loaded):
    out, _ = cli_build
    model, tokenizer = mlx_lm.load(str(out))
    prompt = tokenizer.encode("Hello there, how are you")
    tokens = greedy_tokens(model, prompt, 8)
    assert len(tokens) == 8
    assert all(0 <= t < TINY_SPECS[spec].vocab_size for t in tokens)
    # Same bytes on disk, same greedy continuation, whichever directory it was loaded from.
    assert tokens == greedy_tokens(loaded.model, prompt, 8)
    text = mlx_lm.generate(model, tokenizer, "Hello there", max_tokens=8)
    assert isinstance(text, str)


def test_prompt_cache_layer_types(spec, loaded):
    types = [type(c) for c in make_prompt_cache(loaded.model)]
    if spec == "tiny:gemma3":
        assert types == [RotatingKVCache, KVCache, RotatingKVCache, KVCache, RotatingKVCache]
        assert [c.max_size for c in make_prompt_cache(loaded.model)[::2]] == [32, 32, 32]
    else:
        assert types == [KVCache, KVCache, KVCache, KVCache]


def test_generation_past_the_sliding_window(loaded):
    prompt = loaded.tokenizer.encode(" ".join(["alpha beta gamma"] * 15))
    assert len(prompt) > 40
    cache = make_prompt_cache(loaded.model)
    assert len(greedy_tokens_with_cache(loaded.model, prompt, cache, 6)) == 6
    offsets = {c.offset for c in cache}
    assert len(offsets) == 1 and offsets.pop() >= len(prompt) + 5
    for c in cache:
        held = c.keys.shape[2]
        if type(c) is RotatingKVCache:
            assert held == 32
        else:
            assert held >= len(prompt) + 5


def greedy_tokens_with_cache(model, prompt: list[int], cache, n: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache)
    return [int(t) for t, _ in steps]


def test_loaded_model_properties(spec, loaded):
    expected = {
        "tiny:gemma3": (5, frozenset({1, 5}), 32),
        "tiny:llama": (4, frozenset({1, 4}), None),
    }[spec]
    assert (len(loaded.model.layers), loaded.eos_token_ids, loaded.sliding_window) == expected
    assert loaded.max_context == 8192
    assert loaded.vocab_size == 512 == len(loaded.tokenizer)
    assert loaded.spec == spec
    assert loaded.path == tiny_model_dir(spec)
    assert loaded.config["model_type"] == TINY_SPECS[spec].model_type


def test_chat_template_renders_prefixes_as_prefixes(spec, loaded):
    tokenizer = loaded.tokenizer

    def render(messages, add_generation_prompt=False):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    full = render(CONVERSATION)
    assert full == RENDERED[spec]
    full_ids = tokenizer.encode(full, add_special_tokens=False)
    for k in range(1, len(CONVERSATION) + 1):  # transformers refuses an empty conversation
        prefix = render(CONVERSATION[:k])
        assert full.startswith(prefix)
        # Turns end and start on special tokens, so the token ids are a prefix too.
        prefix_ids = tokenizer.encode(prefix, add_special_tokens=False)
        assert full_ids[: len(prefix_ids)] == prefix_ids
        with_prompt = render(CONVERSATION[:k], add_generation_prompt=True)
        assert with_prompt == prefix + GENERATION_PROMPT[spec]


def test_special_tokens_are_single_ids(spec, loaded):
    tokenizer = loaded.tokenizer
    chat = TINY_SPECS[spec].chat
    for token_id, token in enumerate(chat.special_tokens):
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
        assert tokenizer.convert_ids_to_tokens(token_id) == token
    bos_id = chat.special_tokens.index(chat.bos)
    assert tokenizer.bos_token == chat.bos
    assert tokenizer.encode("hi")[0] == bos_id
    assert tokenizer.encode("hi", add_special_tokens=False)[0] != bos_id
    ids = tokenizer.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True)
    assert ids[0] == bos_id
    assert ids.count(bos_id) == 1
    turn_end = {"tiny:gemma3": "<end_of_turn>", "tiny:llama": "<|eot_id|>"}[spec]
    turn_end_id = chat.special_tokens.index(turn_end)
    assert ids.count(turn_end_id) == 2  # system and user turns
    assert turn_end_id in loaded.eos_token_ids


def test_every_token_id_decodes(spec, loaded):
    tokenizer = loaded.tokenizer
    vocab_size = TINY_SPECS[spec].vocab_size
    tokens = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    assert None not in tokens and len(set(tokens)) == vocab_size
    detokenizer = tokenizer.detokenizer
    for token_id in range(vocab_size):
        detokenizer.add_token(token_id)
    detokenizer.finalize()
    assert detokenizer.text.startswith(tokenizer.decode([0, 1, 2]))


def test_fingerprint_is_stable_and_distinguishes_models(tmp_path, capsys):
    gemma_a, gemma_b = load_model("tiny:gemma3"), load_model("tiny:gemma3")
    llama = load_model("tiny:llama")
    assert gemma_a.fingerprint == gemma_b.fingerprint == model_fingerprint(gemma_a.path)
    assert len(gemma_a.fingerprint) == 64
    assert gemma_a.fingerprint != llama.fingerprint
    copy = shutil.copytree(gemma_a.path, tmp_path / "copy")
    assert model_fingerprint(copy) == gemma_a.fingerprint  # the path is not part of it
    assert main(["fingerprint", str(copy)]) == 0
    assert capsys.readouterr().out == f"{gemma_a.fingerprint}\n"


def test_fingerprint_changes_when_one_weight_byte_changes(tmp_path):
    copy = Path(shutil.copytree(tiny_model_dir("tiny:gemma3"), tmp_path / "copy"))
    before = model_fingerprint(copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    data[header_end + (len(data) - header_end) // 2] ^= 0x01
    weights.write_bytes(data)
    assert model_fingerprint(copy) != before
    assert load_model(copy).fingerprint == model_fingerprint(copy)


def test_sampled_fingerprint_for_large_weights(tmp_path, monkeypatch):
    copy = Path(shutil.copytree(tiny_model_dir("tiny:gemma3"), tmp_path / "copy"))
    full = model_fingerprint(copy)
    monkeypatch.setattr(
        agentkv.models.directory, "FULL_HASH_LIMIT", 0
    )  # treat the tiny weights as large
    sampled = model_fingerprint(copy)
    assert sampled != full
    assert model_fingerprint(copy) == sampled
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x80  # the last sampled chunk ends at the last byte
    weights.write_bytes(data)
    assert model_fingerprint(copy) != sampled


def test_local_directory_spec_loads(tmp_path):
    directory = Path(shutil.copytree(tiny_model_dir("tiny:llama"), tmp_path / "llama"))
    by_str, by_path = load_model(str(directory)), load_model(directory)
    assert by_str.spec == str(directory)
    assert by_str.path == by_path.path == directory.resolve()
    assert by_str.fingerprint == by_path.fingerprint == load_model("tiny:llama").fingerprint
    prompt = by_str.tokenizer.encode("abc")
    assert greedy_tokens(by_str.model, prompt, 4) == greedy_tokens(by_path.model, prompt, 4)


def test_missing_models_raise_model_not_found(tmp_path):
    (tmp_path / "no_config").mkdir()
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text("{}")
    for spec in (
        tmp_path / "absent",
        str(tmp_path / "no_config"),
        tmp_path / "no_weights",
        "no/such/dir",
    ):
        with pytest.raises(ModelNotFoundError, match=r"Hugging Face ids \(org/name\[@revision\]\)"):
            load_model(spec)
    assert issubclass(ModelNotFoundError, FileNotFoundError)


def test_unknown_tiny_spec(tmp_path, capsys):
    with pytest.raises(UnknownTinyModelError) as excinfo:
        resolve_model_path("tiny:nope")
    message = str(excinfo.value)
    assert message == "unknown tiny model 'tiny:nope'; known: " + ", ".join(TINY_SPECS)
    assert isinstance(excinfo.value, ValueError)
    assert main(["tiny-model", "tiny:nope", "--out", str(tmp_path / "m")]) == 2
    assert capsys.readouterr().err == f"agentkv: error: {message}\n"
    assert not (tmp_path / "m").exists()


def test_out_dir_must_be_new_empty_or_the_same_build(tmp_path, capsys):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirNotEmptyError):
        build_tiny_model("tiny:llama", occupied)
    assert main(["tiny-model", "tiny:llama", "--out", str(occupied)]) == 2
    assert "is not an empty directory" in capsys.readouterr().err
    assert sorted(p.name for p in occupied.iterdir()) == ["notes.txt"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert build_tiny_model("tiny:llama", empty) == empty
    assert build_tiny_model("tiny:llama", empty) == empty  # an identical earlier build is fine
    with pytest.raises(OutputDirNotEmptyError):
        build_tiny_model("tiny:gemma3", empty)


def test_concurrent_first_use_builds_one_directory(tmp_path):
    code = "from agentkv.models.tiny import tiny_model_dir; print(tiny_model_dir('tiny:llama'))"
    env = {**os.environ, "AGENTKV_HOME": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    paths = {proc.communicate(timeout=300)[0].strip() for proc in procs}
    assert [proc.returncode for proc in procs] == [0, 0, 0]
    (path,) = paths
    assert os.listdir(tmp_path / "models") == [Path(path).name]  # no temporary leftovers
    assert file_digests(Path(path)) == file_digests(tiny_model_dir("tiny:llama"))


def test_concurrent_threads_build_once(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path))
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = set(pool.map(tiny_model_dir, ["tiny:gemma3"] * 3))
    assert paths == {tmp_path / "models" / f"gemma3-{TINY_SPECS['tiny:gemma3'].definition_hash}"}
    (path,) = paths
    assert os.listdir(tmp_path / "models") == [path.name]
    monkeypatch.undo()
    assert file_digests(path) == file_digests(tiny_model_dir("tiny:gemma3"))


def test_console_script_lists_tiny_models():
    script = Path(sys.executable).with_name("agentkv")
    proc = subprocess.run([script, "list-tiny"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert [line.split()[0] for line in proc.stdout.splitlines()] == list(TINY_SPECS)


@pytest.mark.slow
def test_bench_model_builds_with_full_vocab(tmp_path):
    start = time.perf_counter()
    path = build_tiny_model("tiny:gemma3-bench", tmp_path / "bench")
    build_seconds = time.perf_counter() - start
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        512,
        12,
        32_768,
    )
    model, tokenizer = mlx_lm.load(str(path))
    assert len(tokenizer) == 32_768
    types = [type(c) for c in make_prompt_cache(model)]
    assert types == ([RotatingKVCache] * 5 + [KVCache]) * 2
    tokens = tokenizer.convert_ids_to_tokens(list(range(32_768)))
    assert None not in tokens and not any(t.startswith("<unused") for t in tokens)
    assert len(greedy_tokens(model, tokenizer.encode("benchmark"), 4)) == 4
    print(f"tiny:gemma3-bench built in {build_seconds:.1f} s")


def test_quantized_bfloat16_spec_builds_what_mlx_lm_loads_quantized(tmp_path, monkeypatch):
    """A spec's ``dtype`` and ``weight_bits`` (as ``tiny:gemma3-12b`` uses them): the same
    random draw as the float32 model, cast, and its linear and embedding weights quantized in
    groups of 64, which mlx-lm loads as quantized layers and runs in bfloat16."""
    base = TINY_SPECS["tiny:gemma3"]
    spec = dataclasses.replace(base, name="tiny:gemma3-q4", dtype="bfloat16", weight_bits=4)
    monkeypatch.setitem(TINY_SPECS, spec.name, spec)
    assert spec.definition_hash != base.definition_hash
    defaults = dataclasses.replace(spec, name=base.name, dtype="float32", weight_bits=None)
    assert defaults.definition_hash == base.definition_hash  # older specs keep their hashes
    path = build_tiny_model(spec.name, tmp_path / "q4")
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4}
    assert config["torch_dtype"] == "bfloat16"
    model, tokenizer = mlx_lm.load(str(path))
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear) and (q_proj.bits, q_proj.group_size) == (4, 64)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert q_proj.scales.dtype == mx.bfloat16
    reference, _ = mlx_lm.load(str(tiny_model_dir(base.name)))
    expected = reference.model.layers[0].self_attn.q_proj.weight.astype(mx.bfloat16)
    weight = mx.dequantize(q_proj.weight, q_proj.scales, q_proj.biases, group_size=64, bits=4)
    error = mx.abs(weight.astype(mx.float32) - expected.astype(mx.float32))
    step = mx.abs(expected.astype(mx.float32)).max().item() / 7  # a 4-bit step of the range
    assert 0 < error.max().item() <= step
    logits = model(mx.array([tokenizer.encode("hello")]))
    assert logits.dtype == mx.bfloat16 and logits.shape[-1] == 512
    assert len(greedy_tokens(model, tokenizer.encode("hello"), 4)) == 4


def test_twelve_b_spec_has_gemma3_12b_shapes():
    config = TINY_SPECS["tiny:gemma3-12b"].config
    shapes = {
        "hidden_size": 3840,
        "intermediate_size": 15_360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
        "torch_dtype": "bfloat16",
        "quantization": {"group_size": 64, "bits": 4},
    }
    assert {k: config[k] for k in shapes} == shapes
    assert config["layer_types"].count("full_attention") == 8
