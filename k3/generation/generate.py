"""Autoregressive generation with the hybrid cache: prefill (chunked, per row for ragged batches), then batched
decode one token per step (absorbed MLA + recurrent KDA), sampling on fp32 last-position logits.

Ragged batches never pad the recurrent state: prompts of equal length are prefilled together, otherwise each
prompt is prefilled alone into its own cache row (`K3Cache.rows(i)`); decode then runs the whole batch, each MLA
row attending only to its own cached tokens. Nothing is position dependent (KDA + NoPE MLA), so any length works.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Union

import torch

from k3.errors import RequestError
from k3.generation.cache import K3Cache
from k3.generation.sampling import SamplingParams, process_logits, select_next

__all__ = ["generate", "stream_generate", "GenerationOutput", "GenerationEvent", "prefill", "generate_text",
           "stream_text", "chat", "stream_chat", "TextStreamer", "TextStream", "IncrementalDetokenizer"]

Cancel = Union[threading.Event, Callable[[], bool], None]


@dataclass
class GenerationOutput:
    sequences: torch.Tensor                     # [B, max(prompt+new)] int64, right-padded with pad_token_id
    prompt_lengths: List[int]
    new_tokens: List[List[int]]
    finish_reasons: List[str]                   # "stop_token" | "stop_string" | "length" | "cancelled"
    texts: Optional[List[str]] = None           # generated text (stop string cut off) when a tokenizer was given
    # return_logprobs=True: per row, the sampler's log-probability of each new token (aligned with new_tokens)
    logprobs: Optional[List[List[float]]] = None
    # record_routing=True: per row {router name: LongTensor [prompt + new, k]} of the experts the sampler's
    # routers picked (-1 where unknown: the last new token is never fed), or None when a call could not be mapped
    routing: Optional[List[dict]] = None
    # speculative="mtp": rounds, drafted, accepted, acceptance_rate, ... (k3.generation.speculative)
    speculative: Optional[dict] = None


@dataclass
class GenerationEvent:
    """One decode step: tokens[i] is the new id of row i, or None if row i had already finished."""
    step: int
    tokens: List[Optional[int]]
    finished: List[bool] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------- inputs
def _as_prompts(input_ids, lengths=None) -> List[List[int]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2:
            raise RequestError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        rows = input_ids.tolist()
        if lengths is not None:
            lengths = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
            if len(lengths) != len(rows):
                raise RequestError(f"lengths has {len(lengths)} entries for a batch of {len(rows)}")
            rows = [r[:n] for r, n in zip(rows, lengths)]
    elif isinstance(input_ids, Sequence) and input_ids and all(isinstance(x, int) for x in input_ids):
        rows = [list(input_ids)]
    elif isinstance(input_ids, Sequence):
        rows = [list(map(int, r)) for r in input_ids]
        if lengths is not None:
            rows = [r[:int(n)] for r, n in zip(rows, lengths)]
    else:
        raise RequestError(f"input_ids must be a LongTensor or a list of token-id lists, got {type(input_ids)}")
    if not rows or any(len(r) == 0 for r in rows):
        raise RequestError("every prompt needs at least one token")
    return rows


def _cancelled(cancel: Cancel) -> bool:
    if cancel is None:
        return False
    if hasattr(cancel, "is_set"):
        return bool(cancel.is_set())
    return bool(cancel())


# ---------------------------------------------------------------------------------------------------- prefill
def _chunks(n: int, chunk: Optional[int]):
    c = n if not chunk or chunk <= 0 else int(chunk)
    return [(s, min(n, s + c)) for s in range(0, n, c)]


PromptEmbeds = Union[Sequence[torch.Tensor], Callable[[torch.Tensor, List[int], int], torch.Tensor], None]


def _chunk_embeds(prompt_embeds: PromptEmbeds, ids: torch.Tensor, rows: List[int], start: int) -> torch.Tensor:
    """[b, t, d] input embeddings of the prompt chunk `ids` [b, t] (rows `rows`, from position `start`):
    rows of the given per-prompt tensors, or what the hook `prompt_embeds(ids, rows, start)` returns."""
    if callable(prompt_embeds):
        emb = prompt_embeds(ids, rows, start)
    else:
        emb = torch.stack([prompt_embeds[i][start:start + ids.shape[1]] for i in rows])
    if not isinstance(emb, torch.Tensor) or emb.dim() != 3 or tuple(emb.shape[:2]) != tuple(ids.shape):
        raise RequestError(f"prompt_embeds: expected [{ids.shape[0]}, {ids.shape[1]}, hidden] for this chunk, got "
                           f"{getattr(emb, 'shape', type(emb).__name__)}")
    return emb.to(ids.device)


def _check_prompt_embeds(prompt_embeds: PromptEmbeds, prompts: List[List[int]], hidden: int) -> None:
    if prompt_embeds is None or callable(prompt_embeds):
        return
    if len(prompt_embeds) != len(prompts):
        raise RequestError(f"prompt_embeds: {len(prompt_embeds)} tensor(s) for {len(prompts)} prompt(s)")
    for i, (e, p) in enumerate(zip(prompt_embeds, prompts)):
        if not isinstance(e, torch.Tensor) or tuple(e.shape) != (len(p), hidden):
            raise RequestError(f"prompt_embeds[{i}]: expected [{len(p)}, {hidden}] (prompt length, hidden), got "
                               f"{getattr(e, 'shape', type(e).__name__)}")


@torch.inference_mode()
def prefill(model, cache: K3Cache, prompts: List[List[int]], chunk_size: Optional[int] = None,
            cancel: Cancel = None, prompt_embeds: PromptEmbeds = None) -> Optional[torch.Tensor]:
    """Feed each prompt into its cache row (chunked); return fp32 logits [B, V] of each prompt's last token
    (None if cancelled). Equal-length prompts are fed as one batch, ragged ones row by row.
    `prompt_embeds`: the prompts' input embeddings instead of their ids' (images placed in them, see
    k3.multimodal.generate): one [T_i, hidden] tensor per prompt, or a hook `fn(ids [b, t], rows, start) ->
    [b, t, hidden]` called per chunk."""
    dev = model.device
    B = len(prompts)
    if B != cache.batch_size:
        raise RequestError(f"cache holds {cache.batch_size} rows, got {B} prompts")
    groups = [list(range(B))] if len({len(p) for p in prompts}) == 1 else [[i] for i in range(B)]
    last = [None] * B
    for rows in groups:
        view = cache.rows(slice(rows[0], rows[-1] + 1))
        ids = torch.tensor([prompts[i] for i in rows], dtype=torch.long, device=dev)
        for s, e in _chunks(ids.shape[1], chunk_size):
            if _cancelled(cancel):
                return None
            if prompt_embeds is None:
                logits = model(ids[:, s:e], cache=view, logits_to_keep=1).logits
            else:
                emb = _chunk_embeds(prompt_embeds, ids[:, s:e], rows, s)
                logits = model(inputs_embeds=emb, cache=view, logits_to_keep=1).logits
            view.advance(e - s)
        for j, i in enumerate(rows):
            last[i] = logits[j, -1].float()
    return torch.stack(last)


def _decode(tokenizer, ids) -> str:
    """Decode generated ids, skipping specials and ids beyond the tokenizer (a model vocab padded past it)."""
    n = tokenizer.vocab_size
    return tokenizer.decode([i for i in ids if i < n], skip_special=True)


MAX_PENDING_IDS = 8   # ids whose text stays incomplete UTF-8 this long are emitted as U+FFFD (bounded work)


class IncrementalDetokenizer:
    """Text of a growing id sequence, token by token, in O(1) work per token (no re-decoding of the output).

    push(id) returns the new *stable* text: it decodes only a small window (the ids since the last emitted piece,
    with one piece of left context for tokenizers whose text depends on it) and holds back ids whose text ends in
    an incomplete UTF-8 character (U+FFFD) until it completes (or MAX_PENDING_IDS ids pass). Ids that decode to no
    text (special ids, ids beyond the tokenizer's vocabulary) are skipped; a special id ends the run of ordinary
    ids as `tokenizer.decode(ids, skip_special=True)` does. The concatenation of push()/flush() pieces equals that
    full decode for byte-level BPE tokenizers."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.n = tokenizer.vocab_size
        self.is_special = getattr(tokenizer, "is_special", None) or (lambda i: False)
        self.ids: List[int] = []     # window: ids[:read] decoded already (context), ids[read:] pending
        self.read = 0

    def _text(self, ids) -> str:
        return self.tok.decode(ids, skip_special=True) if ids else ""

    def push(self, tok: int) -> str:
        tok = int(tok)
        if not 0 <= tok < self.n:
            return ""
        if self.is_special(tok):
            return self.flush()
        self.ids.append(tok)
        before = self._text(self.ids[:self.read])
        text = self._text(self.ids)
        if text.endswith("\ufffd") and len(self.ids) - self.read < MAX_PENDING_IDS:
            return ""                    # incomplete character: wait for its next bytes
        new = text[len(before):] if text.startswith(before) else text
        self.ids = self.ids[self.read:]  # keep the last piece as left context
        self.read = len(self.ids)
        return new

    def flush(self) -> str:
        """Everything still pending (an incomplete character as U+FFFD); the next id starts a new run."""
        before = self._text(self.ids[:self.read])
        text = self._text(self.ids)
        self.ids, self.read = [], 0
        return text[len(before):] if text.startswith(before) else text


class TextStream:
    """Generated text with stop strings, incrementally: push(id) returns the text that may be sent now.

    A tail that could be the start of a stop string is held back; when a stop string completes, `stopped` is set,
    `cut` is its start in the text and nothing from it on is ever returned. Per token the work is bounded by the
    new text plus the last max(len(stop)) - 1 characters (the only place a stop string can newly complete), never
    the whole output. finish() returns the rest (pending bytes and the held tail, up to a stop string)."""

    def __init__(self, tokenizer, stop_strings=()):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = [s for s in (stop_strings or []) if s]
        self.keep = max((len(s) for s in self.stops), default=1) - 1   # tail chars a stop could start in
        self.tail = ""          # the last `keep` characters of the text
        self.held = ""          # text not yet returned (a possible stop-string start)
        self.length = 0         # characters of text so far
        self.cut = -1
        self.stopped = False

    def _add(self, new: str, final: bool) -> str:
        if self.stopped:
            return ""
        if not new and not final:
            return ""
        if self.stops and new:
            window = self.tail + new
            hits = [h for h in (window.find(s) for s in self.stops) if h >= 0]
            if hits:
                h = min(hits)
                self.cut = self.length - len(self.tail) + h
                self.stopped = True
                emitted = self.length - len(self.held)
                out = (self.held + new)[:self.cut - emitted]
                self.held = ""
                return out
            if self.keep:
                self.tail = window[-self.keep:]
        self.length += len(new)
        pending = self.held + new
        h = 0 if final else _stop_prefix_len(pending, self.stops)
        self.held = pending[len(pending) - h:] if h else ""
        return pending[:len(pending) - h]

    def push(self, tok: int) -> str:
        return self._add(self.detok.push(tok), False)

    def finish(self) -> str:
        return self._add(self.detok.flush(), True)


def _stop_prefix_len(text: str, stops) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string (to hold back). Looks only at
    the last len(stop) - 1 characters of `text`."""
    h = 0
    for s in stops:
        first, n = s[0], len(s) - 1
        i = text.find(first, max(0, len(text) - n))
        while i >= 0:
            if len(text) - i > h and s.startswith(text[i:]):
                h = len(text) - i
                break
            i = text.find(first, i + 1)
    return h


def _stop_streams(tokenizer, stop_strings, B):
    if not stop_strings:
        return None
    if tokenizer is None:
        raise RequestError("stop_strings need a tokenizer")
    return [TextStream(tokenizer, stop_strings) for _ in range(B)]


def _use_static(model, use_cache: bool, static: Optional[bool], cuda_graph: Optional[bool]):
    """(static, cuda_graph) for this call. Default: the static (CUDA-graph) decode step on CUDA when it passes its
    self-check for this model (k3.generation.static.self_check, cached per model), the normal forward elsewhere."""
    if not use_cache:
        if static or cuda_graph:
            raise RequestError("static / cuda_graph decoding needs use_cache=True")
        return False, False
    on_cuda = model.device.type == "cuda"
    if cuda_graph and not on_cuda:
        raise RequestError("cuda_graph=True needs a CUDA model")
    if static is None:
        static = bool(cuda_graph) or (on_cuda and cuda_graph is not False)
        if static and cuda_graph is None:
            from k3.generation.static import self_check
            static = self_check(model)
    if not static:
        if cuda_graph:
            raise RequestError("cuda_graph=True needs static=True (or None)")
        return False, False
    return True, on_cuda if cuda_graph is None else bool(cuda_graph)


def _events(model, prompts, max_new_tokens, use_cache, params: SamplingParams, stop_ids,
            streams: Optional[List["TextStream"]], generator, prefill_chunk_size, cancel, state: dict,
            static: bool = False, cuda_graph: bool = False, logprobs: bool = False,
            prompt_embeds: PromptEmbeds = None) -> Iterator[GenerationEvent]:
    """streams: one TextStream per row (stop strings / text output) or None; after each event
    state["text_delta"][i] holds the text row i may show now. logprobs=True: state["logprobs"][i] collects the
    sampler log-probability of every token of row i (`_select_with_logprobs`)."""
    dev = model.device
    B = len(prompts)
    V = model.config.vocab_size
    gen = [[] for _ in range(B)]
    reasons: List[Optional[str]] = [None] * B
    deltas = [""] * B
    state.update(new_tokens=gen, finish_reasons=reasons, text_cut=[-1] * B, text_delta=deltas, streams=streams)
    lps = [[] for _ in range(B)] if logprobs else None
    if logprobs:
        state["logprobs"] = lps
    if max_new_tokens <= 0:
        state["finish_reasons"][:] = ["length"] * B
        return
    seen = None
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
        for i, p in enumerate(prompts):
            seen[i, torch.tensor(p, device=dev)] = True
    stop_set = set(stop_ids)
    cache = dec = None
    rec = state.get("routing_recorder")     # generate(record_routing=True): the static step's picks go to it
    with torch.inference_mode():
        if use_cache:
            cache = K3Cache.for_model(model, B, max_length=max(len(p) for p in prompts) + max_new_tokens)
            logits = prefill(model, cache, prompts, prefill_chunk_size, cancel, prompt_embeds)
            if static and logits is not None:
                from k3.generation.static import StaticDecoder
                dec = StaticDecoder(model, cache, B, cuda_graph=cuda_graph, record_routing=rec is not None)
        else:
            logits = None if _cancelled(cancel) else _full_logits(model, prompts, list(range(B)), prompt_embeds)
    for step in range(max_new_tokens):
        if logits is None or _cancelled(cancel):
            for i in range(B):
                reasons[i] = reasons[i] or "cancelled"
            return
        with torch.inference_mode():
            if lps is None:
                nxt = select_next(logits, params, seen, generator).tolist()
            else:
                nxt_t, lp_t = _select_with_logprobs(logits, params, seen, generator)
                nxt, step_lp = nxt_t.tolist(), lp_t.tolist()
        toks: List[Optional[int]] = [None] * B
        deltas[:] = [""] * B
        for i in range(B):
            if reasons[i] is not None:
                continue
            t = int(nxt[i])
            gen[i].append(t)
            if lps is not None:
                lps[i].append(step_lp[i])
            toks[i] = t
            if seen is not None:
                seen[i, t] = True
            if streams is not None:
                deltas[i] = streams[i].push(t)
            if t in stop_set:
                reasons[i] = "stop_token"
            elif streams is not None and streams[i].stopped:
                reasons[i] = "stop_string"
                state["text_cut"][i] = streams[i].cut
            elif len(gen[i]) >= max_new_tokens:
                reasons[i] = "length"
        yield GenerationEvent(step, toks, [r is not None for r in reasons])
        if all(r is not None for r in reasons):
            return
        with torch.inference_mode():
            if use_cache:
                feed = torch.tensor([[gen[i][-1]] for i in range(B)], dtype=torch.long, device=dev)
                if dec is not None:   # static buffer: consumed by select_next before the next step
                    logits = dec.step(feed)
                    if rec is not None:
                        rec.add_step(dec.picks)
                else:
                    logits = model(feed, cache=cache, logits_to_keep=1).logits[:, -1].float()
                    cache.advance(1)
            else:
                active = [i for i in range(B) if reasons[i] is None]
                sub = _full_logits(model, [prompts[i] + gen[i] for i in active], active, prompt_embeds)
                logits = torch.zeros(B, sub.shape[-1], device=dev)
                logits[active] = sub


_PROCESSED_SAMPLE = SamplingParams(do_sample=True)     # sampling from already processed logits: nothing to redo
_PROCESSED_GREEDY = SamplingParams(do_sample=False)


def _select_with_logprobs(logits_BV: torch.Tensor, params: SamplingParams, seen_BV, generator):
    """(next ids [B], their sampler log-probs [B] fp32): the processed logits (`process_logits`: penalty,
    temperature, top-k/top-p masks) are computed once; `select_next` on them with neutral parameters re-applies
    nothing (they are sanitized already) and draws exactly what `select_next(logits_BV, params, ...)` draws with
    the same generator, and their log_softmax gives the log-probability of the chosen token under the
    distribution actually sampled: truncated by top-k/top-p and renormalised over the kept tokens. Greedy rows
    (no sampling, or a temperature below MIN_TEMPERATURE) report the log-probability of the argmax under the
    (penalised) logits at temperature 1. A row with no finite probability mass reports NaN."""
    x = process_logits(logits_BV, params, seen_BV)
    nxt = select_next(x, _PROCESSED_GREEDY if params.greedy else _PROCESSED_SAMPLE, None, generator)
    lp = torch.log_softmax(x, dim=-1).gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
    return nxt, lp


def _full_logits(model, seqs, rows, prompt_embeds: PromptEmbeds = None) -> torch.Tensor:
    """No-cache path: a full forward per sequence (no padding), logits of the last position."""
    out = []
    for s, r in zip(seqs, rows):
        ids = torch.tensor([s], dtype=torch.long, device=model.device)
        if prompt_embeds is None:
            out.append(model(ids, logits_to_keep=1).logits[0, -1].float())
            continue
        T = len(prompt_embeds[r]) if not callable(prompt_embeds) else len(s)
        emb = _chunk_embeds(prompt_embeds, ids[:, :T], [r], 0) if T else None
        rest = model.model.embed_tokens(ids[:, T:])
        emb = rest if emb is None else torch.cat([emb.to(rest.dtype), rest], 1)
        out.append(model(inputs_embeds=emb, logits_to_keep=1).logits[0, -1].float())
    return torch.stack(out)


def _setup(model, input_ids, lengths, tokenizer, stop_token_ids, stop_strings, seed, generator, sampling):
    prompts = _as_prompts(input_ids, lengths)
    V = model.config.vocab_size
    for p in prompts:
        if min(p) < 0 or max(p) >= V:
            raise RequestError(f"prompt token ids must be in [0, {V})")
    params = SamplingParams(**sampling)
    params.validate()
    if stop_token_ids is None:
        stop_token_ids = list(tokenizer.stop_ids) if tokenizer is not None else [model.config.eos_token_id]
    elif isinstance(stop_token_ids, int):
        stop_token_ids = [stop_token_ids]
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    stops = [s for s in (stop_strings or []) if s]
    if stops and tokenizer is None:
        raise RequestError("stop_strings need a tokenizer")
    if generator is None and seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(int(seed))
    return prompts, params, list(stop_token_ids), stops, generator


_SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")


def _split_kw(kw):
    sampling = {k: kw.pop(k) for k in _SAMPLING_KEYS if k in kw}
    if kw:
        raise TypeError(f"unexpected generation arguments: {', '.join(sorted(kw))}")
    return sampling


def stream_generate(model, input_ids, max_new_tokens: int = 64, use_cache: bool = True, *, tokenizer=None,
                    stop_token_ids=None, stop_strings=None, seed: Optional[int] = None,
                    generator: Optional[torch.Generator] = None, lengths=None,
                    prefill_chunk_size: Optional[int] = 2048, cancel: Cancel = None, output: str = "ids",
                    static: Optional[bool] = None, cuda_graph: Optional[bool] = None,
                    prompt_embeds: PromptEmbeds = None, _state: Optional[dict] = None, _logprobs: bool = False,
                    **sampling_kw):
    """Yield generated tokens as they are produced.

    output="ids": for one prompt yields each new token id (int); for a batch yields a list with the new id of
    every row (None for rows that already finished). output="text" (needs `tokenizer`, one prompt): yields
    decoded text chunks (held back while a multi-byte character is incomplete; special tokens skipped; a stop
    string and what follows it are not yielded). output="events": GenerationEvent objects.
    Sampling keywords: do_sample, temperature, top_k, top_p, repetition_penalty (see generate).
    static / cuda_graph: decode with k3.generation.static.StaticDecoder (fused, shape-static step; captured as a
    CUDA graph with cuda_graph=True). Default (None): on for CUDA models that pass the static self-check.
    prompt_embeds: the prompts' input embeddings (one [T_i, hidden] tensor per prompt, or a per-chunk hook, see
    `prefill`), fed instead of the ids' embeddings (the ids still drive stop rules and the repetition penalty);
    how k3.multimodal.generate places images."""
    sampling = _split_kw(dict(sampling_kw))
    prompts, params, stop_ids, stops, gen = _setup(model, input_ids, lengths, tokenizer, stop_token_ids,
                                                   stop_strings, seed, generator, sampling)
    _check_prompt_embeds(prompt_embeds, prompts, model.config.hidden_size)
    state = _state if _state is not None else {}
    state["prompts"] = prompts
    static, cuda_graph = _use_static(model, use_cache, static, cuda_graph)
    if output == "text" and (tokenizer is None or len(prompts) != 1):
        raise RequestError("output='text' needs a tokenizer and a single prompt")
    streams = None
    if stops or output == "text":
        streams = [TextStream(tokenizer, stops) for _ in prompts]
    events = _events(model, prompts, int(max_new_tokens), use_cache, params, stop_ids, streams, gen,
                     prefill_chunk_size, cancel, state, static, cuda_graph, _logprobs, prompt_embeds)
    if output == "events":
        yield from events
    elif output == "ids":
        single = len(prompts) == 1
        for ev in events:
            yield ev.tokens[0] if single else ev.tokens
    elif output == "text":
        for _ in events:
            if state["text_delta"][0]:
                yield state["text_delta"][0]
        chunk = streams[0].finish()
        if chunk:
            yield chunk
    else:
        raise RequestError(f"output must be ids/text/events, got {output!r}")


class TextStreamer:
    """Incremental detokenisation of a growing id list (a TextStream fed the ids not seen yet): push(ids) returns
    the text that may be shown now (a possible stop-string start and an incomplete UTF-8 character are held
    back), flush(ids) the rest. `cut` (a stop string's start in the text, or -1) also limits what is returned."""

    def __init__(self, tokenizer, stop_strings=()):
        self.stream = TextStream(tokenizer, stop_strings)
        self.fed = 0
        self.emitted = 0

    def _limit(self, new: str, cut: int) -> str:
        if cut >= 0:
            new = new[:max(0, cut - self.emitted)]
        self.emitted += len(new)
        return new

    def _feed(self, ids) -> str:
        out = "".join(self.stream.push(t) for t in ids[self.fed:])
        self.fed = len(ids)
        return out

    def push(self, ids, cut: int = -1) -> str:
        return self._limit(self._feed(ids), cut)

    def flush(self, ids, cut: int = -1) -> str:
        new = self._feed(ids)
        return self._limit(new + self.stream.finish(), cut)


def generate(model, input_ids, max_new_tokens: int = 64, use_cache: bool = True, *, tokenizer=None,
             stop_token_ids=None, stop_strings=None, seed: Optional[int] = None,
             generator: Optional[torch.Generator] = None, lengths=None, prefill_chunk_size: Optional[int] = 2048,
             cancel: Cancel = None, pad_token_id: Optional[int] = None, return_dict: bool = False,
             static: Optional[bool] = None, cuda_graph: Optional[bool] = None, return_logprobs: bool = False,
             record_routing: bool = False, prompt_embeds: PromptEmbeds = None, speculative: Optional[str] = None,
             **sampling_kw):
    """Generate up to `max_new_tokens` tokens per prompt; returns the prompt + new tokens as a LongTensor
    [B, max length] (right-padded with pad_token_id, default config.pad_token_id), or a GenerationOutput with
    return_dict=True.

    input_ids: LongTensor [B, T] (with `lengths` for right-padded ragged prompts) or [T], or a list of token-id
    lists. Greedy unless do_sample=True; sampling keywords: temperature, top_k (0 = off), top_p (1 = off),
    repetition_penalty (1 = off); seed / generator make sampling reproducible. Stops per row at any of
    stop_token_ids (default: the tokenizer's stop ids, else config.eos_token_id; the stop token is kept) or when
    the decoded text contains one of stop_strings (needs tokenizer). prefill_chunk_size: prompt tokens per
    forward during prefill (None = one shot). cancel: threading.Event or callable checked every step.
    use_cache=False recomputes the full forward every step (reference path). static / cuda_graph: the fused,
    shape-static decode step (k3.generation.static), CUDA-graph captured with cuda_graph=True; default (None): on
    for CUDA models that pass its self-check, off on CPU. prompt_embeds: see stream_generate.

    For RL and other engines (both imply return_dict=True):
    return_logprobs=True: `out.logprobs[i][s]` is the sampler's log-probability of `out.new_tokens[i][s]`, fp32:
    log_softmax of the processed logits it was drawn from (repetition penalty and temperature applied; with
    top-k/top-p, the truncated distribution renormalised over the kept tokens, i.e. what was actually sampled;
    greedy decoding: the argmax under the penalised logits at temperature 1). The processed logits are computed
    once per step; without the flag the step is unchanged.
    record_routing=True: `out.routing[i]` = {router name: LongTensor [prompt + new, k]} of the experts the
    sampler's routers picked per position (k3.rl.routing.GenerateRoutingRecorder; -1 where unknown), or
    `out.routing` None when the calls could not be mapped (a warning says why). Needs use_cache=True; works with
    the module-level decode and with the static / CUDA-graph step (which writes its picks into static buffers).
    speculative="mtp": greedy decoding of one prompt drafted by the model's MTP blocks and verified by the model
    (k3.generation.speculative): the same tokens as greedy decoding; `out.speculative` holds acceptance stats."""
    if speculative is not None:
        from k3.generation.speculative import generate_speculative
        return generate_speculative(model, input_ids, max_new_tokens, speculative, use_cache=use_cache,
                                    tokenizer=tokenizer, stop_token_ids=stop_token_ids, stop_strings=stop_strings,
                                    lengths=lengths, prefill_chunk_size=prefill_chunk_size, cancel=cancel,
                                    pad_token_id=pad_token_id, return_dict=return_dict, static=static,
                                    cuda_graph=cuda_graph, return_logprobs=return_logprobs,
                                    record_routing=record_routing, prompt_embeds=prompt_embeds, seed=seed,
                                    generator=generator, **sampling_kw)
    return_dict = return_dict or return_logprobs or record_routing
    state: dict = {}
    rec = None
    if record_routing:
        if not use_cache:
            raise RequestError("record_routing=True needs use_cache=True (the recording follows the cached "
                               "prefill + decode calls)")
        # resolved here, so that the static step's one-time self-check runs before the router hooks are set
        static, cuda_graph = _use_static(model, use_cache, static, cuda_graph)
        from k3.rl.routing import GenerateRoutingRecorder   # lazy: k3.rl imports k3.generation
        rec = GenerateRoutingRecorder(model)
        state["routing_recorder"] = rec
    with (rec if rec is not None else contextlib.nullcontext()):
        for _ in stream_generate(model, input_ids, max_new_tokens, use_cache, tokenizer=tokenizer,
                                 stop_token_ids=stop_token_ids, stop_strings=stop_strings, seed=seed,
                                 generator=generator, lengths=lengths, prefill_chunk_size=prefill_chunk_size,
                                 cancel=cancel, output="events", static=static, cuda_graph=cuda_graph,
                                 prompt_embeds=prompt_embeds, _state=state, _logprobs=return_logprobs,
                                 **sampling_kw):
            pass
    prompts, new = state["prompts"], state.get("new_tokens", [[] for _ in state["prompts"]])
    reasons = [r or "cancelled" for r in state.get("finish_reasons", ["cancelled"] * len(prompts))]
    pad = model.config.pad_token_id if pad_token_id is None else int(pad_token_id)
    full = [p + n for p, n in zip(prompts, new)]
    L = max(len(s) for s in full)
    seq = torch.full((len(full), L), pad, dtype=torch.long)
    for i, s in enumerate(full):
        seq[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    seq = seq.to(model.device)
    if not return_dict:
        return seq
    texts = None
    if tokenizer is not None:
        texts = []
        for i, n in enumerate(new):
            t = _decode(tokenizer, n)
            cut = state["text_cut"][i]
            texts.append(t[:cut] if cut >= 0 else t)
    out = GenerationOutput(seq, [len(p) for p in prompts], new, reasons, texts)
    if return_logprobs:
        out.logprobs = [list(x) for x in state.get("logprobs", [[] for _ in prompts])]
    if rec is not None:
        out.routing = rec.assign(prompts, new, prefill_chunk_size)
    return out


# ---------------------------------------------------------------------------------------------------- text
def _encode(tokenizer, prompt: str) -> List[int]:
    return tokenizer.encode(prompt)


def generate_text(model, tokenizer, prompt: Union[str, List[str]], max_new_tokens: int = 64, **kw):
    """Text in, generated text out (a str, or a list for a list of prompts)."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    out = generate(model, [_encode(tokenizer, p) for p in prompts], max_new_tokens, tokenizer=tokenizer,
                   return_dict=True, **kw)
    return out.texts[0] if isinstance(prompt, str) else out.texts


def stream_text(model, tokenizer, prompt: str, max_new_tokens: int = 64, **kw) -> Iterator[str]:
    """Text in, text chunks out as they are generated."""
    yield from stream_generate(model, [_encode(tokenizer, prompt)], max_new_tokens, tokenizer=tokenizer,
                               output="text", **kw)


def _chat_ids(tokenizer, messages, thinking: bool, **render_kw) -> List[int]:
    from k3.chat import K3ChatFormat
    return K3ChatFormat(tokenizer).render(messages, thinking=thinking, add_generation_prompt=True, **render_kw)


def stream_chat(model, tokenizer, messages, max_new_tokens: int = 512, thinking: bool = False,
                render_kw: Optional[dict] = None, _state: Optional[dict] = None, **kw) -> Iterator[str]:
    """Render `messages` in the K3 chat format, generate the assistant turn (stops at <|end_of_msg|>) and yield
    its text chunks (structural tags such as <|close|>response<|sep|> are special ids and are skipped)."""
    ids = _chat_ids(tokenizer, messages, thinking, **(render_kw or {}))
    kw.setdefault("stop_token_ids", [tokenizer.eos_id])
    yield from stream_generate(model, [ids], max_new_tokens, tokenizer=tokenizer, output="text", _state=_state,
                               **kw)


def chat(model, tokenizer, messages, max_new_tokens: int = 512, thinking: bool = False,
         render_kw: Optional[dict] = None, **kw) -> dict:
    """One assistant turn: {"ids": generated ids, "text": raw text, "message": parsed assistant message or None,
    "finish_reason": ...}. Generation stops at the end-of-message token."""
    from k3.chat import parse_assistant
    ids = _chat_ids(tokenizer, messages, thinking, **(render_kw or {}))
    kw.setdefault("stop_token_ids", [tokenizer.eos_id])
    out = generate(model, [ids], max_new_tokens, tokenizer=tokenizer, return_dict=True, **kw)
    new = out.new_tokens[0]
    try:
        msg = parse_assistant(new, tokenizer=tokenizer, thinking=thinking)
    except Exception:  # an untrained model need not produce a parsable turn
        msg = None
    return dict(ids=new, text=out.texts[0], message=msg, finish_reason=out.finish_reasons[0])
