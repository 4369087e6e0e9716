"""`k3 export --format release` (issue #29 item 3): the released layout, checked against the config fields and
weight names vLLM's K3 / Kimi-Linear loader reads, and an export -> load round trip with equal logits."""
import json
import os

import pytest
import torch

from k3.checkpoint import from_pretrained, save_pretrained
from k3.checkpoint.io import iter_checkpoint_tensors
from k3.config import K3Config
from k3.errors import CheckpointError
from k3.model import K3ForCausalLM
from k3.tokenizer import K3TiktokenTokenizer, build_toy_tokenizer, load_tokenizer

from .released_fixture import mxfp4_reference_decode, released_tensors

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# ---- the contract: what vLLM's K3 loader (KimiK3ForConditionalGeneration -> KimiLinearForCausalLM with the K3
# additions) reads from config.json. Written from the released config (architecture.md §1) and tensor table (architecture.md §4.2).
CONTAINER_FIELDS = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
                    "text_config": dict, "bos_token_id": int, "eos_token_id": int, "pad_token_id": int,
                    "media_placeholder_token_id": int, "tie_word_embeddings": bool, "dtype": str}
TEXT_FIELDS = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "vocab_size": int, "hidden_size": int, "num_hidden_layers": int, "rms_norm_eps": float,
    "num_attention_heads": int, "num_key_value_heads": int, "q_lora_rank": int, "kv_lora_rank": int,
    "qk_nope_head_dim": int, "qk_rope_head_dim": int, "v_head_dim": int, "mla_use_nope": True,
    "mla_use_output_gate": bool, "linear_attn_config": dict,
    "num_experts": int, "num_experts_per_token": int, "num_shared_experts": int, "moe_intermediate_size": int,
    "routed_expert_hidden_size": int, "latent_moe_use_norm": bool, "intermediate_size": int,
    "first_k_dense_replace": int, "moe_layer_freq": int, "moe_renormalize": bool,
    "moe_router_activation_func": "sigmoid", "routed_scaling_factor": float, "topk_method": "noaux_tc",
    "use_grouped_topk": bool, "num_expert_group": int, "topk_group": int,
    "hidden_act": "situ", "activation_situ_beta": float, "activation_situ_linear_beta": float,
    "attn_res_block_size": int, "max_position_embeddings": int, "num_nextn_predict_layers": 0,
    "tie_word_embeddings": bool, "bos_token_id": int, "eos_token_id": int, "pad_token_id": int, "dtype": str}
LAC_FIELDS = {"num_heads": int, "head_dim": int, "short_conv_kernel_size": int, "use_full_rank_gate": True,
              "gate_lower_bound": float, "full_attn_layers": list, "kda_layers": list}
QUANT_FIELDS = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                "quantization_status": "compressed", "config_groups": dict, "ignore": list}
NOT_RELEASE_KEYS = {"kda_gate_low_rank", "a_log_storage_size", "mla_latent_norm_eps", "torch_dtype", "mtp_loss_weight"}
FP32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")


def _check_fields(d, spec, where):
    for k, want in spec.items():
        assert k in d, f"{where}: `{k}` missing"
        v = d[k]
        if isinstance(want, type):
            assert isinstance(v, want) and not (want is int and isinstance(v, bool)), f"{where}.{k} = {v!r}"
        else:
            assert v == want, f"{where}.{k} = {v!r}, want {want!r}"


