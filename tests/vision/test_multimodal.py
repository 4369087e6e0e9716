"""K3ForConditionalGeneration: placeholder expansion (ids, labels, cu_seqlens) vs written-out loops, count errors,
released-key save/load round trip, text-only == K3ForCausalLM, several images == one at a time, generation."""
import json
import os

import pytest
import torch

from k3.config import K3Config
from k3.errors import CheckpointError, K3ConfigError
from k3.model import K3ForCausalLM
from k3.multimodal import (K3ForConditionalGeneration, expand_placeholders, generate, media_placeholder_id,
                           multimodal_config, vision_config_of)
from k3.vision import K3ImageError, VisionConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IGN = -100


@pytest.fixture(scope="module")
def mm_cfg():
    from tests.conftest import _MICRO_MODEL
    text = K3Config.from_preset("tiny", **_MICRO_MODEL)
    return multimodal_config(text, "tiny")


@pytest.fixture(scope="module")
def mm(mm_cfg):
    torch.manual_seed(0)
    return K3ForConditionalGeneration(mm_cfg).eval()


def _images(*grids, seed=0):
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor(grids, dtype=torch.long).view(-1, 3)
    n = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    return torch.randn(n, 3, 14, 14, generator=g), grid


# ------------------------------------------------------------------------------------------------ config
def test_config_container(mm_cfg):
    assert mm_cfg.container["model_type"] == "kimi_k3"
    assert mm_cfg.container["architectures"] == ["KimiK3ForConditionalGeneration"]
    # <|media_pad|> slot: V - 256 + 21 (163605 at release)
    assert media_placeholder_id(mm_cfg) == mm_cfg.vocab_size - 256 + 21
    assert vision_config_of(mm_cfg).text_hidden_size == mm_cfg.hidden_size
    rel = multimodal_config("kimi-k3")
    assert media_placeholder_id(rel) == 163605 and vision_config_of(rel) == VisionConfig()
    assert rel.to_dict() == K3Config.from_preset("kimi-k3").to_dict()  # the released container, unchanged
    tiny = multimodal_config("tiny")
    assert vision_config_of(tiny).text_hidden_size == tiny.hidden_size == 256
    with pytest.raises(K3ConfigError, match="no `vision_config`"):
        K3ForConditionalGeneration(K3Config.from_preset("tiny"))
    bad = multimodal_config("tiny")
    bad.container["vision_config"]["text_hidden_size"] = 128
    with pytest.raises(K3ConfigError, match="text_hidden_size"):
        K3ForConditionalGeneration(bad)


def test_released_module_names(mm):
    keys = set(mm.state_dict())
    assert "vision_tower.patch_embed.proj.weight" in keys
    assert "vision_tower.encoder.blocks.1.wqkv.weight" in keys
    assert "mm_projector.proj.0.weight" in keys and "mm_projector.post_norm.weight" in keys
    assert "language_model.model.embed_tokens.weight" in keys and "language_model.lm_head.weight" in keys
    assert all(k.split(".")[0] in ("vision_tower", "mm_projector", "language_model") for k in keys)


# ------------------------------------------------------------------------------------------------ expansion
def _expand_loop(ids, counts, pid, pad, labels=None, cu=None):
    """Written-out reference: one row at a time, token by token."""
    out_ids, out_lab, k = [], [], 0
    new_pos = []  # row 0: new start position of each old position
    for b, row in enumerate(ids.tolist()):
        r_ids, r_lab = [], []
        for t, tok in enumerate(row):
            if b == 0:
                new_pos.append(len(r_ids))
            if tok == pid:
                n = counts[k]
                k += 1
                r_ids += [pid] * n
                if labels is not None:
                    lab = labels[b, t].item()
                    r_lab += [IGN] * (n - 1) + [IGN if lab == pid else lab]
            else:
                r_ids.append(tok)
                if labels is not None:
                    lab = labels[b, t].item()
                    r_lab.append(IGN if lab == pid else lab)
        if b == 0:
            new_pos.append(len(r_ids))
        out_ids.append(r_ids)
        out_lab.append(r_lab)
    T = max(len(r) for r in out_ids)
    out_ids = [r + [pad] * (T - len(r)) for r in out_ids]
    out_lab = [r + [IGN] * (T - len(r)) for r in out_lab]
    new_cu = [new_pos[c] for c in cu.tolist()] if cu is not None else None
    return out_ids, out_lab, new_cu


