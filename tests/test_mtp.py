"""Multi-token prediction (k3/nn/mtp.py): config, loss with document-aware shifted targets, checkpoint layouts,
speculative decoding (k3/generation/speculative.py) == greedy decoding."""
import json
import os

import pytest
import safetensors
import torch
import torch.nn.functional as F

import k3
from k3.checkpoint import from_pretrained, load_state_dict, save_pretrained
from k3.checkpoint.adapter import model_key_shapes
from k3.config import K3Config
from k3.errors import K3ConfigError, RequestError
from k3.model import K3ForCausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def micro():
    from tests.conftest import _MICRO_MODEL

    def make(n_mtp=1, **kw):
        return K3Config.from_preset("tiny", dtype="float32", num_nextn_predict_layers=n_mtp,
                                    **dict(_MICRO_MODEL, **kw))
    return make


def _perturb(model):
    with torch.no_grad():   # non-trivial values for the parameters that start constant
        for name, p in model.named_parameters():
            if name.endswith(("_res_proj.weight", "norm.weight")):
                p.add_(torch.randn_like(p) * 0.1)
    return model


# ------------------------------------------------------------------------------------------------ config
def test_config_fields(micro):
    c = micro(2, mtp_loss_weight=0.5)
    assert c.num_nextn_predict_layers == 2 and c.to_dict()["mtp_loss_weight"] == 0.5
    assert "mtp_loss_weight" not in micro(1).to_dict()          # project-only field: written only when set
    assert K3Config.from_dict(c.to_dict()).mtp_loss_weight == 0.5
    from k3.export import release_config_dict
    assert "mtp_loss_weight" not in release_config_dict(c.replace(kda_gate_low_rank=None))["text_config"]
    with pytest.raises(K3ConfigError, match="num_nextn_predict_layers"):
        micro(-1)
    with pytest.raises(K3ConfigError, match="mtp_loss_weight"):
        micro(1, mtp_loss_weight=-0.1)


def test_default_off_model_unchanged(micro):
    c = micro(0)
    m = K3ForCausalLM(c)
    assert m.mtp is None
    assert set(m.state_dict()) == set(model_key_shapes(c))       # exactly the released layout's tensors
    ids = torch.randint(0, c.vocab_size, (1, 9))
    out = m(ids, labels=ids)
    assert out.main_loss is None and out.mtp_losses is None
    # MTP blocks do not touch the main model: same weights -> same logits and main loss
    on = K3ForCausalLM(micro(2))
    missing, unexpected = on.load_state_dict(m.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("mtp.") for k in missing)
    with torch.no_grad():
        o2 = on(ids, labels=ids, return_logits=True)
        o1 = m(ids, labels=ids, return_logits=True)
    assert torch.equal(o1.logits, o2.logits) and torch.equal(o1.loss, o2.main_loss)


# ------------------------------------------------------------------------------------------------ loss
def _reference_mtp_loss(m, ids, cu, lam):
    """Written out in fp64: targets token t+1+i within t's document, inputs embed(token t+i) (zero across)."""
    T = ids.shape[1]
    ends = [next(b for b in cu[1:] if t < b) for t in range(T)]
    with torch.no_grad():
        h = m.model(ids, cu_seqlens=torch.tensor(cu))
        emb = m.model.embed_tokens(ids)
        main_n, main_sum = 0, 0.0
        logp = F.log_softmax(m.lm_head(h)[0].double(), -1)
        for t in range(T):
            if t + 1 < ends[t]:
                main_sum -= float(logp[t, ids[0, t + 1]])
                main_n += 1
        losses, prev = [], h
        for i, block in enumerate(m.mtp, start=1):
            e = torch.zeros_like(emb)
            for t in range(T):
                if t + i < ends[t]:
                    e[0, t] = emb[0, t + i]
            prev = block(prev, e, cu_seqlens=torch.tensor(cu))
            lp = F.log_softmax(m.lm_head(block.shared_head.norm(prev))[0].double(), -1)
            s, n = 0.0, 0
            for t in range(T):
                if t + 1 + i < ends[t]:
                    s -= float(lp[t, ids[0, t + 1 + i]])
                    n += 1
            losses.append(s / n)
    main = main_sum / main_n
    return main + lam * sum(losses) / len(losses), main, losses


@pytest.mark.parametrize("cu", [[0, 14], [0, 5, 6, 14]])
def test_mtp_loss_matches_fp64_formula(micro, cu):
    torch.manual_seed(0)
    m = _perturb(K3ForCausalLM(micro(2, mtp_loss_weight=0.4))).double()
    T = cu[-1]
    ids = torch.randint(0, m.config.vocab_size, (1, T))
    labels = torch.full_like(ids, -100)
    for a, b in zip(cu[:-1], cu[1:]):
        labels[0, a:b - 1] = ids[0, a + 1:b]          # aligned targets, -100 at each document's last position
    out = m(ids, labels=labels, cu_seqlens=torch.tensor(cu))
    total, main, losses = _reference_mtp_loss(m, ids, cu, 0.4)
    assert abs(float(out.main_loss.detach()) - main) < 1e-10
    assert torch.allclose(out.mtp_losses.detach(), torch.tensor(losses, dtype=out.mtp_losses.dtype), atol=1e-10, rtol=0)
    assert abs(float(out.loss.detach()) - total) < 1e-10
    out.loss.backward()                                  # the MTP blocks get gradients
    assert m.mtp[1].eh_proj.weight.grad is not None and m.mtp[1].eh_proj.weight.grad.abs().sum() > 0


