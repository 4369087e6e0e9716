"""Continuous batching for `k3 serve`: one scheduler thread owns the model and a K3Cache with `max_batch` rows.

Each request gets a cache row (a *slot*). Every scheduler iteration
  1. drops cancelled requests (client gone) and frees their slots,
  2. admits queued requests into free slots (the lowest free row first, which keeps active rows contiguous),
  3. prefills waiting prompts, at most `prefill_chunk` prompt tokens per iteration in total (so a long prompt
     never stalls the running streams for more than one chunk), sampling the first token of a prompt as soon as
     its prefill completes; the chunks of several waiting prompts go through ONE packed forward (batch 1 +
     cu_seqlens over `K3Cache.packed(rows)`): each prompt's KDA state / conv history start from and are written
     back to its own row (reset at document boundaries, so they never see another prompt or padding) and its
     MLA queries see only its own row's latents,
  4. decodes one token for every slot that has one pending, all of them in one forward per contiguous run of
     rows (rows still prefilling split a run; free rows inside a run are reset and fed a dummy token).
Sampling is per request (own SamplingParams, own torch.Generator seeded from the request seed), so a request's
output does not depend on what else is running: greedy and seeded requests give what `k3.generate` gives for the
same prompt alone (up to batch-size dependent floating point rounding).

Events go to each request's `sink` (called on the scheduler thread): ("text", delta), then ("done",
finish_reason, prompt_tokens, completion_tokens) with finish_reason "stop" | "length" | "cancelled", or
("error", message). Text is detokenised incrementally (k3.generation.generate.TextStream: O(1) text work per
token, an incomplete UTF-8 character and a tail that may start a stop string are held back; stop strings and what
follows are never sent).

Failures stay where they happen: an error while admitting, sampling or detokenising one request fails that
request alone (a generic ("error", ...) event; the detail goes to the log), a failed forward fails only the
requests in it. If the loop itself cannot continue (MAX_STEP_FAILURES failed steps in a row, or an error outside
any request), every waiting and running request gets an error at once, `alive` turns False, `fatal` holds the
reason and `on_fatal(reason)` is called (the server exits non-zero so that a supervisor restarts it).
"""
from __future__ import annotations

import collections
import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional

import torch

from k3.generation.cache import K3Cache
from k3.generation.generate import TextStream
from k3.generation.sampling import SamplingParams, select_next

__all__ = ["GenRequest", "Scheduler", "QueueFull", "INTERNAL_ERROR", "MAX_STEP_FAILURES"]

log = logging.getLogger("k3.serve")

INTERNAL_ERROR = "internal error while generating this request (details are in the server log)"
MAX_STEP_FAILURES = 3        # failed scheduler steps in a row before the loop gives up (fatal)


class QueueFull(Exception):
    """Every slot is busy and the wait queue is full."""


@dataclass
class GenRequest:
    prompt: List[int]
    max_tokens: int
    sink: Callable[[tuple], None]
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: Optional[int] = None
    stop_ids: frozenset = frozenset()
    stop_strings: List[str] = field(default_factory=list)
    text_ends_at_special: bool = False   # chat: the reply text ends at the first special token (<|close|> ...)
    embeds: Optional[torch.Tensor] = None  # [len(prompt), hidden] prompt embeddings (images placed), else None
    cancel: threading.Event = field(default_factory=threading.Event)
    id: str = ""
    # ---- scheduler state
    slot: int = -1
    state: str = "queued"                # queued | prefill | decode | done
    pos: int = 0                         # prompt tokens prefilled
    generated: List[int] = field(default_factory=list)
    text: Optional[TextStream] = None    # incremental text + stop strings (made at admission)
    text_closed: bool = False
    finish: Optional[str] = None
    t_submit: float = 0.0
    t_first: Optional[float] = None
    _order: int = 0
    _gen: Optional[torch.Generator] = None
    _seen: Optional[torch.Tensor] = None


