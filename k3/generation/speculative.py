"""Self-speculative decoding with the model's MTP blocks (`k3.generate(..., speculative="mtp")`), greedy only.

Each round (batch 1):
1. Draft: the k = num_nextn_predict_layers MTP blocks, chained at the last position: block i reads the previous
   depth's hidden state there and the embedding of the newest token (block 1) or of draft i-1, and proposes
   draft i = argmax of lm_head(shared_head.norm(h_i)). Each block keeps its own MLA latent cache over the
   positions whose inputs are all accepted tokens (`MTPDrafter`); entries built from drafts are cut off again.
2. Verify: ONE forward of the main model over [newest token, draft_1..draft_k] with the cache; its greedy choices
   g_0..g_k accept the longest prefix with draft_j == g_{j-1}, plus the bonus token g_a.
3. Roll back (only when a draft was rejected): the KDA recurrent + conv states are snapshotted before the verify
   forward and restored, the MLA caches are cut back after the accepted tokens (whose latents the verify forward
   wrote), and each KDA layer re-runs its attention on the accepted prefix of its own input, captured during the
   verify forward (the model is causal, so those inputs are exactly what a forward of the accepted tokens alone
   computes). KDA's state after a prefix is
   not recoverable from the state after the longer input, and per-token state snapshots would need the KDA
   kernels to emit them; this costs only the KDA attention of <= k+1 tokens, not a second full forward.

The main model sees exactly the accepted tokens and greedy-selects every emitted token from its own logits at a
position whose inputs are all accepted tokens, so the output is the greedy output (same argmax rule as
`select_next`); the MTP blocks only decide how many tokens one forward confirms. Short verify inputs (k+1 <= 8
tokens) run the same recurrent-KDA / absorbed-MLA paths as one-token decode steps.
"""
from __future__ import annotations

import contextlib
import time
from typing import List, Optional

import torch

from k3.errors import RequestError
from k3.generation.cache import K3Cache, KDALayerCache, MLALayerCache

__all__ = ["MTPDrafter", "speculative_generate", "SPECULATIVE_METHODS"]

SPECULATIVE_METHODS = ("mtp",)


def _truncate_mla(lc: MLALayerCache, n: int) -> None:
    """Forget cached tokens past the first n (row 0; batch 1)."""
    lc.lengths[0] = n
    lc.lengths_t[0] = n


class MTPDrafter:
    """Draft tokens with the MTP blocks of `model`, each block with its own MLA cache (batch 1).

    Bookkeeping (absolute positions, `tokens[N]` the newest token, the main cache holding 0..N-1):
    `hidden[j][t]` = depth-j hidden state at position t computed from accepted tokens only (depth 0: the main
    model's output, added by `add_main`); block i's cache holds positions 0..m[i]-1, all built from accepted
    inputs (block i at t reads token t+i, accepted iff t+i <= N)."""

    def __init__(self, model):
        if model.mtp is None:
            raise RequestError("speculative='mtp' needs MTP blocks (config.num_nextn_predict_layers > 0)")
        c = model.config
        self.model, self.k = model, len(model.mtp)
        self.caches = [MLALayerCache(1, c.kv_lora_rank, c.qk_rope_head_dim, model.dtype, model.device)
                       for _ in range(self.k)]
        self.m = [0] * self.k
        self.hidden: List[dict] = [dict() for _ in range(self.k + 1)]

    def add_main(self, start: int, h_Td: torch.Tensor) -> None:
        for j in range(h_Td.shape[0]):
            self.hidden[0][start + j] = h_Td[j]

    @torch.inference_mode()
    def draft(self, tokens: List[int]) -> List[int]:
        model, N = self.model, len(tokens) - 1
        embed = model.model.embed_tokens
        drafts: List[int] = []
        prev: dict = {}
        for i in range(1, self.k + 1):
            block, cache, m = model.mtp[i - 1], self.caches[i - 1], self.m[i - 1]
            pos = range(m, N)
            known = self.hidden[i - 1]
            hid = torch.stack([known[t] if t in known else prev[t] for t in pos])
            toks = [tokens[t + i] if t + i <= N else drafts[t + i - N - 1] for t in pos]
            ids = torch.tensor([toks], dtype=torch.long, device=model.device)
            out = block(hid.unsqueeze(0), embed(ids), cache=cache)[0]               # [len(pos), d]
            logits = block.logits(model.lm_head, out[-1:]).float()
            drafts.append(int(logits[0].argmax()))
            prev = {t: out[j] for j, t in enumerate(pos)}
            keep = max(N - i + 1, 0)                 # positions 0..N-i read accepted tokens only
            if i < self.k:
                for t in pos:
                    if t < keep:
                        self.hidden[i][t] = prev[t]
            _truncate_mla(cache, keep)
            self.m[i - 1] = keep
            for t in [t for t in known if t < keep]:   # block i reads depth i-1 from position m[i] on
                del known[t]
        return drafts