def check_release_contract(out_dir, quantized: bool):
    """Config fields + every weight name/shape/dtype a vLLM-style loader expects from the config alone."""
    cfg = json.load(open(os.path.join(out_dir, "config.json")))
    _check_fields(cfg, CONTAINER_FIELDS, "config")
    t = cfg["text_config"]
    _check_fields(t, TEXT_FIELDS, "text_config")
    _check_fields(t["linear_attn_config"], LAC_FIELDS, "text_config.linear_attn_config")
    assert not (NOT_RELEASE_KEYS & set(t)), NOT_RELEASE_KEYS & set(t)
    if quantized:
        _check_fields(t["quantization_config"], QUANT_FIELDS, "quantization_config")
        g = t["quantization_config"]["config_groups"]["group_0"]["weights"]
        assert (g["num_bits"], g["group_size"], g["type"]) == (4, 32, "float")
    else:
        assert "quantization_config" not in t
    # weight names, from the text config alone (the independent generator of the released table)
    want = released_tensors(t, mxfp4=quantized)
    have = {}
    for k, v, _ in iter_checkpoint_tensors(out_dir):
        have[k] = v
    text_keys = {k for k in have if k.startswith("language_model.")}
    assert text_keys == set(want), (sorted(text_keys ^ set(want))[:10])
    H = t["linear_attn_config"]["num_heads"]
    bf = getattr(torch, t["dtype"])
    for k, w in want.items():
        v = have[k]
        if k.endswith("A_log"):   # stored padded: >= num_heads entries, zeros beyond
            assert v.shape[0] >= H and v.dtype == torch.float32 and not v[H:].any(), k
            continue
        assert tuple(v.shape) == tuple(w.shape), (k, tuple(v.shape), tuple(w.shape))
        if v.dtype == torch.uint8:
            assert w.dtype == torch.uint8, k
        else:
            assert v.dtype == (torch.float32 if k.endswith(FP32_SUFFIXES) else bf), (k, v.dtype)
    return cfg, have


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("exp")
    tok = build_toy_tokenizer(str(d / "tok"))
    n = tok.num_base_tokens
    # `tiny` with the released decay-rank rule (the preset's own rank 32 != head_dim 64 is not exportable)
    cfg = K3Config.from_preset("tiny", kda_gate_low_rank=None, vocab_size=n + 256, bos_token_id=n,
                               eos_token_id=n + 2, pad_token_id=n + 255)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial values for the parameters that start constant
        for name, p in model.named_parameters():
            if name.endswith(("_res_proj.weight", "norm.weight", "A_log")):
                p.add_(torch.randn_like(p) * 0.1)
    ck = save_pretrained(model, str(d / "final"), tokenizer=tok)
    return model, tok, ck


def _logits(m, ids):
    with torch.no_grad():
        return m(ids).logits


@pytest.mark.parametrize("quantize", [None, "mxfp4"])
def test_export_tiny_meets_the_vllm_contract_and_round_trips(tiny_ckpt, tmp_path, quantize):
    from k3.export import export_release
    model, tok, ck = tiny_ckpt
    out = export_release(ck, str(tmp_path / "rel"), quantize=quantize, dtype="float32")
    names = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "tiktoken.model", "tokenizer_config.json",
            "generation_config.json", "configuration_k3.py", "modeling_k3.py", "tokenization_k3.py"} <= names
    assert "model.safetensors.index.json" not in names and "preprocessor_config.json" not in names
    cfg, have = check_release_contract(out, quantized=quantize is not None)
    assert "vision_config" not in cfg and cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_k3.K3HFForCausalLM"
    assert cfg["media_placeholder_token_id"] == tok.special_tokens["<|media_pad|>"]
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    assert gen["eos_token_id"] == tok.eos_id
    tc = json.load(open(os.path.join(out, "tokenizer_config.json")))
    assert tc["added_tokens_decoder"][str(tok.eos_id)]["content"] == "<|end_of_msg|>"
    assert len(tc["added_tokens_decoder"]) == 256 and tc["tokenizer_class"] == "TikTokenTokenizer"
    tok2 = load_tokenizer(out)
    assert isinstance(tok2, K3TiktokenTokenizer) and tok2.encode("Hello world, again!") == \
        tok.encode("Hello world, again!")
    back = from_pretrained(out)
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    if quantize is None:
        assert torch.equal(_logits(back, ids), _logits(model, ids))
    else:  # equal to the original with its experts rounded to MXFP4 (the spec decode of the exported bytes)
        ref = K3ForCausalLM(model.config).eval()
        ref.load_state_dict(model.state_dict())
        L = next(i for i, layer in enumerate(ref.model.layers) if hasattr(layer, "block_sparse_moe"))
        pre = f"language_model.model.layers.{L}.block_sparse_moe.experts."
        ex = back.model.layers[L].block_sparse_moe.experts
        M = model.config.moe_intermediate_size
        dec = mxfp4_reference_decode(have[pre + "3.w1.weight_packed"], have[pre + "3.w1.weight_scale"])
        assert torch.equal(ex.gate_up_proj[3, :, :M], dec.t())
        from k3.checkpoint import mxfp4_decode, mxfp4_encode
        with torch.no_grad():
            for layer in ref.model.layers:
                if hasattr(layer, "block_sparse_moe"):
                    e = layer.block_sparse_moe.experts
                    for p in (e.gate_up_proj, e.down_proj):
                        p.copy_(mxfp4_decode(*mxfp4_encode(p.transpose(1, 2)), torch.float32).transpose(1, 2))
        assert torch.equal(_logits(back, ids), _logits(ref, ids))


