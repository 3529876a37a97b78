"""A Hugging Face ``tokenizers`` tokenizer rebuilt from the vocabulary a GGUF file carries.

Two GGUF tokenizer models are understood:

- ``llama``: SentencePiece BPE with byte fallback (Gemma, Llama 1/2, Mistral). The file holds
  pieces, scores and token types but no merges. SentencePiece merges the adjacent pair whose
  joined piece scores highest, so merges ranked by that score reproduce its segmentation in a
  ``tokenizers`` BPE model. Control tokens become special added tokens; user-defined ones
  (Gemma's runs of spaces, newlines and HTML tags) become added tokens matched before BPE, as
  SentencePiece matches them.
- ``gpt2``: byte-level BPE with merges (Llama 3), with the pre-tokenizer regex that
  ``tokenizer.ggml.pre`` names.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentkv.engine.errors import UnsupportedModelError

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

GPT2_PRE = "gpt-2"
LLAMA3_PRE = "llama-bpe"
# Llama 3's split regex (its tokenizer.json); GPT-2's is ByteLevel's built-in one.
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "default": GPT2_PRE,
    GPT2_PRE: GPT2_PRE,
    LLAMA3_PRE: LLAMA3_PRE,
    "llama3": LLAMA3_PRE,
}


@dataclass(slots=True, frozen=True)
class GGUFVocab:
    """The ``tokenizer.ggml.*`` fields of a GGUF file.

    Attributes:
        model: ``tokenizer.ggml.model`` ("llama" or "gpt2").
        pre: ``tokenizer.ggml.pre``, the pre-tokenizer name of a ``gpt2`` model.
        tokens: Every token's text, by id.
        token_types: Every token's GGUF type (NORMAL, CONTROL, ...), by id.
        scores: Every token's score (SentencePiece log-probability or merge priority), by id.
        merges: ``"left right"`` pairs of a ``gpt2`` model, best first.
        bos_id: Beginning-of-sequence id, if any.
        eos_id: End-of-sequence id, if any.
        unk_id: Unknown-token id, if any.
        pad_id: Padding id, if any.
        add_bos: Whether encoding prepends BOS.
        add_space_prefix: Whether SentencePiece prepends a space to the text.
    """

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_space_prefix: bool

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def build_tokenizer(vocab: GGUFVocab):
    """The ``tokenizers.Tokenizer`` equivalent of a GGUF vocabulary.

    Raises:
        UnsupportedModelError: A tokenizer model or pre-tokenizer this module does not know.
    """
    from tokenizers import AddedToken, processors

    if vocab.model == "llama":
        tokenizer = _sentencepiece(vocab)
    elif vocab.model == "gpt2":
        tokenizer = _byte_level(vocab)
    else:
        raise UnsupportedModelError(
            f"tokenizer model {vocab.model!r} is not supported; "
            "import-gguf reads 'llama' (SentencePiece) and 'gpt2' (byte-level BPE) vocabularies"
        )
    added = []
    for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)):
        if kind in (CONTROL, USER_DEFINED) or i in (vocab.bos_id, vocab.eos_id, vocab.pad_id):
            added.append(AddedToken(text, special=kind != USER_DEFINED, normalized=False))
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])
    if vocab.add_bos and vocab.bos_id is not None:
        bos = vocab.tokens[vocab.bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.bos_id)]
        )
    return tokenizer


def sentencepiece_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """BPE merges that replay SentencePiece: every split of a normal piece into two normal
    pieces, ranked by the joined piece's score (best first), ties by the parts' scores."""
    ids = {t: i for i, t in enumerate(vocab.tokens) if vocab.token_types[i] == NORMAL}
    scores = vocab.scores
    ranked = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], -scores[ids[left]], -scores[ids[right]], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece(vocab: GGUFVocab):
    from tokenizers import Tokenizer, decoders, models, normalizers

    ids: dict[str, int] = {}
    for i, text in enumerate(vocab.tokens):
        ids.setdefault(text, i)  # a duplicated piece keeps its first id, as llama.cpp does
    unk = vocab.token(vocab.unk_id)
    tokenizer = Tokenizer(
        models.BPE(
            ids, sentencepiece_merges(vocab), unk_token=unk, fuse_unk=True, byte_fallback=True
        )
    )
    steps = [normalizers.Replace(" ", "▁")]
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
        decode.append(decoders.Strip(" ", 1, 0))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Sequence(decode)
    return tokenizer


def _byte_level(vocab: GGUFVocab):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = PRE_TOKENIZERS.get(vocab.pre or "default")
    if pre is None:
        raise UnsupportedModelError(
            f"byte-level pre-tokenizer {vocab.pre!r} is not supported; "
            f"import-gguf knows {sorted(PRE_TOKENIZERS)}"
        )
    ids: dict[str, int] = {}
    for i, text in enumerate(vocab.tokens):
        ids.setdefault(text, i)
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    tokenizer = Tokenizer(models.BPE(ids, merges, ignore_merges=pre == LLAMA3_PRE))
    if pre == LLAMA3_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer
