"""SFT set, assistant-only masks, packing with cu_seqlens, chats.jsonl errors."""
import json

import pytest
import torch

from k3.chat import render_messages_with_mask
from k3.rl.sft_data import (IGNORE_INDEX, SFTDataError, SFTLoader, builtin_sft_set, encode_chat, load_chats,
                            pack_rows)


def test_builtin_set_is_deterministic_and_expert_correct():
    a = builtin_sft_set(3)
    b = builtin_sft_set(3)
    assert a == b and len(a) == 9
    roles = [m["role"] for m in a[0]["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]


def test_mask_covers_only_assistant_tokens(toy_tok):
    chat = builtin_sft_set(1, tasks=["multi-tool"])[0]
    e = encode_chat(chat, toy_tok)
    assert len(e.ids) == len(e.mask) == len(e.labels)
    # decode the masked spans: they are exactly the assistant turns' outputs, tool results are not in them
    spans, cur = [], []
    for i, m in zip(e.ids, e.mask):
        if m:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    n_assist = sum(m["role"] == "assistant" for m in chat["messages"])
    assert len(spans) == n_assist
    eom = toy_tok.eos_id
    for s in spans:
        text = toy_tok.decode(s)
        assert s[-1] == eom and text.startswith("<|open|>response<|sep|>")
        assert 'role="tool"' not in text and 'role="user"' not in text and "system" not in text
    tool_results = [m["content"] for m in chat["messages"] if m["role"] == "tool"]
    masked_text = "".join(toy_tok.decode(s) for s in spans)
    assert "get_price" in masked_text and "calculator" in masked_text
    # the full text minus masked tokens still holds the tool results
    unmasked = toy_tok.decode([i for i, m in zip(e.ids, e.mask) if not m])
    for r in tool_results:
        assert f'index="1"<|sep|>{r}<|close|>message' in unmasked
    # labels: aligned targets on assistant tokens only
    for t in range(len(e.ids) - 1):
        assert e.labels[t] == (e.ids[t + 1] if e.mask[t + 1] else IGNORE_INDEX)
    assert e.labels[-1] == IGNORE_INDEX
    ids, mask = render_messages_with_mask(chat["messages"], chat["tools"], thinking=False, tokenizer=toy_tok)
    assert ids == e.ids and mask == e.mask


def test_packing_cu_seqlens(toy_tok):
    chats = builtin_sft_set(4, tasks=["calculator"])
    loader = SFTLoader(chats, toy_tok, seq_len=1400, batch_size=2, seed=1)
    b = loader.next_batch()
    ids, lab, cu = b["input_ids"], b["labels"], b["cu_seqlens"]
    assert ids.shape == lab.shape == (1, 2800) and cu.dtype == torch.int32
    assert cu[0] == 0 and cu[-1] == 2800 and 1400 in cu.tolist()
    # no label crosses a segment boundary; every segment end is ignored
    for e in cu[1:].tolist():
        assert lab[0, e - 1] == IGNORE_INDEX
    n_lab = int((lab != IGNORE_INDEX).sum())
    assert 0 < n_lab < 2800
    # resume is exact
    st = loader.state_dict()
    nxt = loader.next_batch()
    l2 = SFTLoader(chats, toy_tok, seq_len=1400, batch_size=2, seed=1)
    l2.load_state_dict(st)
    again = l2.next_batch()
    assert all(torch.equal(nxt[k], again[k]) for k in nxt)


def test_pack_truncates_long_chats(toy_tok):
    e = encode_chat(builtin_sft_set(1, tasks=["kv-lookup"])[0], toy_tok)
    rows_i, rows_l, starts, trunc = pack_rows([e], 200, toy_tok.pad_id)
    assert trunc == 1 and len(rows_i) == 1 and rows_l[0][-1] == IGNORE_INDEX


def test_load_chats_errors_name_line(tmp_path, toy_tok):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    p = tmp_path / "chats.jsonl"
    p.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n")
    assert len(load_chats(str(p))) == 2
    p.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(SFTDataError, match=r"chats\.jsonl:2: invalid JSON"):
        load_chats(str(p))
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    with pytest.raises(SFTDataError, match=r":1: no assistant message"):
        load_chats(str(p))
    p.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(SFTDataError, match=r":1: messages\[0\] needs a role"):
        load_chats(str(p))
    p.write_text(json.dumps([1, 2]) + "\n")
    with pytest.raises(SFTDataError, match=r":1: must be a JSON object"):
        load_chats(str(p))
    with pytest.raises(SFTDataError, match="not found"):
        load_chats(str(tmp_path / "missing.jsonl"))
    bad = {"messages": [{"role": "assistant", "content": 3}]}
    with pytest.raises(SFTDataError, match="conversation 0: .*content must be"):
        SFTLoader([bad], toy_tok, 64, 1)


def test_sft_batch_trains_tiny_model(toy_tok, make_tiny_model):
    model = make_tiny_model(toy_tok.vocab_size, toy_tok.eos_id, toy_tok.pad_id, toy_tok.bos_id)
    b = SFTLoader(builtin_sft_set(2, tasks=["calculator"]), toy_tok, seq_len=700, batch_size=1).next_batch()
    out = model(**b)
    assert torch.isfinite(out.loss) and int(out.num_tokens) == int((b["labels"] != IGNORE_INDEX).sum()) > 0