def _snapshot(cache: K3Cache):
    kda = [(lc.conv.clone(), lc.state.clone()) if isinstance(lc, KDALayerCache) else None for lc in cache.layers]
    return kda


def _restore(cache: K3Cache, snap, n: int) -> None:
    for lc, s in zip(cache.layers, snap):
        if s is not None:
            lc.conv.copy_(s[0])
            lc.state.copy_(s[1])
        else:
            _truncate_mla(lc, n)


@contextlib.contextmanager
def _capture_kda_inputs(model, on: bool):
    """{layer index: input [1, T, d] of its KDA attention} of the forward run inside the block."""
    got: dict = {}
    hooks = []
    if on:
        for i, layer in enumerate(model.model.layers):
            if layer.layer_type == "kda":
                hooks.append(layer.self_attn.register_forward_pre_hook(
                    lambda mod, args, i=i: got.__setitem__(i, args[0])))
    try:
        yield got
    finally:
        for h in hooks:
            h.remove()


@torch.inference_mode()
def speculative_generate(model, prompt: List[int], max_new_tokens: int, stop_ids, method: str = "mtp",
                         prefill_chunk_size: Optional[int] = 2048):
    """Greedy decoding of one prompt with MTP drafts. Returns (new tokens, finish reason, stats) with stats =
    {rounds, drafted, accepted, acceptance_rate, tokens_per_round, rollbacks, forwards, new_tokens, seconds}
    (forwards: main-model forwards, prefill chunks included)."""
    if method not in SPECULATIVE_METHODS:
        raise RequestError(f"speculative must be one of {', '.join(map(repr, SPECULATIVE_METHODS))} or None, "
                           f"got {method!r}")
    drafter = MTPDrafter(model)
    k = drafter.k
    t0 = time.perf_counter()
    dev = model.device
    stop = set(int(s) for s in stop_ids)
    stats = dict(rounds=0, drafted=0, accepted=0, rollbacks=0, forwards=0)
    new: List[int] = []
    if max_new_tokens <= 0:
        return new, "length", _finish(stats, t0)
    cache = K3Cache.for_model(model, 1, max_length=len(prompt) + max_new_tokens + k + 1)
    ids = torch.tensor([prompt], dtype=torch.long, device=dev)
    T = len(prompt)
    c = T if not prefill_chunk_size or prefill_chunk_size <= 0 else int(prefill_chunk_size)
    for s in range(0, T, c):
        e = min(T, s + c)
        out = model(ids[:, s:e], cache=cache, logits_to_keep=1)
        cache.advance(e - s)
        drafter.add_main(s, out.hidden_states[0])
        stats["forwards"] += 1
    tokens = list(prompt)

    def emit(t: int) -> Optional[str]:
        new.append(t)
        tokens.append(t)
        if t in stop:
            return "stop_token"
        if len(new) >= max_new_tokens:
            return "length"
        return None

    reason = emit(int(out.logits[0, -1].float().argmax()))
    while reason is None:
        N = len(tokens) - 1                       # tokens[N]: newest, not yet in the main cache
        budget = max_new_tokens - len(new)        # tokens still allowed; drafts beyond budget-1 are useless
        drafts = drafter.draft(tokens)[:max(budget - 1, 0)]
        feed = [tokens[N]] + drafts
        snap = _snapshot(cache) if drafts else None
        with _capture_kda_inputs(model, bool(drafts)) as kda_in:
            out = model(torch.tensor([feed], dtype=torch.long, device=dev), cache=cache, logits_to_keep=len(feed))
        stats["forwards"] += 1
        g = out.logits[0].float().argmax(-1).tolist()          # g[j]: greedy token after feed[:j+1]
        a = 0
        while a < len(drafts) and drafts[a] == g[a]:
            a += 1
        stats["rounds"] += 1
        stats["drafted"] += len(drafts)
        stats["accepted"] += a
        if a == len(drafts):
            cache.advance(len(feed))
            drafter.add_main(N, out.hidden_states[0])
        else:
            stats["rollbacks"] += 1
            _restore(cache, snap, N + a + 1)           # MLA: keep the accepted tokens' latents (verify wrote them)
            # causal model: every layer's input at the accepted positions is what the verify forward computed,
            # so only the KDA layers re-run (on their captured inputs) to rebuild their state; outputs unused
            for i, x in kda_in.items():
                model.model.layers[i].self_attn(x[:, :a + 1], cache=cache.layers[i])
            cache.advance(a + 1)
            drafter.add_main(N, out.hidden_states[0, :a + 1])
        for t in drafts[:a] + [g[a]]:
            reason = emit(int(t))
            if reason is not None:
                break
    return new, reason, _finish(stats, t0, len(new))


