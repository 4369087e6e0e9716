"""Static, CUDA-graph-capturable single-token decode step for the whole model (architecture.md §7 decode, fused).

`StaticDecoder(model, cache, batch_size)` runs one decode step (one new token per cache row) with fixed tensor
shapes and fixed addresses, so that on CUDA the step can be captured once with `torch.cuda.CUDAGraph` and replayed
per token; on CPU (or with capture off) the same static code runs eagerly. Same math as the normal cached forward
(`model(ids, cache=cache)`, absorbed MLA + recurrent KDA), with far fewer ops per step. The step itself lives
next to each layer's `forward`: `K3ForCausalLM.prepare_decode` / `decode_step`, which call the `prepare_decode` /
`decode_step` pair of K3DecoderLayer, KDAAttention, MLAAttention, LatentMoE, GLUMLP, RMSNorm and
k3.ops.attnres.attnres_mix_decode; this module holds the buffers, the capture / replay and the self-check:

- fused weights, built once at construction (call `refresh_weights()` after changing the model's weights): per KDA
  layer one matmul for q/k/v/g/f_a/b; per MLA layer one for q_a/kv_a/g; per FFN one for the shared (or dense)
  gate+up (+ the routed latent down-projection); the absorbed MLA weights W_UK / W_UV pre-split per head.
- KDA: the short conv for q/k/v as one [3, B, P, K] multiply-sum, the delta-rule step on the cache's fp32 state in
  place (no stack/unbind, no input validation).
- MLA: the new latent is written at each row's length (a device tensor), and attention runs over the whole
  preallocated window [0, W) with a length mask instead of slicing to the current length; scores read the cached
  [c || k_pe] rows in one batched matmul (q~ and q_pe concatenated). A low-precision cache is not upcast as a
  whole on CUDA: matmuls take the cached dtype with fp32 output (`out_dtype`), else fall back to an upcast.
- MoE for few tokens (N x top_k <= experts): the k selected experts' weights are gathered and run as a bmm (no
  argsort/bincount/grouped GEMM); for larger batches every expert runs on every token (dense bmm), combined with a
  zero-filled [N, E] weight matrix. Both are shape-static.
- AttnRes mixing as one stacked softmax over depth sources.
- no `.item()` / `.tolist()` / Python branching on tensor values: the per-row lengths are kept on the host as
  Python ints (for bookkeeping and bounds checks) and on the device (for the kernels).

Host bookkeeping after each step: the cache's token counts and every MLA layer's host lengths advance by 1 (all
rows advance, as in the normal batched decode); the device lengths are advanced inside the step. The cache stays
usable by the normal forward afterwards (same layout, same lengths). The MLA buffers must not be reallocated
while a captured graph is in use: the decoder reserves its window up front and rebuilds itself (re-captures) if a
buffer address changes.

    dec = StaticDecoder(model, cache, batch_size=B, cuda_graph=True)
    logits = dec.step(next_ids)     # [B, V] fp32, a static buffer overwritten by the next step
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional

import torch

from k3 import knobs
from k3.generation.cache import K3Cache, MLALayerCache
from k3.ops import f32
from k3.nn.mla import bmm_acc, out_dtype_matmul_ok  # noqa: F401 (re-exported)

__all__ = ["StaticDecoder", "self_check", "out_dtype_matmul_ok", "bmm_acc"]


# ---------------------------------------------------------------------------------------------------- decoder
class StaticDecoder:
    """One decode step (one token per row for all `batch_size` rows of `cache`) with static shapes/addresses.

    max_length: MLA attention window W (tokens per row; default: the cache capacity, at least the current
    longest row + 1); the MLA buffers are reserved to W up front. cuda_graph: capture the step with
    torch.cuda.CUDAGraph on CUDA (default: True on CUDA). The first step runs eagerly (warm-up), the second is
    captured and every later one replays the graph. step(ids [B] or [B, 1] LongTensor) -> logits [B, V] fp32
    (a static buffer: read or copy it before the next step).
    compile: run the step through torch.compile (Inductor fuses the element-wise work, norms and mixes between the
    GEMMs: fewer kernels in the captured graph, whose ~2,300 launches are the 6 ms fixed cost per token of `small`
    on an H200). Off by default: the compile costs tens of seconds per decoder and its gain is not measured yet.
    mla_kernel: absorbed MLA attention as "torch" (batched matmuls + masked softmax over the whole window) or
    "triton" (split-K flash-decoding kernel, k3.ops.mla_decode_triton: reads each row's visible latent once;
    falls back to "torch", with a warning, where it cannot run). Default: $K3_MLA_DECODE, else "triton" on CUDA
    (measured on the H200, `small` at 1M context: all-MLA step 9.13 vs 26.65 ms, hybrid 6.94 vs 11.50 ms) and
    "torch" elsewhere.
    record_routing: every step also writes each MoE layer's selected experts into `picks` {router module name:
    LongTensor [B, top_k]} (static buffers, overwritten by the next step: clone them), for routing replay in RL
    (k3.rl.routing); the step is otherwise unchanged."""

    def __init__(self, model, cache: K3Cache, batch_size: Optional[int] = None, max_length: Optional[int] = None,
                 cuda_graph: Optional[bool] = None, compile: bool = False, mla_kernel: Optional[str] = None,
                 record_routing: bool = False):
        B = cache.batch_size if batch_size is None else int(batch_size)
        if B != cache.batch_size:
            raise ValueError(f"StaticDecoder: batch_size {B} != cache batch size {cache.batch_size}")
        self.model, self.cache, self.B = model, cache, B
        self.device, self.dtype = model.device, model.dtype
        if cache.dtype != self.dtype:
            raise ValueError(f"StaticDecoder: cache dtype {cache.dtype} != model dtype {self.dtype}")
        mla = [lc for lc in cache.layers if isinstance(lc, MLALayerCache)]
        self._mla_caches = mla
        if mla and any(lc.lengths != mla[0].lengths for lc in mla):
            raise ValueError("StaticDecoder: MLA layers hold different lengths")
        host = list(mla[0].lengths) if mla else list(cache.lengths)
        self.window = 0
        if mla:
            cap = max(mla[0].capacity, max(host) + 1)
            W = cap if max_length is None else max(int(max_length), max(host) + 1)
            cache.reserve(W)
            self.window = W
        self.cuda_graph = (self.device.type == "cuda") if cuda_graph is None else bool(cuda_graph)
        if self.cuda_graph and self.device.type != "cuda":
            raise ValueError("StaticDecoder: cuda_graph needs a CUDA model")
        self.ids = torch.zeros(B, dtype=torch.long, device=self.device)
        self.lens = torch.tensor(host, dtype=torch.long, device=self.device)   # MLA rows' lengths (device)
        self._host = host
        self.rows = torch.arange(B, device=self.device)
        self.graph = None
        self._steps = 0
        self.compile = bool(compile)
        if mla_kernel is None:
            mla_kernel = knobs.get("K3_MLA_DECODE") or ("triton" if self.device.type == "cuda" else "torch")
        if mla_kernel not in ("torch", "triton"):
            raise ValueError(f"StaticDecoder: mla_kernel {mla_kernel!r} (expected 'torch' or 'triton')")
        self.mla_kernel = mla_kernel
        self.record_routing = bool(record_routing)
        self.refresh_weights()

    # -------------------------------------------------------------- weights
    @torch.no_grad()
    def refresh_weights(self) -> None:
        """(Re)build the fused weights from the model's parameters (after loading/changing weights); drops any
        captured graph."""
        self.state = self.model.prepare_decode(self.cache, self.window, self.lens, self.rows, self.mla_kernel)
        self.picks = self._routing_buffers() if self.record_routing else {}
        self._ptrs = [lc.buf.data_ptr() for lc in self._mla_caches]
        self.graph = None
        self.logits = None
        # a fresh compiled callable per weight set (the fused weights are closed-over constants of the graph)
        self._step_fn = torch.compile(self._forward, dynamic=False) if self.compile else self._forward

    def _routing_buffers(self) -> Dict[str, torch.Tensor]:
        """record_routing: per MoE layer a static LongTensor [B, top_k] the step writes its picks into, keyed by
        the router's module name (as k3.rl.routing names them)."""
        from k3.nn.moe import K3Router, MoEDecodeState
        names = {id(m): n for n, m in self.model.named_modules() if isinstance(m, K3Router)}
        out = {}
        for layer, L in zip(self.model.model.layers, self.state.layers):
            if isinstance(L.ffn, MoEDecodeState):
                g = layer.ffn.gate
                L.ffn.picks = torch.full((self.B, g.top_k), -1, dtype=torch.long, device=self.device)
                out[names[id(g)]] = L.ffn.picks
        return out

    @property
    def mla_kernels(self) -> List[str]:
        """The MLA attention path each MLA layer actually uses ("torch" or "triton", after fallbacks)."""
        return [L.attn.kernel for L in self.state.layers if hasattr(L.attn, "kernel")]

    @property
    def layers(self) -> List[dict]:
        """Per layer {"attn": its attention decode state, "ffn": its FFN decode state} (read-only view of
        `state.layers`; an MLA state's `.kernel` is the path it uses)."""
        return [dict(attn=L.attn, ffn=L.ffn) for L in self.state.layers]

    # -------------------------------------------------------------- the static step
    def _forward(self) -> torch.Tensor:
        logits = self.model.decode_step(self.state, self.ids)
        if self._mla_caches:   # device lengths advance inside the step (one multi-tensor op)
            torch._foreach_add_([self.lens] + [lc.lengths_t for lc in self._mla_caches], 1)
        return logits

    def _run(self) -> None:
        if not self.cuda_graph:
            out = self._step_fn()
            if self.logits is None:
                self.logits = out
            else:
                self.logits.copy_(out)
            return
        if self.logits is None:                                                 # warm-up: a real eager step
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                out = self._step_fn()
            torch.cuda.current_stream(self.device).wait_stream(s)
            self.logits = out.clone()
            return
        if self.graph is None:                                                  # capture records, runs nothing
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = self._step_fn()
                self.logits.copy_(out)
            self.graph = g
        self.graph.replay()

    @torch.inference_mode()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row; returns fp32 logits [B, V] (a static buffer)."""
        if [lc.buf.data_ptr() for lc in self._mla_caches] != self._ptrs:
            raise RuntimeError("StaticDecoder: an MLA buffer was reallocated; build a new StaticDecoder")
        if self.window and max(self._host) + 1 > self.window:
            raise RuntimeError(f"StaticDecoder: window of {self.window} tokens is full")
        self.ids.copy_(ids.reshape(self.B))
        self._run()
        self._steps += 1
        self._host = [n + 1 for n in self._host]
        for lc in self._mla_caches:
            lc.lengths = list(self._host)
        self.cache.advance(1)
        return self.logits


# ---------------------------------------------------------------------------------------------------- self-check
_CHECKED: "weakref.WeakKeyDictionary" = None  # type: ignore[assignment]


def self_check(model, steps: int = 3, tol: Optional[float] = None, cuda_graph: Optional[bool] = None) -> bool:
    """Whether the static step (CUDA-graph captured on CUDA) reproduces the normal cached decode for `model` on a
    scratch 2-row ragged batch over `steps` steps: max |logit diff| <= tol * max(1, max |logit|), tol 1e-4 for
    fp32/fp64 and 5e-2 for bf16/fp16. Any error counts as a failure (a warning says why). Cached per model,
    device and dtype."""
    import warnings
    global _CHECKED
    if _CHECKED is None:
        _CHECKED = weakref.WeakKeyDictionary()
    key = (str(model.device), model.dtype, cuda_graph)
    done = _CHECKED.setdefault(model, {})
    if key in done:
        return done[key]
    if tol is None:
        tol = 1e-4 if model.dtype in (torch.float32, torch.float64) else 5e-2
    ok = False
    try:
        with torch.inference_mode():
            V = model.config.vocab_size
            gen = torch.Generator(device="cpu").manual_seed(0)
            prompts = [torch.randint(0, V, (1, n), generator=gen).to(model.device) for n in (5, 3)]
            caches = [K3Cache.for_model(model, 2, max_length=16) for _ in range(2)]
            for c in caches:
                for i, p in enumerate(prompts):
                    model(p, cache=c.rows(i), logits_to_keep=1)
                    c.rows(i).advance(p.shape[1])
            dec = StaticDecoder(model, caches[1], 2, cuda_graph=cuda_graph)
            tok = torch.randint(0, V, (2, 1), generator=gen).to(model.device)
            ok = True
            for _ in range(steps):
                ref = f32(model(tok, cache=caches[0], logits_to_keep=1).logits[:, -1])
                caches[0].advance(1)
                out = dec.step(tok)
                err = float((ref - out).abs().max())
                scale = max(1.0, float(ref.abs().max()))
                if not err <= tol * scale:
                    warnings.warn(f"StaticDecoder self-check failed: max logit diff {err:.3g} (scale {scale:.3g})")
                    ok = False
                    break
                tok = ref.argmax(-1, keepdim=True)
    except Exception as e:  # noqa: BLE001 - fall back to the normal decode on any failure
        warnings.warn(f"StaticDecoder self-check raised {type(e).__name__}: {e}")
        ok = False
    done[key] = ok
    return ok
