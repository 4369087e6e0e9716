"""What the trainer measures besides the training loss: validation loss on fixed batches, multi-query
associative recall (MQAR) accuracy, and greedy text samples at the end of a run."""
from __future__ import annotations

import logging
import math
import time
from typing import Optional, Sequence

import torch

from k3.errors import K3ConfigError

log = logging.getLogger("k3.train")

__all__ = ["recall_batch", "greedy_generate", "evaluate", "recall", "samples", "non_finite_result",
           "non_finite_eval"]


def recall_batch(vocab_lo: int, vocab_hi: int, n_examples: int, n_pairs: int, seed: int = 1234,
                 n_queries: Optional[int] = None):
    """Multi-query associative recall (MQAR): each row is `k1 v1 k2 v2 ... kn vn  q1 a1 q2 a2 ...` with keys and
    values drawn (without repetition inside a row) from token ids [vocab_lo, vocab_hi); each query is one of the
    row's keys and must be answered with its value. Returns (input_ids [B, T], query_pos [B, Q], answers [B, Q],
    candidates [B, n]) where the model's prediction at `query_pos` should be `answers`. Deterministic in `seed`."""
    n_queries = n_pairs if n_queries is None else n_queries
    g = torch.Generator().manual_seed(seed)
    span = vocab_hi - vocab_lo
    if span < 2 * n_pairs:
        raise K3ConfigError(f"recall task: vocabulary range {span} too small for {n_pairs} pairs")
    rows, qpos, ans, cands = [], [], [], []
    for _ in range(n_examples):
        toks = torch.randperm(span, generator=g)[: 2 * n_pairs] + vocab_lo
        keys, vals = toks[:n_pairs], toks[n_pairs:]
        ctx = torch.stack([keys, vals], 1).reshape(-1)
        which = torch.randperm(n_pairs, generator=g)[:n_queries] if n_queries <= n_pairs else \
            torch.randint(0, n_pairs, (n_queries,), generator=g)
        qa = torch.stack([keys[which], vals[which]], 1).reshape(-1)
        rows.append(torch.cat([ctx, qa]))
        qpos.append(2 * n_pairs + 2 * torch.arange(n_queries))
        ans.append(vals[which])
        cands.append(vals)
    return torch.stack(rows), torch.stack(qpos), torch.stack(ans), torch.stack(cands)


