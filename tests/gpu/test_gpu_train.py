"""The trainer on CUDA (skipped without it): `--param-dtype bf16` (bf16 weights, fp32 masters in the optimizer)
against the default fp32-weight autocast run on the same data, a few steps of a micro model, no compile."""
import json
import math
import os
import time

import pytest
import torch

from helpers import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bf16_params_train_like_fp32_on_cuda(tmp_path, micro_corpus, micro_model_overrides, monkeypatch):
    # KDA by the torch chunk path: fla autotunes its kernels for every new shape of this micro model (the first
    # H200 run spent 287 s of its 310 in fla's autotuner); this test is about the weights' dtype and the optimizer
    monkeypatch.setenv("K3_BACKEND", "kda:torch")
    from k3.train.trainer import Trainer, TrainConfig
    losses = {}
    for dt in ("fp32", "bf16"):
        out = tmp_path / dt
        cfg = TrainConfig(out_dir=str(out), preset="tiny", model_overrides=dict(micro_model_overrides), steps=8,
                          tokens_per_step=512, stages=[(128, 1.0)], data=micro_corpus["data"], cache_dir=micro_corpus["cache"], lr=1e-2,
                          val_tokens=512, recall_examples=4, recall_pairs=4, progress=False, tensorboard=False,
                          samples=False, plot=False, seed=0, device="cuda", eval_every=0, compile="none",
                          param_dtype=dt)
        t0 = time.time()
        t = Trainer(cfg)
        print(f"[gpu-train] {dt}: trainer built in {time.time() - t0:.1f} s", flush=True)
        t.train()
        print(f"[gpu-train] {dt}: trained in {time.time() - t0:.1f} s", flush=True)
        with open(os.path.join(out, "metrics.jsonl")) as fh:
            losses[dt] = [r["loss"] for r in map(json.loads, fh) if r["type"] == "train"]
        if dt == "bf16":
            assert t.model.model.embed_tokens.weight.dtype == torch.bfloat16
            st = [s for s in t.optimizer.state.values() if "master" in s]
            assert st and all(s["master"].dtype == torch.float32 and s["master"].is_cuda for s in st)
    print(f"[gpu-train] losses fp32 {losses['fp32']}\n[gpu-train] losses bf16 {losses['bf16']}", flush=True)
    assert all(math.isfinite(x) for v in losses.values() for x in v)
    assert losses["bf16"][-1] < losses["bf16"][0]
    # same data and init: the two recipes stay close over a few steps (bf16 activations vs autocast)
    assert abs(losses["bf16"][-1] - losses["fp32"][-1]) < 0.05 * losses["fp32"][-1], losses


def test_fused_muon_matches_foreach_on_cuda(micro_model_overrides):
    """MuonAdamW(fused=True) (Triton momentum / apply) against the foreach path on CUDA: bf16 weights with fp32
    masters, three steps with the same gradients. With Newton-Schulz in fp32 the masters agree to fp32 rounding
    (the kernels do the same math). With the default bf16 Newton-Schulz, last-bit differences of its input (FMA
    order) become bf16-rounding-level differences of its output (the sixth-session run: masters 1.2e-3; the same
    on CPU under the interpreter: 1.8e-3), so there the bound is bf16 Newton-Schulz's own distance from fp32."""
    import copy
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.train.optim import build_optimizer
    torch.manual_seed(0)
    base = K3ForCausalLM(K3Config.from_preset("tiny", **micro_model_overrides)).cuda().to(torch.bfloat16)
    runs = {(fused, ns): None for ns in (torch.float32, torch.bfloat16) for fused in (False, True)}
    models = {k: copy.deepcopy(base) for k in runs}
    opts = {k: build_optimizer(models[k], lr=0.02, master_weights=True, fused=k[0], ns_dtype=k[1]) for k in runs}
    for step in range(3):
        g = torch.Generator(device="cuda").manual_seed(step)
        grads = {n: torch.randn(p.shape, device="cuda", generator=g).bfloat16() for n, p in base.named_parameters()}
        for k in runs:
            for n, p in models[k].named_parameters():
                p.grad = grads[n].clone()
            opts[k].step()

    def worst(ka, kb):
        w = m = 0.0
        for pa, pb in zip(models[ka].parameters(), models[kb].parameters()):
            w = max(w, rel_err(pb, pa))     # relative to run ka
            if "master" in opts[ka].state.get(pa, {}):
                m = max(m, rel_err(opts[kb].state[pb]["master"], opts[ka].state[pa]["master"]))
        return w, m
    f32_w, f32_m = worst((False, torch.float32), (True, torch.float32))
    bf_w, bf_m = worst((False, torch.bfloat16), (True, torch.bfloat16))
    ns_w, ns_m = worst((False, torch.bfloat16), (False, torch.float32))
    print(f"[gpu-train] fused Muon vs foreach: fp32 NS weights {f32_w:.2e} masters {f32_m:.2e}; bf16 NS weights "
          f"{bf_w:.2e} masters {bf_m:.2e}; bf16 vs fp32 NS (foreach) masters {ns_m:.2e}", flush=True)
    assert f32_m < 1e-5 and f32_w < 2e-3, (f32_m, f32_w)
    assert bf_m < ns_m, (bf_m, ns_m)