class Scheduler:
    def __init__(self, model, tokenizer, max_batch: int = 8, max_queue: int = 64, max_context: int = 4096,
                 prefill_chunk: int = 512, pack_prefill: bool = True,
                 on_fatal: Optional[Callable[[str], None]] = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.model, self.tok = model, tokenizer
        self.max_batch, self.max_queue, self.max_context = int(max_batch), int(max_queue), int(max_context)
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.pack_prefill = bool(pack_prefill)   # several waiting prompts' prefill in one packed forward
        self.device = model.device
        self.vocab = model.config.vocab_size
        self.cache = K3Cache.for_model(model, self.max_batch, max_length=self.max_context + 1)
        self.slots: List[Optional[GenRequest]] = [None] * self.max_batch
        self.pending: Deque[GenRequest] = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self._paused = False
        self._thread: Optional[threading.Thread] = None
        self._order = itertools.count()
        self.on_fatal = on_fatal
        self.fatal: Optional[str] = None       # why the loop stopped for good (None while healthy)
        self._failures = 0                      # failed steps in a row
        self.stats = dict(requests=0, completed=0, cancelled=0, rejected=0, errors=0, prompt_tokens=0,
                          generated_tokens=0, decode_steps=0, peak_active=0,
                          prefill_forwards=0, packed_prefills=0)

    # ------------------------------------------------------------------ public (any thread)
    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="k3-serve-scheduler", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _busy_error(self) -> Optional[str]:  # under the lock
        waiting = sum(not r.cancel.is_set() for r in self.pending)    # a cancelled one leaves at the next step
        busy = sum(s is not None for s in self.slots) + waiting
        if busy >= self.max_batch + self.max_queue:
            return (f"server busy: {self.max_batch} streams running and {len(self.pending)} queued "
                    f"(max_queue {self.max_queue})")
        return None

    def check_room(self) -> None:
        """Raise QueueFull now if a request submitted now would be refused (cheap: checked before tokenising)."""
        with self._cv:
            msg = self._busy_error()
            if msg:
                self.stats["rejected"] += 1
                raise QueueFull(msg)

    def submit(self, req: GenRequest) -> None:
        """Queue a request; raises QueueFull when max_batch + max_queue requests are already in the server,
        RuntimeError when the scheduler has stopped for good."""
        with self._cv:
            if self.fatal is not None or self._stop:
                raise RuntimeError("the generation scheduler is not running")
            msg = self._busy_error()
            if msg:
                self.stats["rejected"] += 1
                raise QueueFull(msg)
            req.t_submit = time.perf_counter()
            req.state = "queued"
            self.pending.append(req)
            self.stats["requests"] += 1
            self._cv.notify_all()

    def pause(self) -> None:
        """Stop admitting and stepping after the current step (requests still queue); resume() continues."""
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def snapshot(self) -> dict:
        with self._cv:
            active = sum(s is not None for s in self.slots)
            return dict(active=active, queued=len(self.pending), paused=self._paused, max_batch=self.max_batch,
                        max_queue=self.max_queue, scheduler_alive=self.alive and self.fatal is None,
                        fatal=self.fatal, **self.stats)

    # ------------------------------------------------------------------ scheduler thread
    def _run(self) -> None:
        reason = "server shutting down"
        try:
            with torch.inference_mode():
                while self._iteration():
                    pass
        except BaseException as e:  # noqa: BLE001 - the loop cannot continue: nobody may be left waiting
            log.exception("the generation scheduler stopped")
            reason = "the generation scheduler stopped"
            with self._cv:
                self.fatal = f"{type(e).__name__}: {e}"[:500]
        finally:
            with self._cv:
                for r in list(self.pending) + [s for s in self.slots if s is not None]:
                    if r.state != "done":
                        self._emit(r, ("error", reason))
                        r.state = "done"
                self.pending.clear()
                self.slots = [None] * self.max_batch
        if self.fatal is not None and self.on_fatal is not None:
            try:
                self.on_fatal(self.fatal)
            except Exception:
                log.exception("on_fatal callback failed")

    def _iteration(self) -> bool:
        """One admit + step; False when stopping. A failed step fails the requests in it; MAX_STEP_FAILURES in a
        row raise (the loop is broken, not a request)."""
        with self._cv:
            while not self._stop and (self._paused or (not self.pending and all(s is None for s in self.slots))):
                self._cv.wait(0.5)
            if self._stop:
                return False
            self._admit()
        try:
            self._step()
            self._failures = 0
        except Exception as e:
            self._failures += 1
            log.exception("scheduler step failed (%d in a row)", self._failures)
            self._fail_all()
            if self._failures >= MAX_STEP_FAILURES:
                raise RuntimeError(f"{self._failures} scheduler steps failed in a row; last: "
                                   f"{type(e).__name__}: {e}") from e
        return True

    def _admit(self) -> None:  # under the lock
        if any(r.cancel.is_set() for r in self.pending):   # a queued request whose client left
            for r in [r for r in self.pending if r.cancel.is_set()]:
                self.pending.remove(r)
                self._finish(r, "cancelled")
        while self.pending:
            free = [i for i, s in enumerate(self.slots) if s is None]
            if not free:
                return
            r = self.pending.popleft()
            if r.cancel.is_set():
                self._finish(r, "cancelled")
                continue
            try:
                self._admit_one(r, free[0])
            except Exception:
                log.exception("admitting request %s failed", r.id)
                self._fail(r)

    def _admit_one(self, r: GenRequest, i: int) -> None:  # under the lock
        self.cache.rows(i).reset()
        r.slot, r.state, r.pos = i, "prefill", 0
        r._order = next(self._order)
        r.text = TextStream(self.tok, r.stop_strings)
        if r.params.do_sample:
            seed = r.seed if r.seed is not None else secrets.randbits(63)
            r._gen = torch.Generator(device=self.device).manual_seed(int(seed))
        if r.params.repetition_penalty != 1.0:
            r._seen = torch.zeros(1, self.vocab, dtype=torch.bool, device=self.device)
            r._seen[0, torch.tensor(r.prompt, device=self.device)] = True
        self.slots[i] = r
        self.stats["prompt_tokens"] += len(r.prompt)
        self.stats["peak_active"] = max(self.stats["peak_active"], sum(s is not None for s in self.slots))

    def _free(self, r: GenRequest) -> None:
        with self._cv:
            if 0 <= r.slot < self.max_batch and self.slots[r.slot] is r:
                self.slots[r.slot] = None
            r.state = "done"

    def _fail(self, r: GenRequest, msg: str = INTERNAL_ERROR) -> None:
        """Fail one request (a generic message: the detail is logged by the caller); frees its slot."""
        if r.state == "done":
            return
        self.stats["errors"] += 1
        self._emit(r, ("error", msg))
        self._free(r)

    def _fail_all(self, rows=None) -> None:
        for r in [s for s in (self.slots if rows is None else rows) if s is not None]:
            self._fail(r)

    def _emit(self, r: GenRequest, ev: tuple) -> None:
        try:
            r.sink(ev)
        except Exception:  # a sink whose event loop is gone: the request is orphaned
            r.cancel.set()

    def _finish(self, r: GenRequest, reason: str) -> None:
        r.finish = reason
        if reason == "cancelled":
            self.stats["cancelled"] += 1
        else:
            self.stats["completed"] += 1
        self._emit(r, ("done", reason, len(r.prompt), len(r.generated)))
        self._free(r)

    def _step(self) -> None:
        model, cache = self.model, self.cache
        for r in [s for s in self.slots if s is not None]:
            if r.cancel.is_set():
                self._finish(r, "cancelled")
        # ---- prefill (bounded work per iteration), oldest admission first, all of it in one forward
        budget, batch = self.prefill_chunk, []
        for r in sorted((s for s in self.slots if s is not None and s.state == "prefill"), key=lambda s: s._order):
            if budget <= 0:
                break
            n = min(budget, len(r.prompt) - r.pos)
            batch.append((r, n))
            budget -= n
        if batch:
            try:
                self._prefill(batch)
            except Exception:       # the forward of these prompts failed: fail them, the others go on
                log.exception("prefill of %s failed", [r.id for r, _ in batch])
                self._fail_all([r for r, _ in batch])
        # ---- one decode step for every slot with a pending token
        for lo, hi in self._runs():
            rows = self.slots[lo:hi + 1]
            feed = []
            for j, r in enumerate(rows):
                if r is not None and r.state == "decode":
                    feed.append(r.generated[-1])
                else:                                    # a free row inside the run: reset, feed a dummy
                    cache.rows(lo + j).reset()
                    feed.append(0)
            view = cache.rows(slice(lo, hi + 1))
            ids = torch.tensor(feed, dtype=torch.long, device=self.device).unsqueeze(1)
            try:
                logits = model(ids, cache=view, logits_to_keep=1).logits[:, -1].float()
            except Exception:       # this run's forward failed: fail its requests, other runs go on
                log.exception("decode step of rows %d..%d failed", lo, hi)
                self._fail_all(rows)
                continue
            view.advance(1)
            self.stats["decode_steps"] += 1
            greedy = logits.argmax(-1).tolist()
            for j, r in enumerate(rows):
                if r is None or r.state != "decode":
                    continue
                if r.params.do_sample or r.params.repetition_penalty != 1.0 or not 0 <= greedy[j] < self.vocab:
                    self._guarded(r, lambda r=r, j=j: self._accept(r, self._pick(r, logits[j:j + 1])))
                else:
                    self._guarded(r, lambda r=r, j=j: self._accept(r, int(greedy[j])))

    def _prefill(self, batch) -> None:
        """Prefill the next n prompt tokens of each (request, n) in ONE forward: a single prompt as a [1, n] row
        forward on its cache row; several as one packed [1, sum n] forward with cu_seqlens (cache.packed), where
        each document starts from / writes back its own row's KDA state and conv history (reset at document
        boundaries, never seeing another prompt or padding) and attends only to its own row's MLA latents."""
        model, cache = self.model, self.cache
        if len(batch) == 1 or not self.pack_prefill or any(r.embeds is not None for r, _ in batch):
            logits = []   # one forward per prompt (always so for prompts with images: their embeddings)
            for r, n in batch:
                view = cache.rows(r.slot)
                if r.embeds is not None:
                    emb = r.embeds[r.pos:r.pos + n].unsqueeze(0).to(self.device)
                    out = model(inputs_embeds=emb, cache=view, logits_to_keep=1)
                else:
                    ids = torch.tensor([r.prompt[r.pos:r.pos + n]], dtype=torch.long, device=self.device)
                    out = model(ids, cache=view, logits_to_keep=1)
                logits.append(out.logits[:, -1].float())
                view.advance(n)
                self.stats["prefill_forwards"] += 1
            logits = torch.cat(logits, 0)
        else:
            toks, cu = [], [0]
            for r, n in batch:
                toks.extend(r.prompt[r.pos:r.pos + n])
                cu.append(cu[-1] + n)
            ids = torch.tensor([toks], dtype=torch.long, device=self.device)
            cu_t = torch.tensor(cu, dtype=torch.long, device=self.device)
            view = cache.packed([r.slot for r, _ in batch])
            h = model(ids, cu_seqlens=cu_t, cache=view, return_logits=False).hidden_states      # [1, T, d]
            logits = model.lm_head(h[0, cu_t[1:] - 1]).float()                                    # [N, V]
            view.advance([n for _, n in batch])
            self.stats["prefill_forwards"] += 1
            self.stats["packed_prefills"] += 1
        for j, (r, n) in enumerate(batch):
            r.pos += n
            if r.pos == len(r.prompt):
                r.state = "decode"
                r.embeds = None
                r.t_first = time.perf_counter()
                self._guarded(r, lambda r=r, j=j: self._accept(r, self._pick(r, logits[j:j + 1])))

    def _runs(self):
        """Contiguous row ranges to decode together: rows that decode, bridging free rows, split at rows that
        are still prefilling (their state must not move)."""
        runs, start, last = [], None, None
        for i, r in enumerate(self.slots + [None]):
            if i < self.max_batch and r is not None and r.state == "prefill":
                if start is not None:
                    runs.append((start, last))
                start = last = None
                continue
            if i < self.max_batch and r is not None and r.state == "decode":
                if start is None:
                    start = i
                last = i
        if start is not None:
            runs.append((start, last))
        return runs

    def _pick(self, r: GenRequest, logits_1V: torch.Tensor) -> int:
        return int(select_next(logits_1V, r.params, r._seen, r._gen)[0])

    def _guarded(self, r: GenRequest, fn) -> None:
        """Run one request's sampling / text work; an error fails that request alone."""
        try:
            fn()
        except Exception:
            log.exception("request %s failed while generating", r.id)
            self._fail(r)

    # ------------------------------------------------------------------ tokens -> text events
    def _accept(self, r: GenRequest, tok: int) -> None:
        if not 0 <= tok < self.vocab:
            raise ValueError(f"sampled token id {tok} is outside the vocabulary [0, {self.vocab})")
        r.generated.append(tok)
        self.stats["generated_tokens"] += 1
        if r._seen is not None:
            r._seen[0, tok] = True
        finish, delta = None, ""
        if tok in r.stop_ids:
            finish = "stop"
        elif not r.text_closed:
            if r.text_ends_at_special and tok < self.tok.vocab_size and self.tok.is_special(tok):
                r.text_closed = True              # chat: the reply ends here; nothing after it is text
                delta = r.text.finish()
            else:
                delta = r.text.push(tok)
                if r.text.stopped:
                    finish = "stop"
        if finish is None and len(r.generated) >= r.max_tokens:
            finish = "length"
        if finish is not None and not r.text_closed:
            delta += r.text.finish()
        if delta:
            self._emit(r, ("text", delta))
        if finish is not None:
            self._finish(r, finish)
