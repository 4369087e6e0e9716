"""Trainer callbacks of the claim scripts: measurements (activation norms across depth, max |GLU activation|,
first-token attention mass). The variants themselves are config switches (`linear_attn_config.gate_lower_bound:
null`, `attn_res_mode: none`, `mla_use_output_gate: false`, `hidden_act: swiglu`), run through k3.sweep.

GLUMaxAct wraps the GLU functions of the built model in `on_train_start` (again on a resumed run); a compiled
sub-module keeps the code it traced, so situ.py runs with `--compile none`.
"""
from __future__ import annotations

import math

import torch

from k3.train.trainer import Callback


def _fixed_batch(trainer, seq_len: int, rows: int) -> dict:
    """`rows` validation rows of `seq_len` tokens (the first batch of the fixed validation stream) as the trainer
    feeds them: input_ids [1, rows * seq_len] and cu_seqlens (every document and row start), so attention stays
    inside each document as in training."""
    b = next(iter(trainer.data.val.batches(seq_len=seq_len, batch_size=rows, max_batches=1)))
    return {"input_ids": b["input_ids"].to(trainer.device), "cu_seqlens": b["cu_seqlens"].to(trainer.device)}


def _probe_forward(trainer, model, hooks, seq_len: int, rows: int) -> None:
    """One eval-mode forward of the fixed validation rows with `hooks` registered; removes them and restores the
    model's mode afterwards."""
    was = model.training
    model.eval()
    try:
        with trainer._autocast():
            model(**_fixed_batch(trainer, seq_len, rows))
    finally:
        for h in hooks:
            h.remove()
        model.train(was)


def _is_final_eval(trainer) -> bool:
    return trainer.step >= trainer.cfg.steps


# ----------------------------------------------------------------------------------------------- measurements

class ActivationNorms(Callback):
    """RMS of each layer's input (the AttnRes mix, or the residual stream) and of the final hidden state before
    the last norm, on fixed validation rows, after training: `act_rms_by_layer` [L + 1] (entry 0: the first layer's
    input, i.e. the embedding), `act_rms_max` (the largest past the embedding) and `act_rms_growth` (the final hidden
    state over the second layer's input: growth across depth, leaving out the embedding's own scale)."""

    def __init__(self, seq_len: int = 256, rows: int = 4):
        self.seq_len, self.rows, self.rms = seq_len, rows, None

    @torch.no_grad()
    def on_eval(self, trainer, metrics):
        if not _is_final_eval(trainer):
            return
        from k3.model import K3DecoderLayer
        model = trainer.model
        vals, hooks = [], []

        def pre(mod, args):
            x = args[0].float()
            vals.append(float(x.pow(2).mean().sqrt()))
        for m in model.modules():
            if isinstance(m, K3DecoderLayer):
                hooks.append(m.input_layernorm.register_forward_pre_hook(pre))
        hooks.append(model.model.norm.register_forward_pre_hook(pre))
        _probe_forward(trainer, model, hooks, self.seq_len, self.rows)
        self.rms = vals

    def sweep_metrics(self):
        if not self.rms:
            return {}
        return {"act_rms_by_layer": self.rms, **rms_summary(self.rms)}


def rms_summary(by_layer: list) -> dict:
    """`act_rms_max`, `act_rms_growth` and `act_rms_final` of an `act_rms_by_layer` list (ActivationNorms)."""
    past = by_layer[1:] or by_layer
    return {"act_rms_max": max(past), "act_rms_growth": by_layer[-1] / max(past[0], 1e-12),
            "act_rms_final": by_layer[-1]}


class GLUMaxAct(Callback):
    """max |GLU output| (the input of every FFN down projection: dense FFN, shared and routed experts) over all
    training steps and evaluations: `glu_max_abs` (and its value at the last step, `glu_max_abs_last`)."""

    def __init__(self):
        self.max = None
        self.step_max = None

    def _wrap(self, fn):
        cb = self

        def wrapped(*a, **k):
            out = fn(*a, **k)
            m = out.detach().abs().max().float()
            cb.step_max = m if cb.step_max is None else torch.maximum(cb.step_max, m)
            return out
        return wrapped

    def on_train_start(self, trainer):
        from k3.nn.mlp import GLUMLP
        from k3.nn.moe import LatentMoE
        for m in trainer.model.modules():
            if isinstance(m, GLUMLP):
                m._glu = self._wrap(m._glu)
            elif isinstance(m, LatentMoE):
                m.glu = self._wrap(m.glu)
                m.glu_packed = self._wrap(m.glu_packed)

    def on_step_record(self, trainer, record):  # before the record is logged: the per-step curve of situ.py
        if self.step_max is not None:
            v = float(self.step_max)
            record["glu_max_abs"] = v
            self.last = v
            self.max = v if self.max is None else max(self.max, v)
            self.step_max = None

    def sweep_metrics(self):
        return {"glu_max_abs": self.max, "glu_max_abs_last": getattr(self, "last", None)}


