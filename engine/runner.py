"""One step of the batch through mlx-lm's model: decode rows and prefill chunks together.

A step is one forward pass over ``T`` rows of one token (see ``agentkv.engine.attention``):
one row per decoding sequence (it feeds the token it sampled last step; a drafting one feeds
it and its drafts, ``agentkv.engine.speculative``) and one row per prompt token of the prefill
chunks the scheduler picked. Weights are read once for all of them, which is what lets a long
prompt join without stalling the sequences that are decoding. Logits are computed only for
the rows that sample: decode and drafting rows, and a prompt's final chunk's last. Steps are
pipelined as mlx-lm's ``GenerationBatch`` does: a step's tokens are sampled lazily and
evaluated while the next step is being built (not in a step with drafts, checked at once).
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import TokenBuffer, make_prompt_cache

from agentkv.engine.attention.spans import install_spans, step_views
from agentkv.engine.attention.step import Span, StepCache, install
from agentkv.engine.batch.buffers import held_arrays
from agentkv.engine.batch.layout import KVLayout, first_positions
from agentkv.engine.deepstack import install_deepstack
from agentkv.engine.errors import AgentKVError, UnsupportedModelError
from agentkv.engine.models.mrope import decode_positions, prefill_positions, step_offsets
from agentkv.engine.models.vision import IMAGE_BASE, Vision, image_blocks, image_rows, text_tokens
from agentkv.engine.request import Checkpoint, layer_nbytes
from agentkv.engine.sequence import SeqStatus, Sequence
from agentkv.engine.step import StepPlan, join_inputs

log = logging.getLogger(__name__)

PROBE_TOKENS = 8
CHANNEL_PROBE_TOKENS = 160  # whole key groups FLOAT_WINDOW old and more (a ring wraps)
FIRST_TOKENS_KEPT = 16  # first tokens whose first-position keys and values are kept


class ModelRunner:
    """Runs steps of the batch through one model (on the generation thread)."""

    def __init__(
        self,
        model: nn.Module,
        kv_bits: int | None = None,
        group_size: int | None = None,
        vision: Vision | None = None,
    ):
        """``kv_bits``: hold the layers' KV quantized in the batch (see
        ``agentkv.engine.batch``), in groups of ``group_size`` (None: the precision's own); a
        model whose attention cannot take quantized keys (attention sinks) keeps them in its
        precision, with a warning. ``vision``: a vision-language model's images."""
        self.model = model
        self.block_tokens: int | None = None  # EngineConfig.cache_block_tokens
        self.vision: Vision | None = vision
        self._firsts: dict[int, list] = {}  # first_positions' by token, oldest first
        name = type(model).__module__
        installed = install(model)
        try:
            self.layout = KVLayout.of(model)
        except (AgentKVError, MemoryError):
            raise
        except Exception as exc:
            raise UnsupportedModelError(f"{name}: its layers fail a forward pass: {exc}") from exc
        # The probes compare logits in the model's precision. Attention that reads its cache
        # outside mlx-lm's scaled_dot_product_attention (multi-head latent attention, attention
        # written out) fails them as a ragged step: its layers then run span by span.
        self.spans_attention, failure = False, None
        for attention in (False, True) if installed else (True,):
            install_spans(model, attention)
            try:
                self._backbone, self._head = self._split_head()
            except MemoryError:
                raise
            except Exception as exc:
                failure = exc
                continue
            self.spans_attention, failure = attention, None
            break
        if failure is not None:  # its layers do not run as a step of rows: say which and why
            first = str(failure).splitlines()[0] if str(failure) else ""
            raise UnsupportedModelError(
                f"{name}: its layers fail as a step of agentkv's batch, even span by span "
                f"({type(failure).__name__}: {first})"
            ) from failure
        install_deepstack(model, vision)  # (over the span calls: it adds to the step's rows)
        if self.spans_attention:
            log.info("%s: attention reads its cache itself; its layers run span by span", name)
        if kv_bits is not None and not any(w != 0 for w in self.layout.windows):
            log.warning(
                "batch_kv_bits=%d: %s has no attention layers, no KV to hold quantized; the "
                "batch holds its recurrent state in the model's precision",
                kv_bits,
                name,
            )
        elif kv_bits is not None:
            self._quantize(KVLayout.of(model, kv_bits, group_size))

    @property
    def can_draft(self) -> bool:
        """Whether a step can feed drafts and be cut back exactly (every layer ``KVCache`` or
        ``RotatingKVCache`` in the model's precision: ``agentkv.engine.speculative``)."""
        layout = self.layout
        return layout.packing is None and not layout.recurrent and not any(layout.nested)

    def first_positions(self, token: int) -> list[tuple[mx.array, mx.array]]:
        """:func:`~engine.batch.layout.first_positions` of ``token`` through this model, kept for
        the last :data:`FIRST_TOKENS_KEPT` tokens asked (most sequences start with BOS)."""
        if token in self._firsts:
            got = self._firsts.pop(token)
        else:
            got = first_positions(self.model, token)
            if len(self._firsts) >= FIRST_TOKENS_KEPT:
                self._firsts.pop(next(iter(self._firsts)))
        self._firsts[token] = got
        return got

    def _quantize(self, layout: KVLayout) -> None:
        """Use ``layout`` (quantized layers) once a step of rows runs through it to finite
        logits; else keep the model's precision and say why."""
        model, probe, split = self.model, mx.arange(1, PROBE_TOKENS + 1), PROBE_TOKENS - 1
        if layout.packing is not None and layout.packing.any_channel:
            # Keys are quantized per channel once a group of them is FLOAT_WINDOW old: later
            # steps read the first's that way.
            split = CHANNEL_PROBE_TOKENS
            probe = mx.arange(1, split + PROBE_TOKENS + 1)
        exact, self.layout = self.layout, layout
        try:  # (its last token a decode step, as attention reads those through other paths)
            got = self._probe_rows(lambda x, cache: model(x, cache=cache), probe, split, True)
            if not mx.all(mx.isfinite(got)).item():
                raise UnsupportedModelError("its logits are not finite")
        except Exception as exc:
            self.layout = exact
            log.warning(
                "batch_kv_bits=%d: %s cannot attend to quantized keys (%s); the batch holds "
                "its KV in the model's precision",
                layout.bits,
                type(model).__module__,
                exc,
            )

    def run(self, plan: StepPlan) -> mx.array | None:
        """Queue ``plan``'s forward pass; sequences' ``pending`` tokens become its samples.

        Records in ``plan.fed`` what each decode row fed (its previous ``pending``), to be
        reported once evaluated. Returns the array of samples (None if no row sampled).
        """
        layers = len(self.layout.windows)
        spans: list[list[Span]] = [[] for _ in range(layers)]
        positions, sampling, chunks = [], [], []
        feeds: list[tuple[Sequence, int, int]] = []  # (sequence, first row, rows) it feeds
        row = 0
        for group in plan.decode:
            n = len(group.seqs)
            fences = self._fences([(seq, len(seq.tokens), 1) for seq in group.seqs])
            for i, layer in enumerate(group.layers):
                spans[i].append(Span(layer, row, n, False, group.padded, fences))
            positions.append(decode_positions(group))
            for seq in group.seqs:
                plan.fed.append((seq, seq.pending))
                plan.fed_logprobs.append(seq.pending_logprob)
                seq.pending_logprob = None
                feeds.append((seq, row, 1))
                sampling.append((row, seq))
                row += 1
        decoded = len(plan.fed)  # (the decode rows'; drafting ones feed theirs as spans)
        drafting: list[tuple[Sequence, int]] = []  # (sequence, first sampling entry)
        for seq, drafts in plan.verify:  # pending + drafts: a span of its own, each sampled
            n = 1 + len(drafts)
            for i, layer in enumerate(seq.group.layers):
                spans[i].append(Span(layer, row, n, prefill=True))
            positions.append(seq.group.positions + mx.arange(n))
            chunks.append([seq.pending, *drafts])
            plan.fed.append((seq, seq.pending))
            plan.fed_logprobs.append(None)
            drafting.append((seq, len(sampling)))
            sampling += [(row + j, seq) for j in range(n)]
            row += n
        images: list[tuple[int, int, int]] = []  # (row, image token, index in the image)
        positioned: list[tuple[int, int, int, int]] = []  # (row, t, h, w): multimodal rotary
        for seq, n in plan.prefill:
            fences = self._fences([(seq, len(seq.tokens), n)])
            blocks = image_blocks(seq.prompt[:n]) if seq.whole_images else None
            for i, layer in enumerate(seq.group.layers):
                spans[i].append(Span(layer, row, n, True, fences=fences, blocks=blocks))
            positions.append(prefill_positions(seq, n, row, self.vision, positioned))
            chunks.append(seq.prompt[:n])
            if seq.request.images:
                images += image_rows(seq.tokens, chunks[-1], row, self.vision.rule.joiners)
            feeds.append((seq, row, n))
            row += n
            if n == len(seq.prompt):
                sampling.append((row - 1, seq))
        inputs = join_inputs([p for _, p in plan.fed[:decoded]], chunks)
        caches = self._step_caches(spans, step_offsets(positions, positioned))
        sampled, reported = None, ()
        embedded = None
        if images:  # (Engine.submit refuses image tokens to a model without vision)
            features = {t: f for seq, _ in plan.prefill for t, f in seq.features.items()}
            embedded = self.vision.embeddings(inputs, images, features)[:, None, :]
            placeholder = mx.array(self.vision.placeholder, inputs.dtype)
            inputs = mx.where(inputs >= IMAGE_BASE, placeholder, inputs)  # (what it may read)
        if any(s.logits_processors for s, _, _ in feeds):
            _extend_contexts(feeds, inputs, self.vision and self.vision.placeholder)
        if sampling:
            logits = self._logits(inputs, caches, [r for r, _ in sampling], row, embedded)
            seqs = [s for _, s in sampling]
            raw = logits
            if any(s.logits_processors for s in seqs):
                logits = _process(logits, seqs)
            sampled = _sample(logits, seqs)
            asked = [(j, s) for j, s in enumerate(seqs) if s.request.logprobs is not None]
            if asked:
                reported = _logprobs(raw, sampled, asked)
                for n, (_, seq) in enumerate(asked):
                    seq.pending_logprob = (reported, n)
        else:  # prefill chunks only: run the layers for their caches, skip the head
            self._hidden(inputs, caches, embedded)
        updated = [held_arrays(c) for s, _ in plan.prefill for c in s.group.layers]
        ends = [  # where a prompt's history ends, snapshots (``checkpoint_at``, ``snapshots_at``)
            (seq, seq.group.windows(seq, self.layout))
            for seq, n in plan.prefill
            if seq.is_checkpoint(len(seq.tokens) + n)
        ]
        updated += [held_arrays(x) for _, windows in ends if windows for x in windows.values()]
        mx.async_eval(*([] if sampled is None else [sampled]), *reported, updated)
        for seq, n in plan.prefill:
            seq.tokens += seq.prompt[:n]
            seq.prompt = seq.prompt[n:]
        for seq, windows in ends:
            if windows:
                at, nbytes = len(seq.tokens), sum(layer_nbytes(x) for x in windows.values())
                if at == seq.request.checkpoint_at:
                    seq.prompt_end = Checkpoint(at, windows, nbytes, prompt_end=True)
                else:
                    seq.snapshots[at] = Checkpoint(at, windows, nbytes)
        for j, (_, seq) in enumerate(sampling):
            seq.pending = (sampled, j)
            seq.status = SeqStatus.DECODING
        for seq, first in drafting:  # its samples are read at once (GenerationLoop._verify)
            seq.verify, seq.pending = (sampled, first), None
        return sampled

    def _step_caches(self, spans: list[list[Span]], positions: Any) -> list[Any]:
        return step_views(self.layout.windows, self.layout.nested, spans, positions)

    def _fences(self, rows: list[tuple[Sequence, int, int]]) -> tuple[tuple[int, ...], ...] | None:
        """Per row ``(sequence, first position, positions)`` of a span, each position's fence
        (None unless the batch holds q8 KV: only its layers read them)."""
        if self.layout.bits != 8:
            return None
        return tuple(
            tuple(seq.fence(p, self.block_tokens) for p in range(first, first + n))
            for seq, first, n in rows
        )

    def _hidden(self, inputs: mx.array, caches: list[StepCache], embedded: Any = None) -> None:
        """Run a step whose rows need no logits (its caches are what it updates)."""
        extra = {} if embedded is None else {"input_embeddings": embedded}
        if self._head is None:
            self.model(inputs[:, None], cache=caches, **extra)
        else:
            self._backbone(inputs[:, None], cache=caches, **extra)

    def _logits(
        self,
        inputs: mx.array,
        caches: list[StepCache],
        rows: list[int],
        total: int,
        embedded: Any = None,
    ) -> mx.array:
        x = inputs[:, None]
        extra = {} if embedded is None else {"input_embeddings": embedded}
        subset = None if len(rows) == total else mx.array(rows)
        if self._head is None:
            out = self.model(x, cache=caches, **extra)
            return (out if subset is None else out[subset])[:, -1, :]
        hidden = self._backbone(x, cache=caches, **extra)
        return self._head(hidden if subset is None else hidden[subset])[:, -1, :]

    def _split_head(self) -> tuple[Any, Any]:
        """The model's backbone and output head, when they can be called apart (so a prefill
        chunk's rows skip the vocabulary projection), else (None, None).

        Each candidate head is checked against the whole model on a few probe tokens; the
        probe also checks that a step of rows gives the logits of an ordinary forward pass.
        """
        model = self.model
        probe = mx.arange(1, PROBE_TOKENS + 1)
        expected = model(probe[None], cache=make_prompt_cache(model))[0]
        whole = self._probe_rows(lambda x, cache: model(x, cache=cache), probe)
        scale = mx.abs(expected).max().item() + 1e-6
        if mx.abs(whole - expected).max().item() > 0.02 * scale:
            raise UnsupportedModelError(
                f"{type(model).__module__}: a step of one-token rows does not reproduce the "
                "model's logits (it mixes tokens outside attention); agentkv cannot batch it"
            )
        # A vision-language checkpoint's text half sits under ``language_model``.
        inner = model if hasattr(model, "model") else getattr(model, "language_model", model)
        backbone = getattr(inner, "model", None)
        if not isinstance(backbone, nn.Module):
            return None, None
        heads = [getattr(inner, "lm_head", None)]
        heads.append(getattr(getattr(backbone, "embed_tokens", None), "as_linear", None))
        for head in heads:
            if not callable(head):
                continue
            try:
                split = self._probe_rows(
                    lambda x, cache, h=head: h(backbone(x, cache=cache)), probe
                )
            except Exception:  # a candidate that does not fit this architecture
                continue
            if mx.array_equal(split, whole).item():
                return backbone, head
        return None, None

    def _probe_rows(
        self, forward: Any, probe: mx.array, split: int = 0, decode: bool = False
    ) -> mx.array:
        """The logits of ``probe`` fed as one step of rows (``split``: the tokens from
        ``split`` on in later steps, attending to the first's keys as the layout holds them;
        ``decode``: the last of them alone, as a decode step feeds a sampled token)."""
        reads = self.layout.reads_first_positions
        group = self.layout.empty_layers(
            self.first_positions(int(probe[0].item())) if reads else None
        )
        last = probe.size - 1 if decode else probe.size
        parts = [(probe[:split], 0), (probe[split:last], split)] if split else [(probe, 0)]
        parts = [p for p in parts if p[0].size]
        if decode:
            parts.append((probe[last:], last))
        for part, start in parts:
            prefill = not (decode and start == last)
            spans = self._step_caches(
                [[Span(layer, 0, part.size, prefill=prefill)] for layer in group],
                mx.arange(start, start + part.size),
            )
            out = forward(part[:, None], spans)[:, -1, :]
        mx.eval(out)
        return out


def _extend_contexts(
    feeds: list[tuple[Sequence, int, int]], inputs: mx.array, placeholder: int | None
) -> None:
    """Add this step's input tokens to what each sequence's logits processors look back at
    (every step, sampled or not, so the context always equals what the KV holds); an image's
    tokens as the model's ``placeholder``, which has an id in the vocabulary (``inputs`` hold
    it already)."""
    for seq, first, n in feeds:
        if seq.logits_processors:
            if seq.context is None:
                held = seq.tokens if placeholder is None else text_tokens(seq.tokens, placeholder)
                seq.context = TokenBuffer(held)
            seq.context.update_and_fetch(inputs[first : first + n])


def _process(logits: mx.array, seqs: list[Sequence]) -> mx.array:
    """Apply logits processors; they look back at everything the KV holds after this step."""
    rows = []
    for i, seq in enumerate(seqs):
        row = logits[i : i + 1]
        for processor in seq.logits_processors:
            row = processor(seq.context.tokens, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)


def _sample(logits: mx.array, seqs: list[Sequence]) -> mx.array:
    """Each row's next token: one argmax for greedy rows, each sampler on its own row."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if all(s.sampler is None for s in seqs):
        return mx.argmax(logprobs, axis=-1)
    return mx.concatenate(
        [
            s.sampler(logprobs[i : i + 1]) if s.sampler else mx.argmax(logprobs[i : i + 1], axis=-1)
            for i, s in enumerate(seqs)
        ]
    )


def _logprobs(
    logits: mx.array, sampled: mx.array, asked: list[tuple[int, Sequence]]
) -> tuple[mx.array, ...]:
    """For the rows of ``asked`` (row, sequence): the sampled token's log-softmax under the
    model's ``logits``, and (when any asks for alternatives) the ids and log-softmax of the
    most likely tokens, as many as the most any of them asks for (unsorted)."""
    rows = mx.array([j for j, _ in asked])
    picked = logits[rows].astype(mx.float32)
    logprobs = picked - mx.logsumexp(picked, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, sampled[rows][:, None], axis=-1)[:, 0]
    k = max(s.request.logprobs for _, s in asked)
    if k == 0:
        return (chosen,)
    top = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    return chosen, top, mx.take_along_axis(logprobs, top, axis=-1)