def _finish(stats: dict, t0: float, n_new: int = 0) -> dict:
    stats["seconds"] = time.perf_counter() - t0
    stats["acceptance_rate"] = stats["accepted"] / stats["drafted"] if stats["drafted"] else 0.0
    stats["tokens_per_round"] = (n_new - 1) / stats["rounds"] if stats["rounds"] else 0.0
    stats["new_tokens"] = n_new
    return stats


def generate_speculative(model, input_ids, max_new_tokens: int, method: str, *, use_cache: bool = True,
                         tokenizer=None, stop_token_ids=None, stop_strings=None, lengths=None,
                         prefill_chunk_size: Optional[int] = 2048, cancel=None, pad_token_id: Optional[int] = None,
                         return_dict: bool = False, static: Optional[bool] = None, cuda_graph: Optional[bool] = None,
                         return_logprobs: bool = False, record_routing: bool = False, prompt_embeds=None,
                         seed=None, generator=None, **sampling_kw):
    """`k3.generate(..., speculative=method)`: the same return value as greedy `generate` (a LongTensor, or a
    GenerationOutput with `.speculative` = the stats of `speculative_generate`). One prompt, greedy, ids only."""
    from k3.generation.generate import GenerationOutput, _decode, _setup, _split_kw
    if method not in SPECULATIVE_METHODS:
        raise RequestError(f"speculative must be one of {', '.join(map(repr, SPECULATIVE_METHODS))} or None, "
                           f"got {method!r}")
    sampling = _split_kw(dict(sampling_kw))
    prompts, params, stop_ids, stops, _ = _setup(model, input_ids, lengths, tokenizer, stop_token_ids,
                                                 stop_strings, None, None, sampling)
    why = []
    if len(prompts) != 1:
        why.append(f"one prompt (batch 1), got {len(prompts)}")
    if not params.greedy or params.repetition_penalty != 1.0:
        why.append("greedy decoding (do_sample=False, no repetition_penalty): drafts are verified by exact argmax")
    if not use_cache:
        why.append("use_cache=True")
    if static or cuda_graph:
        why.append("static=False / cuda_graph=False (the module forward verifies several tokens at once)")
    if return_logprobs or record_routing:
        why.append("return_logprobs=False and record_routing=False")
    if prompt_embeds is not None:
        why.append("token-id prompts (no prompt_embeds)")
    if stops:
        why.append("no stop_strings (stop_token_ids work)")
    if cancel is not None:
        why.append("no cancel")
    if why:
        raise RequestError(f"speculative={method!r} needs " + "; ".join(why))
    new, reason, stats = speculative_generate(model, prompts[0], int(max_new_tokens), stop_ids, method,
                                              prefill_chunk_size)
    seq = torch.tensor([prompts[0] + new], dtype=torch.long).to(model.device)
    if not return_dict:
        return seq
    texts = [_decode(tokenizer, new)] if tokenizer is not None else None
    out = GenerationOutput(seq, [len(prompts[0])], [new], [reason], texts)
    out.speculative = stats
    return out
