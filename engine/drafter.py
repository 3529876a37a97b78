"""A draft model: a small model of the main model's vocabulary, drafting for decoding
sequences what their history does not hold (``EngineConfig.speculative = "draft"``).

Each sequence drafting with it holds its own draft KV (:class:`DraftCache`): plain ``KVCache``
layers of the draft model over the sequence's history (a sliding-window layer attends through
its window's mask over the whole history, so every position can be cut back), and the draft
tokens fed after it. A step's drafts are the draft model's greedy continuation: the tokens the
draft KV lacks (the history since it last drafted, the pending token) go in as one forward
pass, then one pass a draft. A draft is deterministic given the history, so the step's
verification (``agentkv.engine.step.verify``) keeps the main model's output exact, greedy or
sampled; before the next drafts, the draft KV is cut back to where it still agrees with the
history.

Its cost stays bounded a step: a draft KV behind by more than :data:`CATCH_UP` tokens (a new
turn's prompt, a resumed conversation) takes them in chunks over several steps, drafting
nothing meanwhile; one holding more than :data:`CONTEXT` tokens starts again from the history's
last ``CONTEXT // 2`` (a draft needs the recent past, and its rotary positions are relative).
When a turn ends, its draft KV is kept (``EngineConfig.draft_cache_bytes`` of them, least
recently used dropped first) and the conversation's next turn, whose history continues it,
takes it back: only the new turn is fed to the draft model. After a restart it is rebuilt
from the tokens.

A sequence stops drafting with the draft model for its turn when its drafts do not pay for
what they cost (``agentkv.engine.speculative.Speculation``): each draft is a forward pass
through it, :attr:`DraftModel.cost` of one through the main model (their weights' bytes).
Where the last sequences' drafts all failed to pay (a workload it cannot predict), only one
sequence in :data:`RETRY` tries it, so its draft KVs' prefill is not paid for nothing. A new
sequence's draft KV starts from the last :data:`CATCH_UP` tokens of its history.

A draft model whose layers hold recurrent state (a hybrid) cannot be cut back after a rejected
draft and is refused, as is one whose tokenizer differs from the main model's.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from agentkv.engine.config import EngineConfig
from agentkv.engine.errors import UnsupportedModelError
from agentkv.engine.models.loading import LoadedModel, load_model

log = logging.getLogger(__name__)

CATCH_UP = 256
"""The most history tokens a draft KV takes in one step."""
CONTEXT = 2048
"""The most tokens a draft KV holds; past it, it starts again from the last ``CONTEXT // 2``."""
TRIALS = 4
"""Sequences' trials of the draft model remembered: when the last ones all failed to pay,
only one sequence in :data:`RETRY` tries it (its draft KV costs a prefill of its history)."""
RETRY = 8


@dataclass(slots=True, eq=False)
class DraftCache:
    """A sequence's draft KV: ``layers`` hold ``tokens``, which are its history from
    position ``start`` on and then the drafts fed after it; the first ``sure`` of them are
    known to be history."""

    layers: list[Any]
    start: int = 0
    tokens: list[int] = field(default_factory=list)
    sure: int = 0

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def cut_to(self, n: int) -> None:
        """Keep its first ``n`` tokens."""
        if n < len(self.tokens):
            for layer in self.layers:
                layer.trim(len(self.tokens) - n)
            del self.tokens[n:]
        self.sure = min(self.sure, n)

    def agreeing(self, want: list[int]) -> int:
        """How many of its tokens are the first of ``want`` (its history from ``start``,
        which extends what it was when the tokens it is sure of were fed)."""
        n, tokens = self.sure, self.tokens
        end = min(len(tokens), len(want))
        while n < end and tokens[n] == want[n]:
            n += 1
        return n


