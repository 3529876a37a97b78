"""The tokenizer's index for constrained decoding, saved on a tokenizer's first build and read
back later: the same index (token bytes, special tokens, end token, tokenization, masks) as a
fresh build, from the tiny models' byte-level BPE and the packaged Gemma 3's 262,144-token
vocabulary; a damaged file is built again."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
from transformers import AutoTokenizer

from agentkv.engine import token_index
from agentkv.models.directory import resolve_model_path
from agentkv.models.tiny import tiny_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "New York"]},
        "n": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "n", "tags"],
}
VALUE = '{"city": "New York", "n": 3.5, "tags": ["a b", "<end_of turn>", "é\\n"]}'


def masks(tokenizer, ids: list[int]) -> list[np.ndarray]:
    """The allowed-token masks along ``ids`` (a value the schema accepts)."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    mask = llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
    out = []
    for token in ids:
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        out.append(mask.copy())
        assert matcher.consume_token(token), matcher.get_error()
    return out


@pytest.mark.parametrize("model", ["tiny:tools", "gemma3-270m"])
def test_a_saved_index_is_the_index_a_build_gives(model, tmp_path, monkeypatch):
    path = tiny_model_dir(model) if model.startswith("tiny:") else resolve_model_path(model)
    hf = AutoTokenizer.from_pretrained(str(path))
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path))
    built = llguidance.hf.from_tokenizer(hf)
    first = token_index.token_index(hf)  # built, and saved
    (saved,) = (tmp_path / "token-index").iterdir()
    again = token_index.token_index(hf)  # read back
    assert type(again.is_canonical) is bool and again.is_canonical == built.is_canonical
    n = built.vocab_size
    assert first.vocab_size == again.vocab_size == n
    assert again.eos_token == built.eos_token
    for index in (again, first):
        assert [index.decode_bytes([i]) for i in range(n)] == [
            built.decode_bytes([i]) for i in range(n)
        ]
        assert [index.is_special_token(i) for i in range(n)] == [
            built.is_special_token(i) for i in range(n)
        ]
    text = 'Hello wörld <end_of_turn> {"a": 1}\n\n  x'
    assert again.tokenize_str(text) == built.tokenize_str(text)
    ids = built.tokenize_str(VALUE)
    for got, expected in zip(masks(again, ids), masks(built, ids), strict=True):
        assert np.array_equal(got, expected)
    # A damaged file is built again (and saved whole).
    saved.write_bytes(saved.read_bytes()[:100])
    rebuilt = token_index.token_index(hf)
    assert rebuilt.vocab_size == n and token_index._read(saved) is not None