def test_mtp_targets_shift():
    from k3.nn.mtp import mtp_targets
    labels = torch.arange(10, 20).view(1, 10)
    y = mtp_targets(labels, 2, torch.tensor([0, 4, 10]))
    # document [0,4): t + 2 < 4 -> t in {0, 1}; document [4,10): t + 2 < 10 -> t in 4..7
    assert y.tolist() == [[12, 13, -100, -100, 16, 17, 18, 19, -100, -100]]
    assert mtp_targets(labels, 1).tolist() == [list(range(11, 20)) + [-100]]


# ------------------------------------------------------------------------------------------------ checkpoints
def _keys(directory):
    out = []
    for f in os.listdir(directory):
        if f.endswith(".safetensors"):
            with safetensors.safe_open(os.path.join(directory, f), "pt") as h:
                out += list(h.keys())
    return set(out)


def test_checkpoint_round_trip_native_and_released(micro, tmp_path):
    torch.manual_seed(1)
    c = micro(2)
    m = _perturb(K3ForCausalLM(c))
    sd = m.state_dict()
    # native: the in-memory names mtp.{i}.*
    m2 = K3ForCausalLM(c)
    m2.load_state_dict(sd)
    assert all(torch.equal(sd[k], m2.state_dict()[k]) for k in sd)
    # released / vLLM layout: language_model.model.layers.{L+i}.* (+ per-block copies of the shared head/embedding)
    ck = save_pretrained(m, str(tmp_path / "ck"))
    keys, L = _keys(ck), c.num_hidden_layers
    for i in range(2):
        p = f"language_model.model.layers.{L + i}."
        for s in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                  "shared_head.head.weight", "embed_tokens.weight", "input_layernorm.weight",
                  "self_attn.kv_a_proj_with_mqa.weight", "block_sparse_moe.gate.weight",
                  "block_sparse_moe.experts.0.w1.weight"):
            assert p + s in keys, p + s
    assert not any(".mtp." in k or k.startswith("language_model.mtp") for k in keys)
    from k3.nn.mtp import mtp_released_key_shapes
    from k3.checkpoint.adapter import released_key_shapes
    assert keys == set(released_key_shapes(c)) | set(mtp_released_key_shapes(c))
    m3 = from_pretrained(ck)
    sd3 = m3.state_dict()
    assert set(sd3) == set(sd) and all(torch.equal(sd[k], sd3[k]) for k in sd)
    sd4 = load_state_dict(ck, strict=True)
    assert set(sd4) == set(sd) and all(torch.equal(sd[k], sd4[k]) for k in sd)
    sub = load_state_dict(ck, keys=lambda k: k.startswith("mtp.1."))
    assert set(sub) == {k for k in sd if k.startswith("mtp.1.")}


@pytest.mark.parametrize("quantize", [None, "mxfp4"])
def test_export_release_with_mtp(micro, tmp_path, quantize):
    from k3.export import export_release
    from k3.tokenizer import build_toy_tokenizer
    tok = build_toy_tokenizer(str(tmp_path / "tok"))
    n = tok.num_base_tokens
    c = micro(1, kda_gate_low_rank=None, vocab_size=n + 256, bos_token_id=n, eos_token_id=n + 2,
              pad_token_id=n + 255)
    torch.manual_seed(2)
    m = _perturb(K3ForCausalLM(c)).eval()
    ck = save_pretrained(m, str(tmp_path / "ck"), tokenizer=tok)
    out = export_release(ck, str(tmp_path / "rel"), quantize=quantize, dtype="float32")
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["text_config"]["num_nextn_predict_layers"] == 1 and "mtp_loss_weight" not in cfg["text_config"]
    if quantize:
        assert "re:.*eh_proj.*" in cfg["text_config"]["quantization_config"]["ignore"]
    L = c.num_hidden_layers
    assert f"language_model.model.layers.{L}.eh_proj.weight" in _keys(out)
    back = from_pretrained(out, dtype="float32")
    sd, sd2 = m.state_dict(), back.state_dict()
    assert set(sd) == set(sd2)
    assert torch.equal(sd["mtp.0.eh_proj.weight"], sd2["mtp.0.eh_proj.weight"])


