"""A k3 export loads with transformers' Auto classes through the shims k3 writes (issue #29 item 4)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from k3.export import export_release  # noqa: E402

from .test_export import tiny_ckpt  # noqa: E402,F401  (module-scoped fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def exported(tiny_ckpt, tmp_path_factory):  # noqa: F811
    model, tok, ck = tiny_ckpt
    return model, tok, export_release(ck, str(tmp_path_factory.mktemp("hf") / "rel"), dtype="float32")


def test_auto_model_logits_equal_k3(exported):
    model, tok, out = exported
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert cfg.model_type == "kimi_k3" and cfg.vocab_size == model.config.vocab_size
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert type(hf).__name__ == "K3HFForCausalLM"
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = hf(input_ids=ids).logits
        want = model(ids).logits
    assert torch.equal(got, want)
    with torch.no_grad():
        loss = hf(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)


def test_auto_model_greedy_generate_matches_k3_argmax(exported):
    model, tok, out = exported
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    ids = torch.tensor([tok.encode("Hello world")])
    g = hf.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_id)
    seq = ids
    with torch.no_grad():
        for _ in range(4):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(g, seq)


def test_auto_tokenizer_matches_k3(exported):
    model, tok, out = exported
    from transformers import AutoTokenizer
    ht = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    for text in ("Hello world, it's me!", "  spaces\n\nand Ünïcödé 中文 🙂", "x = f(1234567)"):
        ids = ht.encode(text, add_special_tokens=False)
        assert ids == tok.encode(text)
        assert ht.decode(ids) == text
    s = "<|open|>message<|sep|>hi<|close|>"
    assert ht.encode(s, add_special_tokens=False) == tok.encode(s, allow_special=True)
    assert ht.eos_token_id == tok.eos_id and ht.pad_token_id == tok.pad_id and ht.bos_token_id == tok.bos_id
    assert len(ht) == tok.vocab_size