def test_expansion_matches_loop_packed():
    pid, pad = 50, 99
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (1, 30), generator=g)
    ph = [0, 3, 4, 11, 17, 29]  # at a document start, adjacent placeholders, at the very end
    ids[0, ph] = pid
    counts = [4, 1, 6, 2, 9, 3]
    labels = torch.roll(ids, -1, 1)
    labels[0, -1] = IGN
    labels[0, 7] = IGN
    cu = torch.tensor([0, 3, 11, 12, 20, 30], dtype=torch.int32)
    exp = expand_placeholders(ids, counts, pid, pad, labels, cu)
    r_ids, r_lab, r_cu = _expand_loop(ids, counts, pid, pad, labels, cu)
    assert exp.input_ids.tolist() == r_ids
    assert exp.labels.tolist() == r_lab
    assert exp.cu_seqlens.tolist() == r_cu and exp.cu_seqlens.dtype == torch.int32
    assert exp.image_mask.sum().item() == sum(counts)
    assert exp.input_ids.shape[1] == 30 + sum(c - 1 for c in counts)
    # the placeholder's own target moves to the image's last position; a target equal to pid is dropped
    assert labels[0, 2].item() == pid and exp.labels[0, 4 + 1].item() == IGN  # old 2 -> new 5 (image 0 is 4 long)
    assert exp.labels[0, 3].item() == labels[0, 0].item()  # image 0's last position keeps the placeholder's target


def test_expansion_matches_loop_batch():
    pid, pad = 50, 99
    ids = torch.tensor([[1, pid, 2, 3, pid, 4], [5, 6, 7, pid, 8, 9]])
    labels = torch.tensor([[pid, 2, 3, pid, 4, IGN], [6, 7, pid, 8, 9, IGN]])
    counts = [3, 2, 5]
    exp = expand_placeholders(ids, counts, pid, pad, labels)
    r_ids, r_lab, _ = _expand_loop(ids, counts, pid, pad, labels)
    assert exp.input_ids.tolist() == r_ids and exp.labels.tolist() == r_lab
    assert exp.lengths == [9, 10]
    assert exp.input_ids[0, -1].item() == pad  # row 0 padded to row 1's length


def test_count_errors(mm):
    pid = mm.media_placeholder_token_id
    ids = torch.tensor([[1, pid, 2, pid]])
    pv, grid = _images((1, 2, 2))
    with pytest.raises(K3ImageError, match="2 media placeholder.*1 image"):
        mm(ids, pv, grid)
    with pytest.raises(K3ImageError, match="0 media placeholder.*1 image"):
        mm(torch.tensor([[1, 2, 3]]), pv, grid)
    with pytest.raises(K3ImageError, match="1 media placeholder.*0 image"):
        mm(torch.tensor([[1, pid, 3]]))
    with pytest.raises(K3ImageError, match=r"grid_thw: expected an integer tensor \[n_images, 3\]"):
        mm(torch.tensor([[1, pid]]), pv, grid[0])
    with pytest.raises(K3ImageError, match="integer dtype"):
        mm(torch.tensor([[1, pid]]), pv, grid.float())
    with pytest.raises(K3ImageError, match="4 patch rows but grid_thw describes 8"):
        mm(torch.tensor([[1, pid]]), pv, torch.tensor([[1, 2, 4]]))
    with pytest.raises(K3ImageError, match="together"):
        mm(torch.tensor([[1, pid]]), pv, None)
    with pytest.raises(K3ImageError, match=r"pixel_values: expected a tensor \[L, 3, 14, 14\]"):
        mm(torch.tensor([[1, pid]]), pv[:, :, :7], grid)
    with pytest.raises(K3ImageError, match="multiples of the merge kernel"):
        mm(torch.tensor([[1, pid]]), torch.randn(3, 3, 14, 14), torch.tensor([[1, 1, 3]]))
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        mm(torch.tensor([[1, pid, 2]]), pv, grid, cu_seqlens=torch.tensor([0, 2]))


# ------------------------------------------------------------------------------------------------ equivalences
def test_text_only_equals_causal_lm(mm):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 700, (2, 24), generator=g)
    ref = mm.language_model(ids)
    out = mm(ids)
    assert torch.equal(out.logits, ref.logits)
    # a separately built K3ForCausalLM with the same weights (the lm is a plain K3ForCausalLM)
    lm = K3ForCausalLM(mm.config).eval()
    lm.load_state_dict(mm.language_model.state_dict())
    assert torch.equal(lm(ids).logits, out.logits)
    # packed + labels: same loss, same count
    ids1 = ids[:1]
    labels = torch.roll(ids1, -1, 1)
    labels[0, -1] = IGN
    cu = torch.tensor([0, 10, 24])
    a = mm(ids1, labels=labels, cu_seqlens=cu)
    b = mm.language_model(ids1, labels=labels, cu_seqlens=cu)
    assert torch.equal(a.loss, b.loss) and int(a.num_tokens) == int(b.num_tokens)