def segment_first_token_mass(q: torch.Tensor, k: torch.Tensor, cu_seqlens, scale: float) -> tuple[float, float]:
    """q, k [B, N, H, D]; cu_seqlens: the segment starts of the flattened B * N tokens and their end (None: each row
    one segment). Within each segment, causal softmax attention of every query on the segment's keys; returns the
    probability each query at segment position t >= 1 puts on the segment's first token, and what uniform causal
    attention would put there (1 / (t + 1)), both averaged over heads and those queries."""
    B, N, H, D = q.shape
    q, k = q.reshape(B * N, H, D).float(), k.reshape(B * N, H, D).float()
    cu = [int(x) for x in cu_seqlens] if cu_seqlens is not None else list(range(0, B * N + 1, N))
    mass = uni = 0.0
    n = 0
    for a, b in zip(cu[:-1], cu[1:]):
        L = b - a
        if L < 2:
            continue
        s = torch.einsum("thd,shd->hts", q[a:b], k[a:b]) * scale
        causal = torch.ones(L, L, dtype=torch.bool, device=s.device).triu(1)
        p = torch.softmax(s.masked_fill(causal, float("-inf")), dim=-1)
        mass += float(p[:, 1:, 0].double().sum()) / H
        uni += sum(1.0 / (t + 1) for t in range(1, L))
        n += L - 1
    return (mass / n, uni / n) if n else (float("nan"), float("nan"))


class FirstTokenMass(Callback):
    """Attention probability mass on the first token of each document (the first key a query can see: training
    keeps attention inside documents), per MLA layer, mean over heads and every query but a document's first, on
    fixed validation rows after training: `first_token_mass` (mean over MLA layers), `first_token_mass_by_layer`,
    `uniform_mass` (what uniform causal attention would give the same queries: mean of 1/(t+1)) and
    `first_token_ratio` (their ratio: 1 = no preference, a sink is far above)."""

    def __init__(self, seq_len: int = 256, rows: int = 4):
        self.seq_len, self.rows, self.mass = seq_len, rows, None

    @torch.no_grad()
    def on_eval(self, trainer, metrics):
        if not _is_final_eval(trainer):
            return
        from k3.nn.mla import MLAAttention
        model = trainer.model
        masses, hooks = [], []

        def pre(mod, args, kwargs):
            x = args[0]
            q = mod.project_q(x)                                           # [B,T,H,D]
            c, k_pe = mod.project_latent(x)
            k, _ = mod.expand_kv(c, k_pe)
            masses.append(segment_first_token_mass(q, k, kwargs.get("cu_seqlens"), mod.softmax_scale))
        for m in model.modules():
            if isinstance(m, MLAAttention):
                hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        _probe_forward(trainer, model, hooks, self.seq_len, self.rows)
        self.mass = masses

    def sweep_metrics(self):
        if not self.mass:
            return {}
        by_layer = [m for m, _ in self.mass]
        mass, uniform = sum(by_layer) / len(by_layer), self.mass[0][1]
        return {"first_token_mass": mass, "first_token_mass_by_layer": by_layer, "uniform_mass": uniform,
                "first_token_ratio": mass / uniform}


def loss_spikes(train_records: list, window: int = 10, ratio: float = 1.15, skip: int = 0) -> int:
    """Steps whose loss exceeds `ratio` x the mean of the previous `window` finite losses (after `skip` steps),
    plus non-finite (skipped) steps."""
    n, hist = 0, []
    for i, r in enumerate(train_records):
        x = r.get("loss")
        if x is None or not math.isfinite(x):
            n += 1
            continue
        if i >= skip and len(hist) >= window and x > ratio * sum(hist[-window:]) / window:
            n += 1
        hist.append(x)
    return n
