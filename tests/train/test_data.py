"""Corpus, tokenizer, packing loader and schedules (k3.train.data / k3.train.schedule)."""
import json
import math
import os

import numpy as np
import pytest
import torch

from k3.errors import K3ConfigError
from k3.train.data import (IGNORE_INDEX, HFTokenizer, PackedLoader, ValLoader, build_data, get_tokenizer,
                           load_corpus, special_token_names, tokenize_documents)
from k3.train.schedule import (TINY_STAGES, ContextSchedule, batch_rows, cosine_with_warmup, stage_at,
                               stage_boundaries)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch, one_torch_thread):
    monkeypatch.setenv("K3_CACHE", str(tmp_path / "cache"))


# ----------------------------------------------------------------------------------------------- synthetic

EOD = 999


def synthetic(n_docs=23, seed=0):
    """Document d has length 1..300 and token t at position i = d*1000 + i (i < 998) -> identifiable; EOD last."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 300, size=n_docs)
    lens[3] = 700  # longer than a row
    docs = [np.concatenate([d * 1000 + np.arange(n) % 998, [EOD]]) for d, n in enumerate(lens)]
    offsets = np.zeros(n_docs + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(d) for d in docs])
    return np.concatenate(docs).astype(np.int64), offsets


def segments(batch):
    ids, lab, cu = batch["input_ids"][0], batch["labels"][0], batch["cu_seqlens"].tolist()
    return [(ids[a:b], lab[a:b]) for a, b in zip(cu[:-1], cu[1:])]


def check_batch(batch, T, B):
    ids, lab, cu = batch["input_ids"], batch["labels"], batch["cu_seqlens"]
    assert ids.shape == lab.shape == (1, B * T) and ids.dtype == lab.dtype == torch.int64
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == B * T
    assert (cu[1:] > cu[:-1]).all()
    assert set(range(0, B * T, T)) <= set(cu.tolist())  # every row start
    for seg_ids, seg_lab in segments(batch):
        docs = (seg_ids // 1000)[seg_ids != EOD]
        assert len(set(docs.tolist())) <= 1, "a segment spans two documents"
        if (seg_ids == EOD).any():  # EOD only at the end of a segment
            assert (seg_ids == EOD).nonzero().flatten().tolist() == [len(seg_ids) - 1]
        pos = seg_ids[seg_ids != EOD] % 1000
        assert (pos[1:] - pos[:-1] == 1).all() or len(pos) < 2 or ((pos[1:] - pos[:-1]) % 998 == 1).all()
        assert seg_lab[-1] == IGNORE_INDEX
        assert torch.equal(seg_lab[:-1], seg_ids[1:])
    # boundaries: a document end (EOD) is always followed by a segment start
    flat = ids[0]
    ends = (flat == EOD).nonzero().flatten() + 1
    assert set(ends.tolist()) <= set(cu.tolist())


def test_packing_isolation_and_coverage():
    toks, offs = synthetic()
    T, B = 128, 4
    ld = PackedLoader(toks, offs, T, B, seed=3)
    stream = []
    for _ in range(math.ceil(len(toks) / (T * B)) + 1):
        b = ld.next_batch()
        check_batch(b, T, B)
        stream.append(b["input_ids"][0])
    stream = torch.cat(stream).numpy()
    # the first epoch is exactly the documents in the epoch-0 permutation, each whole and in order
    epoch0 = np.concatenate([toks[offs[d]:offs[d + 1]] for d in ld.order(0)])
    assert np.array_equal(stream[:len(epoch0)], epoch0)
    assert sorted(ld.order(0).tolist()) == list(range(len(offs) - 1))
    assert not np.array_equal(ld.order(0), ld.order(1))


def test_determinism_and_seed():
    toks, offs = synthetic()
    a = [PackedLoader(toks, offs, 64, 3, seed=1).next_batch() for _ in range(1)]
    l1, l2, l3 = (PackedLoader(toks, offs, 64, 3, seed=s) for s in (1, 1, 2))
    for _ in range(5):
        b1, b2, b3 = l1.next_batch(), l2.next_batch(), l3.next_batch()
        for k in b1:
            assert torch.equal(b1[k], b2[k])
    assert torch.equal(a[0]["input_ids"], PackedLoader(toks, offs, 64, 3, seed=1).next_batch()["input_ids"])
    assert not torch.equal(b1["input_ids"], b3["input_ids"])


def test_exact_resume_mid_epoch_and_across_epochs():
    toks, offs = synthetic()
    ld = PackedLoader(toks, offs, 96, 2, seed=7)
    for _ in range(5):
        ld.next_batch()
    sd = json.loads(json.dumps(ld.state_dict()))  # must be plain data
    assert sd["epoch"] == 0 and 0 < sd["pos"]
    want = [ld.next_batch() for _ in range(70)]  # crosses several epochs
    assert ld.epoch >= 2
    ld2 = PackedLoader(toks, offs, 16, 1, seed=0)
    ld2.load_state_dict(sd)
    for w in want:
        g = ld2.next_batch()
        for k in w:
            assert torch.equal(w[k], g[k])
    bad = PackedLoader(toks[: offs[-2]], offs[:-1], 96, 2)
    with pytest.raises(K3ConfigError):
        bad.load_state_dict(sd)


def test_seq_len_switch_keeps_position():
    toks, offs = synthetic()
    ld = PackedLoader(toks, offs, 64, 4, seed=5)
    ref = PackedLoader(toks, offs, 32, 1, seed=5)
    got = [ld.next_batch(), ld.next_batch()]
    ld.set_shape(seq_len=256, batch_size=1)
    got.append(ld.next_batch())
    check_batch(got[-1], 256, 1)
    got.append(ld.next_batch(seq_len=128, batch_size=3))  # one-off override
    check_batch(got[-1], 128, 3)
    assert ld.seq_len == 256 and ld.state_dict()["pos"] == 64 * 8 + 256 + 384
    stream = torch.cat([g["input_ids"][0] for g in got])
    ref_stream = torch.cat([ref.next_batch()["input_ids"][0] for _ in range(len(stream) // 32)])
    assert torch.equal(stream, ref_stream)
    with pytest.raises(K3ConfigError):
        ld.set_shape(seq_len=1)


def test_validation_is_fixed_and_padded():
    toks, offs = synthetic(n_docs=7)
    val = ValLoader(toks, offs, 100, 3, pad_id=-5)
    b1, b2 = list(val), list(val)
    assert len(b1) == len(b2) and len(b1) == math.ceil(math.ceil(len(toks) / 100) / 3)
    for x, y in zip(b1, b2):
        for k in x:
            assert torch.equal(x[k], y[k])
    real = torch.cat([b["input_ids"][0] for b in b1])
    n = len(toks)
    assert torch.equal(real[:n], torch.from_numpy(toks)) and (real[n:] == -5).all()
    last = b1[-1]
    assert (last["labels"][last["input_ids"] == -5] == IGNORE_INDEX).all()
    assert (n % 100) in (last["cu_seqlens"] % 100).tolist()  # the pad is its own segment
    assert len(list(val.batches(max_batches=1))) == 1


# ----------------------------------------------------------------------------------------------- corpus

def test_load_corpus_files(tmp_path):
    (tmp_path / "a.txt").write_text("First doc.\n\nSecond section of a.\n\n\nThird.\n")
    (tmp_path / "b.txt").write_text("Only doc of b.")
    with open(tmp_path / "c.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"text": f"json document number {i}"}) + "\n")
    tr, va = load_corpus([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    assert sorted(tr + va) == sorted(["First doc.\n\nSecond section of a.\n\n\nThird.\n", "Only doc of b."])
    assert len(va) == 1
    tr, va = load_corpus(str(tmp_path / "a.txt"), split_sections=True, val_fraction=0.0)
    assert tr == ["First doc.", "Second section of a.", "Third."] and va == []
    tr, va = load_corpus(str(tmp_path))
    assert len(tr) + len(va) == 32 and va and "json document number 0" in tr + va
    assert load_corpus(str(tmp_path)) == (tr, va)
    with pytest.raises(K3ConfigError):
        load_corpus(str(tmp_path / "missing.txt"))


def test_builtin_corpus():
    tr, va = load_corpus()
    assert len(tr) > 300 and len(va) > 5 and not set(tr) & set(va)
    assert sum(map(len, tr)) > 1_000_000
    assert any("lambda" in d for d in tr)
    assert load_corpus() == (tr, va)


# ----------------------------------------------------------------------------------------------- tokenizer

def test_tokenizer_small_roundtrip_and_specials(tmp_path):
    docs = load_corpus()[0][:40]
    tok = HFTokenizer(get_tokenizer(600, corpus=docs))
    V = 600
    assert tok.vocab_size == V
    names = special_token_names(V)
    for i, name in enumerate(names):
        assert tok.token_id(name) == V - 256 + i
    assert names[8] == f"<|reserved_token_{V - 256 + 8}|>" and names[65] == "<osagent_mode>"
    assert (tok.bos_id, tok.eod_id, tok.eos_id, tok.pad_id, tok.unk_id) == (V - 256, V - 255, V - 254, V - 1, V - 2)
    assert tok.token_id("<|media_pad|>") == V - 256 + 21 and tok.token_id("[EOT]") == V - 256 + 9
    text = "Hello wörld — 你好! The `x**2` of 12345 is big.\n\n\tTabs  and  spaces.\r\n"
    ids = tok.encode(text)
    assert max(ids) < V - 256 and tok.decode(ids) == text
    # special strings: recognised by default, plain text with allow_special=False
    s = "a<|open|>b[EOS]"
    assert tok.token_id("<|open|>") in tok.encode(s) and tok.eod_id in tok.encode(s)
    plain = tok.encode(s, allow_special=False)
    assert max(plain) < V - 256 and tok.decode(plain) == s
    # save / reload / cache hit; the package's tokenizer loader reads it with the same ids
    p = tok.save(str(tmp_path / "ckpt"))
    from k3.tokenizer import load_tokenizer
    k3tok = load_tokenizer(str(tmp_path / "ckpt"))
    assert (k3tok.bos_id, k3tok.eos_id, k3tok.eod_id, k3tok.pad_id) == (tok.bos_id, tok.eos_id, tok.eod_id,
                                                                        tok.pad_id)
    assert k3tok.encode(text) == ids and k3tok.vocab_size == V
    again = HFTokenizer(get_tokenizer(path=str(tmp_path / "ckpt")))
    assert again.encode(text) == ids and os.path.basename(p) == "tokenizer.json"
    assert HFTokenizer(get_tokenizer(600, corpus=docs)).fingerprint == tok.fingerprint
    # a corpus too small to fill the ranks: placeholders pad the BPE part, specials stay at the top
    small = HFTokenizer(get_tokenizer(1024, corpus=["hello hello world", "more words here"]))
    assert small.vocab_size == 1024 and small.bos_id == 768 and small.pad_id == 1023
    assert small.decode(small.encode("hello there")) == "hello there"


def test_default_pipeline_tiny_vocab():
    """The real thing: builtin corpus, 8192-token BPE, cached tokens, loaders."""
    import time
    t0 = time.time()
    data = build_data(vocab_size=8192, seq_len=256, batch_size=4, seed=0)
    assert time.time() - t0 < 30
    tok = data.tokenizer
    assert tok.vocab_size == 8192 and tok.bos_id == 7936 and tok.eos_id == 7938 and tok.pad_id == 8191
    assert tok.decode(tok.encode("The quick brown fox.")) == "The quick brown fox."
    b = data.train.next_batch()
    assert b["input_ids"].shape == (1, 1024) and int(b["input_ids"].max()) < 8192
    assert (b["input_ids"][0] == tok.eod_id).sum() >= 0
    v = next(iter(data.val))
    assert v["input_ids"].shape == (1, 1024)
    # second start-up hits every cache
    t0 = time.time()
    data2 = build_data(vocab_size=8192, seq_len=256, batch_size=4, seed=0)
    assert time.time() - t0 < 5
    assert torch.equal(data2.train.next_batch()["input_ids"], b["input_ids"])
    tr, va = load_corpus()
    toks, offs = tokenize_documents(tok, va)
    assert offs[-1] == len(toks) == data.val.num_tokens and (toks[offs[1:] - 1] == tok.eod_id).all()


# ----------------------------------------------------------------------------------------------- schedule

def test_context_stages_and_token_constancy():
    total = 1000
    assert stage_boundaries(total, TINY_STAGES) == [0, 600, 900]
    assert stage_at(0, total) == (0, 256) and stage_at(599, total) == (0, 256)
    assert stage_at(600, total) == (1, 1024) and stage_at(899, total) == (1, 1024)
    assert stage_at(900, total) == (2, 4096) and stage_at(5000, total) == (2, 4096)
    sch = ContextSchedule(total_steps=total, tokens_per_step=16384)
    shapes = {sch.shape_at(s) for s in range(total)}
    assert shapes == {(256, 64), (1024, 16), (4096, 4)}
    assert {a * b for a, b in shapes} == {16384}
    assert batch_rows(16384, 4096) == 4
    with pytest.raises(K3ConfigError):
        batch_rows(2048, 4096)
    with pytest.raises(K3ConfigError):
        ContextSchedule(total_steps=10, tokens_per_step=2048)
    assert stage_at(50, 100, [(8, 2), (16, 2)]) == (1, 16)  # shares are normalised


def test_cosine_with_warmup():
    f = cosine_with_warmup(10, 110, min_lr_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    vals = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
    for _ in range(60):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * 0.55)