class DraftModel:
    """Drafts for decoding sequences with a loaded model of the main model's tokenizer; keeps
    finished turns' draft KVs for their next turns. Lives on the generation thread."""

    def __init__(self, draft: LoadedModel, main: LoadedModel, kept_bytes: int):
        refuse_unless_drafting(draft, main)
        self.loaded = draft
        self.kept_limit = kept_bytes
        self.model = draft.model
        self.vocab_size = main.vocab_size  # (a draft id past it is no token of the main model)
        # A token through it against one through the main model: decoding reads the weights.
        self.cost = weight_bytes(draft.model) / max(1, weight_bytes(main.model))
        self.kept: collections.OrderedDict[int, DraftCache] = collections.OrderedDict()
        self.fed_tokens = 0  # tokens fed to the draft model since it was loaded
        self.trials: collections.deque[bool] = collections.deque(maxlen=TRIALS)  # paid or not
        self.asked = 0  # sequences that could try it

    # ---- a sequence's draft KV across turns -----------------------------------------------

    def take(self, history: list[int]) -> DraftCache:
        """The kept draft KV whose tokens ``history`` continues (the one reaching furthest),
        else a new one."""
        best = None
        for key, cache in self.kept.items():
            end = cache.start + len(cache.tokens)
            longer = end <= len(history) and (best is None or end > best[1])
            if longer and cache.tokens == history[cache.start : end]:
                best = (key, end)
        if best is None:  # (from its last tokens: a draft needs the recent past)
            start = max(0, len(history) - CATCH_UP)
            return DraftCache([KVCache() for _ in make_prompt_cache(self.model)], start)
        return self.kept.pop(best[0])

    def worth_trying(self) -> bool:
        """Whether a sequence tries drafting with it: unless the last :data:`TRIALS`
        sequences' trials all failed to pay, when only one in :data:`RETRY` does."""
        self.asked += 1
        failing = len(self.trials) == TRIALS and not any(self.trials)
        return not failing or self.asked % RETRY == 0

    def keep(self, cache: DraftCache, history: list[int]) -> None:
        """Keep ``cache`` (cut to where it agrees with ``history``) for the turn that
        continues ``history``, dropping the least recently kept beyond its limit."""
        cache.cut_to(cache.agreeing(history[cache.start :]))
        if not cache.tokens or cache.nbytes > self.kept_limit:
            return
        self.kept[id(cache)] = cache
        total = sum(c.nbytes for c in self.kept.values())
        while total > self.kept_limit:
            total -= self.kept.popitem(last=False)[1].nbytes

    @property
    def kept_bytes(self) -> int:
        return sum(c.nbytes for c in self.kept.values())

    # ---- drafting -------------------------------------------------------------------------

    def draft(
        self, cache: DraftCache, history: list[int], last: int | None, k: int
    ) -> list[int] | None:
        """The draft model's next tokens after ``history`` and ``last`` (the pending token):
        ``k`` of them, or, while ``last`` is still being computed (None), the one expected
        there and ``k`` after it. None while ``cache`` is still catching up with the history
        (it took :data:`CATCH_UP` tokens of it this step)."""
        if len(history) - cache.start > CONTEXT:
            cache.layers = [KVCache() for _ in cache.layers]
            cache.start, cache.tokens, cache.sure = len(history) - CONTEXT // 2, [], 0
        want = history[cache.start :] + ([] if last is None else [last])
        if not want:
            return []
        # (at least the last token is fed again: its logits give the first draft)
        cache.cut_to(min(cache.agreeing(want), len(want) - 1))
        behind = want[len(cache.tokens) :]
        if len(behind) > CATCH_UP + 1:
            self._feed(cache, behind[:CATCH_UP])
            mx.eval([layer.state for layer in cache.layers])
            cache.sure = len(cache.tokens)
            return None
        n = k + (last is None)
        if len(behind) > 1:  # (no logits there: the vocabulary's matmul is skipped)
            self._feed(cache, behind[:-1])
        drafts = [self._next(cache, behind[-1:])]
        for _ in range(n - 1):
            drafts.append(self._next(cache, drafts[-1]))
        got = mx.concatenate(drafts).tolist()
        cache.sure = len(want)
        cache.tokens += got[:-1]
        for i, token in enumerate(got):  # (past the main vocabulary: no draft from there on)
            if token >= self.vocab_size:
                return got[:i]
        return got

    def _feed(self, cache: DraftCache, tokens: list[int] | mx.array) -> mx.array:
        """Feed ``tokens`` to the draft model; the logits at the last."""
        x = tokens[None] if isinstance(tokens, mx.array) else mx.array(tokens)[None]
        if not isinstance(tokens, mx.array):
            cache.tokens += tokens
        self.fed_tokens += x.shape[1]
        return self.model(x, cache=cache.layers)[:, -1, :]

    def _next(self, cache: DraftCache, tokens: list[int] | mx.array) -> mx.array:
        """The draft model's greedy token after ``tokens`` (a list, or the last draft)."""
        return mx.argmax(self._feed(cache, tokens), axis=-1)


def load_drafter(config: EngineConfig, main: LoadedModel, can_draft: bool) -> DraftModel | None:
    """``config``'s draft model for ``main`` (None: none named, or ``main``'s steps cannot be
    cut back after a rejected draft, which is logged: its replies decode a token a step)."""
    spec = config.draft_model
    if spec is None:
        return None
    if not can_draft:
        log.warning(
            "draft model %s not loaded: %s's layers (recurrent state, or KV held quantized in "
            "the batch) cannot be cut back after a rejected draft; replies decode a token a step",
            spec,
            main.spec,
        )
        return None
    return DraftModel(load_model(spec), main, config.draft_cache_bytes)


def weight_bytes(model: Any) -> int:
    return sum(x.nbytes for _, x in tree_flatten(model.parameters()))


def refuse_unless_drafting(draft: LoadedModel, main: LoadedModel) -> None:
    """Refuse a draft model agentkv cannot draft with for ``main``, saying why."""
    kinds = {type(layer).__name__ for layer in make_prompt_cache(draft.model)}
    other = kinds - {KVCache.__name__, RotatingKVCache.__name__}
    if other:
        raise UnsupportedModelError(
            f"draft model {draft.spec!r}: its {', '.join(sorted(other))} layers (recurrent "
            "state or nested caches) cannot be cut back after a rejected draft; use a draft "
            "model of attention layers only"
        )
    if draft.tokenizer.get_vocab() != main.tokenizer.get_vocab():
        raise UnsupportedModelError(
            f"draft model {draft.spec!r}: its tokenizer is not the one of {main.spec!r}; a "
            "draft model drafts the main model's token ids and must share its vocabulary"
        )