def test_pad_embeddings_zeroed(mm):
    pad = mm.config.pad_token_id
    ids = torch.tensor([[3, 4, 5, 6, pad, pad]])
    emb, _ = mm.embed(ids)
    assert torch.count_nonzero(emb[0, 4:]) == 0 and torch.count_nonzero(emb[0, :4]) > 0
    # causal: the positions before the right padding are untouched
    torch.testing.assert_close(mm(ids).logits[:, :4], mm.language_model(ids).logits[:, :4], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(mm(ids).logits[:, 4:], mm.language_model(ids).logits[:, 4:])


def test_several_images_equal_one_at_a_time(mm):
    pid = mm.media_placeholder_token_id
    pv, grid = _images((1, 4, 2), (1, 2, 6), (1, 2, 2), seed=3)
    ids = torch.tensor([[7, pid, 8, 9, pid, pid, 10]])
    out = mm(ids, pv, grid)
    # written out: encode each image alone and splice its tokens in place of its placeholder
    emb_tok = mm.language_model.model.embed_tokens
    rows, s = [], 0
    k = 0
    sizes = [int(t * h * w) for t, h, w in grid.tolist()]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for tok in ids[0].tolist():
        if tok == pid:
            f, counts = mm.encode_images(pv[starts[k]:starts[k] + sizes[k]], grid[k:k + 1])
            assert counts == [grid[k, 1].item() // 2 * grid[k, 2].item() // 2]
            rows.append(f)
            k += 1
        else:
            rows.append(emb_tok(torch.tensor([tok])))
    manual = torch.cat(rows, 0)[None]
    ref = mm.language_model(inputs_embeds=manual)
    assert out.input_ids.shape[1] == manual.shape[1] == 4 + 2 + 3 + 1
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    # and two prompts in a batch == each prompt alone (images row-major over the batch)
    ids2 = torch.tensor([[7, pid, 8], [9, pid, pid]])
    both = mm(ids2, pv, grid)
    first = mm(ids2[:1], pv[:8], grid[:1])
    second = mm(ids2[1:], pv[8:], grid[1:])
    torch.testing.assert_close(both.logits[0, :first.logits.shape[1]], first.logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both.logits[1], second.logits[0], rtol=1e-5, atol=1e-5)


def test_image_training_step_and_labels(mm_cfg):
    torch.manual_seed(0)
    m = K3ForConditionalGeneration(mm_cfg).train()
    pid = m.media_placeholder_token_id
    pv, grid = _images((1, 2, 4))
    ids = torch.tensor([[5, pid, 6, 7, 8]])
    labels = torch.tensor([[pid, 6, 7, 8, IGN]])
    out = m(ids, pv, grid, labels=labels)
    # 2 image tokens: first -> -100, last predicts 6; the target `pid` of position 0 is dropped
    assert out.labels.tolist() == [[IGN, IGN, 6, 7, 8, IGN]]
    assert int(out.num_tokens) == 3
    out.loss.backward()
    assert m.vision_tower.patch_embed.proj.weight.grad.abs().sum() > 0
    assert m.mm_projector.proj[0].weight.grad.abs().sum() > 0


def test_image_training_with_mtp_reports_its_losses(mm_cfg):
    """With MTP blocks the multimodal output carries the language model's next-token and per-depth losses (what the
    trainer logs), and loss = main_loss + mtp_loss_weight * mean(mtp_losses), as for text."""
    from tests.conftest import _MICRO_MODEL
    cfg = multimodal_config(K3Config.from_preset("tiny", **_MICRO_MODEL, num_nextn_predict_layers=2), "tiny")
    torch.manual_seed(0)
    m = K3ForConditionalGeneration(cfg).train()
    pid = m.media_placeholder_token_id
    pv, grid = _images((1, 2, 4))
    ids = torch.tensor([[5, pid, 6, 7, 8, 9, 10]])
    out = m(ids, pv, grid, labels=torch.roll(ids, -1, 1))
    assert out.main_loss is not None and out.mtp_losses is not None and out.mtp_losses.shape == (2,)
    want = out.main_loss + cfg.mtp_loss_weight * out.mtp_losses.mean()
    assert torch.allclose(out.loss, want, rtol=1e-6, atol=0)
    ref = m.language_model(inputs_embeds=m.embed(ids, pv, grid)[0], labels=out.labels)
    assert torch.equal(out.mtp_losses, ref.mtp_losses) and torch.equal(out.main_loss, ref.main_loss)


def test_always_run_tower_without_images(mm_cfg):
    """FSDP note: a rank without images must still run the tower (same collectives as ranks with images)."""
    torch.manual_seed(0)
    m = K3ForConditionalGeneration(mm_cfg).train()
    ids = torch.tensor([[5, 6, 7, 8]])
    labels = torch.tensor([[6, 7, 8, IGN]])
    ref = m(ids, labels=labels).loss
    m.always_run_tower = True
    out = m(ids, labels=labels)
    assert torch.equal(out.loss, ref)
    out.loss.backward()
    for n, p in list(m.vision_tower.named_parameters()) + list(m.mm_projector.named_parameters()):
        assert p.grad is not None, n
        assert torch.count_nonzero(p.grad) == 0, n


# ------------------------------------------------------------------------------------------------ checkpoint
def test_save_load_released_keys(mm, tmp_path):
    d = str(tmp_path / "ckpt")
    mm.save_pretrained(d, max_shard_size="300KB")
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "kimi_k3" and "text_config" in cfg
    assert cfg["vision_config"] == mm.vision_config.to_dict()
    assert cfg["media_placeholder_token_id"] == mm.media_placeholder_token_id
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        keys = set(json.load(f)["weight_map"])
    vis = {k for k in mm.state_dict() if not k.startswith("language_model.")}
    assert vis <= keys
    assert "language_model.model.embed_tokens.weight" in keys
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" in keys  # released expert layout
    assert all(k.split(".")[0] in ("vision_tower", "mm_projector", "language_model") for k in keys)
    m2 = K3ForConditionalGeneration.from_pretrained(d)
    sd1, sd2 = mm.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    pid = mm.media_placeholder_token_id
    pv, grid = _images((1, 2, 2))
    ids = torch.tensor([[3, pid, 4]])
    assert torch.equal(mm(ids, pv, grid).logits, m2(ids, pv, grid).logits)
    # a text-only load of the same directory keeps working (vision keys skipped)
    lm = K3ForCausalLM.from_pretrained(d)
    assert torch.equal(lm(ids[:, :1]).logits, mm(ids[:, :1]).logits)


def test_load_errors(mm, tmp_path):
    import safetensors.torch as st
    d = str(tmp_path / "ckpt")
    mm.save_pretrained(d)
    shard = os.path.join(d, "model-00001-of-00001.safetensors")
    sd = st.load_file(shard)
    del sd["mm_projector.post_norm.weight"]
    sd["vision_tower.extra.weight"] = torch.zeros(2)
    st.save_file(sd, shard)
    idx = os.path.join(d, "model.safetensors.index.json")
    with open(idx) as f:
        index = json.load(f)
    index["weight_map"].pop("mm_projector.post_norm.weight")
    index["weight_map"]["vision_tower.extra.weight"] = "model-00001-of-00001.safetensors"
    with open(idx, "w") as f:
        json.dump(index, f)
    with pytest.raises(CheckpointError, match=r"(?s)missing keys.*mm_projector\.post_norm\.weight.*unexpected.*"
                                              r"vision_tower\.extra\.weight"):
        K3ForConditionalGeneration.from_pretrained(d)
    m = K3ForConditionalGeneration.from_pretrained(d, strict=False)  # warns, keeps the initial norm weight
    assert torch.equal(m.mm_projector.post_norm.weight, torch.ones_like(m.mm_projector.post_norm.weight))
    text_dir = str(tmp_path / "text")
    mm.language_model.save_pretrained(text_dir, config=K3Config.from_dict(mm.config.to_dict(text_only=True)))
    with pytest.raises(CheckpointError, match="text-only checkpoint"):
        K3ForConditionalGeneration.from_pretrained(text_dir)


# ------------------------------------------------------------------------------------------------ generation
def test_generate_with_images_matches_full_forward(mm):
    pid = mm.media_placeholder_token_id
    pv, grid = _images((1, 2, 4), (1, 2, 2), seed=5)
    prompt = [3, 4, pid, 5, pid, 6]
    out = generate(mm, prompt, pixel_values=pv, grid_thw=grid, max_new_tokens=4, stop_token_ids=[], return_dict=True)
    assert out.prompt_lengths == [len(prompt)] and out.sequences[0, :len(prompt)].tolist() == prompt
    # reference: greedy with a full multimodal forward per step (no cache)
    seq = list(prompt)
    for _ in range(4):
        logits = mm(torch.tensor([seq]), pv, grid).logits[0, -1]
        seq.append(int(logits.argmax()))
    assert out.new_tokens[0] == seq[len(prompt):]
    with pytest.raises(K3ImageError, match="2 media placeholder.*1 image"):
        generate(mm, prompt, pixel_values=pv[:8], grid_thw=grid[:1], max_new_tokens=1)


def _greedy_reference(mm, prompt, pv, grid, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(mm(torch.tensor([seq]), pv, grid).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_generate_images_batch_chunked_and_no_cache(mm):
    """Two ragged prompts with their own images, the prefill chunked across the image positions, and the
    no-cache path: all equal one full multimodal forward per step."""
    pid = mm.media_placeholder_token_id
    pv, grid = _images((1, 2, 4), (1, 2, 2), (1, 4, 2), seed=7)
    a, b = [3, pid, 5, pid, 6], [7, 8, pid, 9]
    n0 = 2 * 4 + 2 * 2
    ref_a = _greedy_reference(mm, a, pv[:n0], grid[:2], 3)
    ref_b = _greedy_reference(mm, b, pv[n0:], grid[2:], 3)
    for kw in (dict(prefill_chunk_size=2), dict(prefill_chunk_size=None), dict(use_cache=False)):
        out = generate(mm, [a, b], pixel_values=pv, grid_thw=grid, max_new_tokens=3, stop_token_ids=[],
                       return_dict=True, **kw)
        assert out.new_tokens == [ref_a, ref_b], kw
        assert out.prompt_lengths == [len(a), len(b)]


def test_prompt_embeds_text_path_and_errors(mm):
    """prompt_embeds = the ids' own embeddings gives the plain text result; a hook works too; bad shapes fail."""
    from k3.errors import RequestError
    from k3.generation import generate as text_generate
    lm = mm.language_model
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    ref = text_generate(lm, prompts, 3, stop_token_ids=[], return_dict=True).new_tokens
    with torch.no_grad():
        embeds = [lm.model.embed_tokens(torch.tensor(p)) for p in prompts]
    got = text_generate(lm, prompts, 3, stop_token_ids=[], return_dict=True, prompt_embeds=embeds,
                        prefill_chunk_size=2).new_tokens
    assert got == ref
    calls = []

    def hook(ids, rows, start):
        calls.append((tuple(rows), start, ids.shape[1]))
        return lm.model.embed_tokens(ids)
    assert text_generate(lm, prompts, 3, stop_token_ids=[], return_dict=True, prompt_embeds=hook).new_tokens == ref
    assert calls == [((0,), 0, 4), ((1,), 0, 3)]
    with pytest.raises(RequestError, match=r"prompt_embeds\[1\]: expected \[3, "):
        text_generate(lm, prompts, 1, prompt_embeds=[embeds[0], embeds[0]])
    with pytest.raises(RequestError, match="1 tensor"):
        text_generate(lm, prompts, 1, prompt_embeds=embeds[:1])


def test_reset_parameters_reinitialises_every_part(mm_cfg):
    """reset_parameters (what k3.parallel's materialize(init=True) calls on the shards): the language model's own
    init, vision norms 1, the position table within its uniform bound, linears within torch's default bound."""
    torch.manual_seed(0)
    m = K3ForConditionalGeneration(mm_cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(7.0)
    torch.manual_seed(1)
    m.reset_parameters()
    m.requires_grad_(False)
    assert not any(bool((p == 7.0).all()) for p in m.parameters() if p.numel() > 1)
    vt = m.vision_tower
    assert bool((vt.encoder.final_layernorm.weight == 1).all()) and bool((m.mm_projector.post_norm.weight == 1).all())
    assert float(vt.patch_embed.pos_emb.weight.abs().max()) <= 0.02 * 3 ** 0.5
    w = vt.encoder.blocks[0].wqkv.weight
    assert float(w.abs().max()) <= 1 / w.shape[1] ** 0.5 + 1e-6 and float(w.std()) > 0
    torch.manual_seed(1)
    lm = K3ForCausalLM(mm_cfg)
    torch.manual_seed(1)
    lm.reset_parameters()
    torch.testing.assert_close(m.language_model.state_dict(), lm.state_dict())