# ------------------------------------------------------------------------------------------------ speculative
@pytest.mark.parametrize("n_mtp", [1, 2])
def test_speculative_equals_greedy_random_heads(micro, n_mtp):
    torch.manual_seed(3 + n_mtp)
    m = _perturb(K3ForCausalLM(micro(n_mtp))).eval()
    for T, new in ((1, 9), (6, 17), (19, 12))[:4 - 2 * n_mtp]:     # 3 lengths with k = 1, one with k = 2
        ids = torch.randint(0, m.config.vocab_size, (1, T))
        ref = k3.generate(m, ids, new, stop_token_ids=[])
        out = k3.generate(m, ids, new, stop_token_ids=[], speculative="mtp", return_dict=True)
        assert torch.equal(out.sequences, ref), (T, new)
        st = out.speculative
        assert st["new_tokens"] == new and 0 <= st["accepted"] <= st["drafted"]


@pytest.mark.parametrize("n_mtp", [1, 3])
def test_speculative_with_good_drafts_is_exact_and_accepts(micro, n_mtp, monkeypatch):
    """A drafter that knows the greedy continuation (a perfectly trained MTP head), and one that is right only on
    its first draft: the output stays exact, acceptance is counted, the KDA/MLA rollback is exercised."""
    from k3.generation import speculative as spec
    torch.manual_seed(7)
    m = _perturb(K3ForCausalLM(micro(n_mtp))).eval()
    ids = torch.randint(0, m.config.vocab_size, (1, 5))
    ref = k3.generate(m, ids, 24, stop_token_ids=[])[0].tolist()
    real_draft = spec.MTPDrafter.draft
    for right in (n_mtp, 1):
        def oracle(self, tokens, right=right):
            real_draft(self, tokens)                     # keep the MTP caches' bookkeeping running
            nxt = ref[len(tokens):len(tokens) + self.k]
            nxt += [0] * (self.k - len(nxt))
            return nxt[:right] + [(t + 1) % m.config.vocab_size for t in nxt[right:]]
        monkeypatch.setattr(spec.MTPDrafter, "draft", oracle)
        out = k3.generate(m, ids, 24, stop_token_ids=[], speculative="mtp", return_dict=True)
        assert out.sequences[0].tolist() == ref
        st = out.speculative
        assert st["acceptance_rate"] > (0.85 if right == n_mtp else 0.2), st
        assert st["rounds"] < 23
        if right < n_mtp:
            assert st["rollbacks"] > 0


def test_speculative_stop_token_and_refusals(micro):
    torch.manual_seed(11)
    m = K3ForCausalLM(micro(1)).eval()
    ids = torch.randint(0, m.config.vocab_size, (1, 4))
    ref = k3.generate(m, ids, 12, stop_token_ids=[])[0, 4:].tolist()
    stop = ref[5]
    a = k3.generate(m, ids, 12, stop_token_ids=[stop], return_dict=True)
    b = k3.generate(m, ids, 12, stop_token_ids=[stop], speculative="mtp", return_dict=True)
    assert b.new_tokens == a.new_tokens and b.finish_reasons == a.finish_reasons == ["stop_token"]
    with pytest.raises(RequestError, match="greedy"):
        k3.generate(m, ids, 4, speculative="mtp", do_sample=True, temperature=1.0)
    with pytest.raises(RequestError, match="batch 1"):
        k3.generate(m, torch.cat([ids, ids]), 4, speculative="mtp")
    with pytest.raises(RequestError, match="speculative must be"):
        k3.generate(m, ids, 4, speculative="eagle")
    with pytest.raises(RequestError, match="num_nextn_predict_layers"):
        k3.generate(K3ForCausalLM(micro(0)).eval(), ids, 4, speculative="mtp")


# ------------------------------------------------------------------------------------------------ trainer
def test_trainer_logs_mtp_losses_and_resumes_checkpoint(micro_corpus, micro_model_overrides, tmp_path):
    from k3.train.trainer import TrainConfig, Trainer
    out = tmp_path / "run"
    ov = dict(micro_model_overrides, num_nextn_predict_layers=1, mtp_loss_weight=0.5)
    cfg = TrainConfig(out_dir=str(out), preset="tiny", model_overrides=ov, steps=4, tokens_per_step=256,
                      stages=[(64, 1.0)], data=micro_corpus["data"], cache_dir=micro_corpus["cache"], lr=1e-2,
                      val_tokens=256, recall_examples=0, progress=False, tensorboard=False, samples=False,
                      plot=False, seed=0, device="cpu", eval_every=4, save_every=2)
    s = Trainer(cfg).train()
    assert s["status"] == "completed"
    recs = [json.loads(x) for x in open(out / "metrics.jsonl")]
    tr = [r for r in recs if r["type"] == "train"]
    for r in tr:
        assert abs(r["loss"] - (r["main_loss"] + 0.5 * r["mtp_loss"])) < 1e-4 * r["loss"], r
        assert len(r["mtp_losses"]) == 1
    ev = [r for r in recs if r["type"] == "eval"]
    assert "val_mtp_loss" in ev[-1]
    m = from_pretrained(str(out / "final"))
    assert m.mtp is not None and m.config.mtp_loss_weight == 0.5
