"""Released checkpoint -> k3 state dict: `ReleasedAssembler` takes released tensors one at a time (per-expert
w1/w2/w3, MXFP4 blocks, padded A_log, prefixes) and builds the in-memory layout (stacked experts); `from_released`
runs it over a whole mapping. The key tables and the reverse direction live in `k3.checkpoint.adapter`."""
from __future__ import annotations

import logging
import re
from typing import Mapping, Optional

import torch

from k3.checkpoint.adapter import (_A_LOG_RE, _EXPERT_RE, _PACKED_RE, _STACKED_RE, IGNORED_PREFIXES, PREFIX, _strip,
                                   format_key_report, is_fp32_key, model_key_shapes, torch_dtype)
from k3.checkpoint.mxfp4 import mxfp4_decode, mxfp4_encode
from k3.errors import CheckpointError

log = logging.getLogger("k3.checkpoint")

class ReleasedAssembler:
    """Streams released tensors into in-memory tensors.

    ``targets``: ``{model_key: tensor}`` to copy into (e.g. a live model's ``state_dict()``); keys absent from it
    are *unexpected*. With ``targets=None`` the assembler builds a fresh state dict (direct tensors are kept as-is
    after the dtype cast; stacked experts are allocated from the config) and nothing is unexpected except keys
    that match no naming rule.

    Call :meth:`add` for every tensor, then :meth:`finish` (returns the state dict, raises CheckpointError on
    problems when ``strict``).
    """

    def __init__(self, config, targets: Optional[dict] = None, dtype=None, strict: bool = True,
                 expected: Optional[dict] = None, experts: Optional[tuple] = None):
        self.config = config
        # routed experts kept (start, stop): expert e lands at index e - start of the stacked tensors; experts
        # outside the range are skipped (an expert-parallel rank loads its own slice)
        self.expert_range = tuple(experts) if experts is not None else None
        self.targets = targets
        self.dtype = torch_dtype(dtype) if dtype is not None else None
        self.strict = strict
        self.expected = expected  # {model_key: (shape, dtype)} for shape checks in fresh mode
        self.out: dict = {} if targets is None else targets
        self.filled: set = set()
        self.expert_filled: dict = {}   # stacked model key -> set of (e, w)
        self.pending: dict = {}         # (base, e, w) -> {"weight_packed": t} waiting for its partner
        self.ignored: dict = {}
        self.unexpected: list = []
        self.misshaped: list = []
        self.bad: set = set()            # model keys / (stacked key, e, w) reported as mis-shaped
        self.errors: list = []
        self.sources: dict = {}         # released key -> source (file) for messages
        self._seen: set = set()

    # -- helpers
    def _float_dtype(self, key: str, src: torch.Tensor) -> torch.dtype:
        if is_fp32_key(key):
            return torch.float32
        if self.targets is not None and key in self.targets:
            return self.targets[key].dtype
        if self.dtype is not None:
            return self.dtype
        return src.dtype if src.is_floating_point() else torch_dtype(self.config.dtype)

    def _where(self, rkey: str) -> str:
        src = self.sources.get(rkey)
        return f" (in {src})" if src else ""

    def _stacked_target(self, skey: str, which: str) -> Optional[torch.Tensor]:
        if skey in self.out:
            return self.out[skey]
        if self.targets is not None:
            return None
        E, l, M = self.config.num_experts, self.config.routed_expert_hidden_size, self.config.moe_intermediate_size
        if self.expert_range is not None:
            E = self.expert_range[1] - self.expert_range[0]
        shape = (E, l, 2 * M) if which == "gate_up_proj" else (E, M, l)
        dt = self.dtype if self.dtype is not None else torch_dtype(self.config.dtype)
        t = torch.zeros(shape, dtype=dt)
        self.out[skey] = t
        return t

    # -- main entry
    def add(self, key: str, tensor: torch.Tensor, source: Optional[str] = None) -> None:
        if source:
            self.sources[key] = source
        if key in self._seen:
            self.errors.append(f"duplicate tensor {key}{self._where(key)}")
            return
        self._seen.add(key)
        if key.startswith(IGNORED_PREFIXES):
            self.ignored[key] = tensor
            return
        k = _strip(key, PREFIX)
        m = _EXPERT_RE.match(k)
        if m:
            self._add_expert(key, m, tensor)
            return
        if _A_LOG_RE.search(k) and tensor.dim() == 1:
            H = self._a_log_heads(k)
            if H is not None and tensor.shape[0] > H:
                tail = tensor[H:]
                if bool((tail != 0).any()):
                    self.errors.append(f"{key}{self._where(key)}: A_log has {tensor.shape[0]} entries, the model uses "
                                       f"{H}; padding entries {H}..{tensor.shape[0] - 1} must be zero, got "
                                       f"{tail.float().abs().max().item():.4g} max |value|")
                    return
                tensor = tensor[:H]
        self._add_direct(key, k, tensor)

    def _a_log_heads(self, k: str) -> Optional[int]:
        if self.targets is not None:
            t = self.targets.get(k)
            return t.shape[0] if t is not None and t.dim() == 1 else None
        return self.config.lac.num_heads

    def _add_direct(self, key: str, k: str, tensor: torch.Tensor) -> None:
        if self.targets is not None:
            tgt = self.targets.get(k)
            if tgt is None:
                self.unexpected.append(key)
                return
            if tuple(tgt.shape) != tuple(tensor.shape):
                self.misshaped.append(f"{key}{self._where(key)}: checkpoint {tuple(tensor.shape)} vs model "
                                      f"{tuple(tgt.shape)}")
                self.bad.add(k)
                return
            with torch.no_grad():
                tgt.copy_(tensor)
            self.filled.add(k)
            return
        if self.expected is not None:
            exp = self.expected.get(k)
            if exp is None:
                self.unexpected.append(key)
                return
            if tuple(exp[0]) != tuple(tensor.shape):
                self.misshaped.append(f"{key}{self._where(key)}: checkpoint {tuple(tensor.shape)} vs expected "
                                      f"{tuple(exp[0])}")
                self.bad.add(k)
                return
        dt = self._float_dtype(k, tensor) if tensor.is_floating_point() else tensor.dtype
        self.out[k] = tensor.to(dt)
        self.filled.add(k)

    def _add_expert(self, key: str, m: re.Match, tensor: torch.Tensor) -> None:
        base, e, w, kind = m.group("base"), int(m.group("e")), m.group("w"), m.group("kind")
        if self.expert_range is not None:
            if not (self.expert_range[0] <= e < self.expert_range[1]):
                return  # another rank's expert
            e -= self.expert_range[0]
        which = "down" if w == "w2" else "gate_up"
        if self.targets is not None and f"{base}.{which}_packed" in self.targets:
            self._add_packed_expert(key, base, e, w, kind, tensor)
            return
        if kind != "weight":
            pair = self._mxfp4_pair(base, e, w, kind, key, tensor)
            if pair is None:
                return
            (pkey, packed), (skey_, scale) = pair
            try:
                tensor = mxfp4_decode(packed, scale, dtype=torch.float32)
            except ValueError as ex:
                self.misshaped.append(f"{pkey}{self._where(pkey)} / {skey_}: cannot MXFP4-decode: {ex}")
                self.bad.add((f"{base}.{'down_proj' if w == 'w2' else 'gate_up_proj'}", e, w))
                return
            key = pkey
        self._place_expert(key, base, e, w, tensor)

    def _mxfp4_pair(self, base: str, e: int, w: str, kind: str, key: str, tensor: torch.Tensor):
        """Keep one half of expert `e`'s MXFP4 `w` (kind weight_packed / weight_scale) until the other arrives;
        then ((key, packed), (key, scale)), else None."""
        slot = self.pending.setdefault((base, e, w), {})
        slot[kind] = (key, tensor)
        if len(slot) < 2:
            return None
        del self.pending[(base, e, w)]
        return slot["weight_packed"], slot["weight_scale"]

    def _add_packed_expert(self, key: str, base: str, e: int, w: str, kind: str, tensor: torch.Tensor) -> None:
        """Into a model with PackedMXFP4Experts: MXFP4 pairs are copied as bytes (no decode); a dense expert
        weight is MXFP4-encoded (lossy unless it lies on the grid)."""
        if kind == "weight":
            try:
                packed, scale = mxfp4_encode(tensor)
            except ValueError as ex:
                self.misshaped.append(f"{key}{self._where(key)}: cannot MXFP4-encode for packed experts: {ex}")
                return
            if not getattr(self, "_warned_encode", False):
                log.info("packed experts: MXFP4-encoding dense expert weights of the checkpoint (%s, ...)", key)
                self._warned_encode = True
        else:
            pair = self._mxfp4_pair(base, e, w, kind, key, tensor)
            if pair is None:
                return
            (key, packed), (_, scale) = pair
        which = "down" if w == "w2" else "gate_up"
        tp, ts = self.targets[f"{base}.{which}_packed"], self.targets.get(f"{base}.{which}_scale")
        skey = f"{base}.{which}_proj"
        E, rows, _ = tp.shape
        if not self._expert_in_range(key, e, E):
            return
        sl = slice(None) if which == "down" else (slice(0, rows // 2) if w == "w1" else slice(rows // 2, rows))
        want_p, want_s = tuple(tp[e, sl].shape), tuple(ts[e, sl].shape)
        if tuple(packed.shape) != want_p or tuple(scale.shape) != want_s:
            self.misshaped.append(f"{key}{self._where(key)}: packed {tuple(packed.shape)} / scale "
                                  f"{tuple(scale.shape)} vs model {want_p} / {want_s}")
            self.bad.add((skey, e, w))
            return
        self._fill_once(key, skey, e, w, lambda: (tp[e, sl].copy_(packed), ts[e, sl].copy_(scale)))

    def _expert_in_range(self, key: str, e: int, E: int) -> bool:
        if 0 <= e < E:
            return True
        self.unexpected.append(f"{key}: expert index {e} out of range (model has {E} experts)")
        return False

    def _fill_once(self, key: str, skey: str, e: int, w: str, copy) -> None:
        """Run `copy()` (without grad) for expert `e`'s `w` of `skey`, unless an earlier key filled it (an error)."""
        done = self.expert_filled.setdefault(skey, set())
        if (e, w) in done:
            self.errors.append(f"expert {e} {w} of {skey} given twice (dense and MXFP4?){self._where(key)}")
            return
        with torch.no_grad():
            copy()
        done.add((e, w))

    def _place_expert(self, key: str, base: str, e: int, w: str, W: torch.Tensor) -> None:
        which = "down_proj" if w == "w2" else "gate_up_proj"
        skey = f"{base}.{which}"
        tgt = self._stacked_target(skey, which)
        if tgt is None:
            self.unexpected.append(key)
            return
        E, l_in, last = tgt.shape
        if not self._expert_in_range(key, e, E):
            return
        if which == "gate_up_proj":
            M = last // 2
            sl = slice(0, M) if w == "w1" else slice(M, 2 * M)
            want = (M, l_in)
        else:
            sl = slice(None)
            want = (last, l_in)
        if tuple(W.shape) != want:
            self.misshaped.append(f"{key}{self._where(key)}: checkpoint {tuple(W.shape)} vs model {want} "
                                  f"(from {skey} {tuple(tgt.shape)})")
            self.bad.add((skey, e, w))
            return
        self._fill_once(key, skey, e, w, lambda: tgt[e, :, sl].copy_(W.t()))

    # -- results
    def missing(self, prefix: str = PREFIX) -> list:
        """Missing tensors, named as released keys (per expert for stacked experts)."""
        if self.targets is not None:
            keys = list(self.targets.keys())
        elif self.expected is not None:
            keys = list(self.expected.keys())
        else:
            keys = list(self.expert_filled.keys())
        miss = []
        for k in keys:
            pm = _PACKED_RE.match(k)
            if pm:  # PackedMXFP4Experts buffers: complete when every expert's parts were copied in
                if pm.group("part") == "scale":
                    continue
                skey = f"{pm.group('base')}.{pm.group('which')}_proj"
                have = self.expert_filled.get(skey, set())
                ws = ("w1", "w3") if pm.group("which") == "gate_up" else ("w2",)
                for e in range(self.out[k].shape[0]):
                    for w in ws:
                        if (e, w) not in have and (skey, e, w) not in self.bad:
                            miss.append(f"{prefix}{pm.group('base')}.{e}.{w}.weight_packed/.weight_scale")
                continue
            m = _STACKED_RE.match(k)
            if m:
                if k in self.filled:  # given already stacked
                    continue
                have = self.expert_filled.get(k, set())
                E = self.out[k].shape[0] if k in self.out else self.expected[k][0][0]
                ws = ("w1", "w3") if m.group("which") == "gate_up_proj" else ("w2",)
                if len(have) == E * len(ws):
                    continue
                for e in range(E):
                    for w in ws:
                        if (e, w) not in have and (k, e, w) not in self.bad:
                            miss.append(f"{prefix}{m.group('base')}.{e}.{w}.weight (or .weight_packed/.weight_scale)")
                continue
            if k not in self.filled and k not in self.bad:
                if k == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False):
                    continue
                miss.append(prefix + k)
        return miss

    def problems(self) -> list:
        errs = list(self.errors)
        for (base, e, w), slot in self.pending.items():
            have = next(iter(slot))
            other = "weight_scale" if have == "weight_packed" else "weight_packed"
            errs.append(f"{slot[have][0]}: MXFP4 partner `{PREFIX}{base}.{e}.{w}.{other}` is missing")
        return errs

    def report(self) -> str:
        parts = [format_key_report("missing keys", self.missing()),
                 format_key_report("unexpected keys", self.unexpected),
                 format_key_report("mis-shaped keys", self.misshaped),
                 format_key_report("other errors", self.problems())]
        return "\n".join(p for p in parts if p)

    def finish(self, what: str = "checkpoint") -> dict:
        if self.ignored:
            log.info("ignored %d vision/projector tensors (%s, ...): the text model does not use them",
                     len(self.ignored), next(iter(self.ignored)))
        if getattr(self.config, "tie_word_embeddings", False) and "lm_head.weight" not in self.filled \
                and "model.embed_tokens.weight" in self.filled:
            if self.targets is not None:
                if "lm_head.weight" in self.targets and \
                        self.targets["lm_head.weight"].data_ptr() != self.targets["model.embed_tokens.weight"].data_ptr():
                    with torch.no_grad():
                        self.targets["lm_head.weight"].copy_(self.targets["model.embed_tokens.weight"])
            else:
                self.out["lm_head.weight"] = self.out["model.embed_tokens.weight"]
            self.filled.add("lm_head.weight")
        missing = self.missing()
        # an incomplete expert stack is always an error: the result would hold silent zeros
        incomplete = self.targets is None and self.expected is None and missing
        bad = bool(self.misshaped or self.problems() or incomplete)
        if self.strict:
            bad = bad or bool(self.unexpected) or bool(missing)
        if bad:
            raise CheckpointError(f"{what} does not match the model:\n{self.report()}")
        if self.unexpected or missing:
            log.warning("%s: non-strict load:\n%s", what, self.report())
        return self.out


def from_released(tensors: Mapping[str, torch.Tensor], config, *, dtype=None, strict: bool = False,
                  return_extras: bool = False):
    """Released tensors -> in-memory state dict.

    Accepts keys with or without ``language_model.``; ``vision_tower.*`` / ``mm_projector.*`` are set aside (logged,
    and returned as the second element when ``return_extras=True``); per-expert dense or MXFP4 weights are stacked
    (already-stacked ``experts.gate_up_proj`` / ``down_proj`` keys are accepted as well); ``A_log`` is trimmed to
    ``linear_attn_config.num_heads`` (non-zero padding raises). fp32-kept tensors come back fp32; others keep their
    checkpoint dtype unless ``dtype`` is given; decoded experts use ``dtype`` or ``config.dtype``.

    ``strict=True`` also checks the key set and every shape against :func:`model_key_shapes`; the default only
    checks what the mapping itself needs (expert shapes, A_log padding, MXFP4 pairs, complete expert sets)."""
    asm = ReleasedAssembler(config, targets=None, dtype=dtype, strict=strict,
                            expected=model_key_shapes(config) if strict else None)
    for k, t in tensors.items():
        asm.add(k, t)
    sd = asm.finish("released tensors")
    return (sd, dict(asm.ignored)) if return_extras else sd
