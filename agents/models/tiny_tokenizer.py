"""The tiny models' tokenizer: a byte-level BPE trained on a pseudo-English corpus generated from
a fixed seed, so every build of a tiny model gets the same vocabulary."""

from __future__ import annotations

import random
from pathlib import Path

from agentkv.models.chat_formats import ChatFormat


def _corpus(seed: int, n_words: int, lexicon_size: int) -> list[str]:
    """Pseudo-English lines: a syllable lexicon drawn with Zipf-like frequencies."""
    rng = random.Random(seed)
    onsets = ["", *"bcdfghjklmnprstvwz", "ch", "sh", "th", "st", "tr", "pl", "gr", "br", "cl"]
    vowels = [*"aeiou", "ai", "ea", "oo", "ou", "ie"]
    codas = ["", "", *"nrstlm", "nd", "st", "ng", "ck"]
    lexicon: set[str] = set()
    while len(lexicon) < lexicon_size:
        syllables = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        lexicon.add(
            "".join(
                rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                for _ in range(syllables)
            )
        )
    words = sorted(lexicon)
    rng.shuffle(words)
    drawn = rng.choices(words, weights=[1 / (i + 1) for i in range(len(words))], k=n_words)
    lines, sentence = [], []
    for word in drawn:
        sentence.append(word.capitalize() if not sentence else word)
        if rng.random() < 0.02:
            sentence.append(str(rng.randrange(10_000)))
        if rng.random() < 0.08:
            end = rng.choice((".", "?", "!", ",", ":", ";")) + rng.choice((" ", "\n", "\n\n"))
            lines.append(" ".join(sentence) + end)
            sentence = []
    lines.append(" ".join(words))  # every lexicon word, so a large vocab can fill up
    return lines


def write_tokenizer(
    chat: ChatFormat, vocab_size: int, corpus: tuple[int, int, int], out: Path
) -> None:
    """Train a byte-level BPE of ``vocab_size`` with ``chat``'s special tokens on the corpus
    (seed, words, lexicon size) generates; write ``out/tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(chat.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(*corpus), trainer)
    # A corpus too small for the vocab leaves ids the model can emit but nothing decodes.
    missing = vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_special_tokens([f"<unused{i}>" for i in range(missing)])
    for i, token in enumerate(chat.special_tokens):
        if tokenizer.token_to_id(token) != i:
            raise RuntimeError(f"tokenizer training moved special token {token} off id {i}")
    bos = chat.bos
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, chat.id_of(bos))]
    )
    tokenizer.save(str(out / "tokenizer.json"))