def test_export_bf16_sharded_with_index_and_cli(tiny_ckpt, tmp_path):
    from k3.cli import main
    model, tok, ck = tiny_ckpt
    out = str(tmp_path / "rel")
    assert main(["export", "--format", "release", "--ckpt", ck, "--out", out, "--max-shard-size", "4MB"]) == 0
    idx = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(idx["weight_map"].values())) > 1
    check_release_contract(out, quantized=False)
    back = from_pretrained(out)
    assert back.dtype == torch.bfloat16
    ref = K3ForCausalLM(model.config.replace(dtype="bfloat16")).eval()
    ref.load_state_dict(model.state_dict())
    from k3.checkpoint import cast_to_storage_dtype
    cast_to_storage_dtype(ref, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_logits(back, ids), _logits(ref, ids))


def test_export_refuses_what_the_release_cannot_express(tmp_path):
    from k3.export import export_release
    cfg = K3Config.from_preset("tiny")  # kda_gate_low_rank 32 != head_dim 64
    d = tmp_path / "ck"
    d.mkdir()
    cfg.save_json(str(d / "config.json"))
    with pytest.raises(CheckpointError, match="kda_gate_low_rank = 32 differs from linear_attn_config.head_dim"):
        export_release(str(d), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_export_keeps_a_vision_tower(tmp_path):
    """A released multimodal checkpoint (vision tensors + vision_config) exports with its tower, its
    vision_config and a preprocessor_config.json."""
    from k3.export import export_release
    from k3.vision import VisionConfig, VisionModel
    from .released_fixture import text_config, write_released
    tokdir = tmp_path / "tok"
    tok = build_toy_tokenizer(str(tokdir))
    n = tok.num_base_tokens
    c = text_config(vocab_size=n + 256, bos_token_id=n, eos_token_id=n + 2, pad_token_id=n + 255)
    t = released_tensors(c)
    vc = dict(VisionConfig.preset("tiny").to_dict(), text_hidden_size=c["hidden_size"])
    vm = VisionModel(VisionConfig.from_dict(vc))
    vis = {k: v.detach().clone() for k, v in vm.state_dict().items()}
    src = write_released(str(tmp_path / "src"), c, {**t, **vis})
    cj = json.load(open(os.path.join(src, "config.json")))
    cj["vision_config"] = vc
    json.dump(cj, open(os.path.join(src, "config.json"), "w"))
    out = export_release(src, str(tmp_path / "out"), tokenizer=str(tokdir))
    cfg, have = check_release_contract(out, quantized=False)
    assert cfg["vision_config"] == vc
    for k, v in vis.items():
        assert torch.equal(have[k], v.to(torch.bfloat16)), k
    pp = json.load(open(os.path.join(out, "preprocessor_config.json")))
    assert pp["media_proc_cfg"]["patch_size"] == vc["patch_size"]


def test_hf_training_tokenizer_exports_as_tiktoken(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")  # noqa: F841
    from k3.tokenizer import HFTokenizerWrapper
    from k3.tokenizer.export import save_release_tokenizer
    from k3.train.data import load_corpus, train_tokenizer
    docs = load_corpus()[0][:40]
    hf = HFTokenizerWrapper.from_object(train_tokenizer(docs, vocab_size=1024))
    out = save_release_tokenizer(hf, str(tmp_path))
    for text in docs[:5] + ["Ünïcödé 中文 🙂 <|open|> x"]:
        assert out.encode(text[:2000]) == hf.encode(text[:2000])
    assert out.special_tokens == hf.special_tokens


def test_export_streams_and_checks_names_against_the_config(tiny_ckpt, tmp_path, monkeypatch):
    """The export never builds the model or a whole state dict, and a checkpoint whose tensors disagree with its
    config.json is refused before anything is written."""
    import shutil
    import k3.checkpoint.io as io
    from k3.export import export_release
    model, tok, ck = tiny_ckpt

    def boom(*a, **k):
        raise AssertionError("export materialised the model")
    monkeypatch.setattr(io, "load_state_dict", boom)
    monkeypatch.setattr(io, "from_pretrained", boom)
    export_release(ck, str(tmp_path / "ok"), quantize="mxfp4")
    monkeypatch.undo()
    bad = tmp_path / "bad"
    shutil.copytree(ck, bad)
    c = json.load(open(bad / "config.json"))
    c["moe_intermediate_size"] = 64
    json.dump(c, open(bad / "config.json", "w"))
    with pytest.raises(CheckpointError, match="does not match its config.json"):
        export_release(str(bad), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