@torch.no_grad()
def greedy_generate(model, ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
    """Plain greedy decoding without a cache (re-runs the whole prefix each token): fine for short samples."""
    out = list(ids)
    dev = model.device
    for _ in range(max_new_tokens):
        x = torch.tensor([out], dtype=torch.long, device=dev)
        logits = model(x, logits_to_keep=1).logits[0, -1]
        nxt = int(torch.argmax(logits.float()))
        out.append(nxt)
        if nxt in stop_ids:
            break
    return out[len(ids):]


@torch.no_grad()
def evaluate(trainer) -> dict:
    """Validation loss on fixed batches + MQAR recall accuracy of `trainer.model`. The RNG state is untouched."""
    model, cfg = trainer.model, trainer.cfg
    was_training = model.training
    model.eval()
    t0 = time.time()
    try:
        seq = cfg.val_seq_len or trainer._stage_seq_len(0)
        rows = max(1, min(cfg.tokens_per_step, cfg.val_tokens) // seq)
        n_batches = max(1, cfg.val_tokens // (rows * seq))
        tot, n, mtp = 0.0, 0, None
        for b in trainer.data.val.batches(seq_len=seq, batch_size=rows, max_batches=n_batches):
            b = trainer._eval_batch(b, seq)
            with trainer._autocast():
                out = model(**b)
            k = int(out.num_tokens)
            # val_loss: the next-token loss (comparable with runs without MTP blocks); MTP depths separately
            tot += float(out.loss if out.main_loss is None else out.main_loss) * k
            if out.mtp_losses is not None:
                mtp = (mtp or 0.0) + float(out.mtp_losses.mean()) * k
            n += k
        sums = trainer._sum_over_ranks([tot, n] + ([] if mtp is None else [mtp]))   # the distributed trainer's hook
        tot, n, mtp = sums[0], int(sums[1]), (sums[2] if mtp is not None else None)
        res = {"val_loss": tot / n if n else float("nan"), "val_tokens": n}
        if mtp is not None:
            res["val_mtp_loss"] = mtp / n if n else float("nan")
        if trainer._recall_enabled():
            res.update(recall(trainer))
    finally:
        model.train(was_training)
    res["eval_time"] = time.time() - t0
    return res


@torch.no_grad()
def recall(trainer) -> dict:
    cfg = trainer.cfg
    if cfg.recall_examples <= 0:
        return {}
    tok = trainer.tokenizer
    lo, hi = 256, min(tok.special_base, trainer.model_config.vocab_size)  # ordinary BPE tokens (no bytes/specials)
    ids, qpos, ans, cands = recall_batch(lo, hi, cfg.recall_examples, cfg.recall_pairs)
    with trainer._autocast():
        logits = trainer.model(ids.to(trainer.device)).logits.float().cpu()
    at = torch.gather(logits, 1, qpos[..., None].expand(-1, -1, logits.shape[-1]))  # [B, Q, V]
    acc = float((at.argmax(-1) == ans).float().mean())
    cand_logits = torch.gather(at, 2, cands[:, None, :].expand(-1, qpos.shape[1], -1))  # [B, Q, n]
    pred = torch.gather(cands[:, None, :].expand_as(cand_logits), 2, cand_logits.argmax(-1, keepdim=True))[..., 0]
    acc_c = float((pred == ans).float().mean())
    return {"recall_acc": acc, "recall_acc_cands": acc_c, "recall_chance": 1.0 / cfg.recall_pairs}


def samples(trainer) -> list[tuple[str, str]]:
    """Greedy continuations of `cfg.sample_prompts` (k3.generation when available, else the plain loop)."""
    tok, model, cfg = trainer.tokenizer, trainer.model, trainer.cfg
    was_training = model.training
    model.eval()
    out = []
    try:
        gen = None
        try:
            from k3.generation import generate as gen  # noqa: F401
        except ImportError:
            gen = None
        for prompt in cfg.sample_prompts:
            ids = tok.encode(prompt, allow_special=False)
            new = None
            if gen is not None:
                try:
                    with trainer._autocast():
                        res = gen(model, [ids], max_new_tokens=cfg.sample_tokens,
                                  stop_token_ids=[tok.eod_id, tok.eos_id])
                    new = [t for t in res[0, len(ids):].tolist() if t != trainer.model_config.pad_token_id]
                except Exception as e:  # API mismatch: fall back to the simple loop
                    log.warning("k3.generation.generate failed (%s); using the plain greedy loop", e)
                    new = None
            if new is None:
                with trainer._autocast():
                    new = greedy_generate(model, ids, cfg.sample_tokens, stop_ids=(tok.eod_id, tok.eos_id))
            out.append((prompt, tok.decode(new, skip_special_tokens=True)))
    finally:
        model.train(was_training)
    return out


def non_finite_result(trainer) -> Optional[str]:
    """Why the run's result must not be published as `final/` (None when the weights and the last validation
    loss are finite)."""
    bad = [n for n, p in trainer.model.named_parameters() if not bool(torch.isfinite(p.detach()).all())]
    if bad:
        n = sum(1 for _ in trainer.model.parameters())
        return f"{len(bad)} of {n} weight tensors hold NaN/inf (e.g. {bad[0]})"
    return non_finite_eval(trainer)


def non_finite_eval(trainer) -> Optional[str]:
    """Why the last validation loss bars `final/` (None: finite, or no evaluation)."""
    v = trainer.eval_history[-1].get("val_loss") if trainer.eval_history else None
    if v is None and trainer.eval_history:
        return "the final validation loss is not a number"
    if isinstance(v, float) and not math.isfinite(v):
        return f"the final validation loss is {v}"
    return None
