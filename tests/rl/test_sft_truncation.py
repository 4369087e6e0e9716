"""Conversations longer than the SFT row length: what is lost is counted and warned about, and the default row
length of `k3 sft` holds every built-in task's conversation whole."""
import logging

from k3.rl.sft_data import IGNORE_INDEX, SFTLoader, builtin_sft_set, encode_chat, pack_rows, truncation_loss


def test_truncation_loss_counts_the_cut_answers(toy_tok):
    chats = builtin_sft_set(2, tasks=["calculator", "multi-tool"])
    enc = [encode_chat(c, toy_tok) for c in chats]
    lengths = sorted(len(e.ids) for e in enc)
    seq = lengths[0] + 1                      # the shortest fits, every longer one is cut
    t = truncation_loss(enc, seq)
    assert t["cut"] == sum(n > seq for n in lengths) > 0 and t["longest"] == lengths[-1]
    # written out: the supervised targets pack_rows drops (positions >= seq - 1 of each cut conversation)
    kept = sum(int((lab != IGNORE_INDEX).sum()) for lab in pack_rows(enc, seq, toy_tok.pad_id)[1])
    assert t["lost_targets"] == t["targets"] - kept > 0
    assert truncation_loss(enc, lengths[-1]) == dict(t, cut=0, lost_targets=0)


def test_loader_warns_with_the_length_to_use(toy_tok, caplog):
    chats = builtin_sft_set(2, tasks=["multi-tool"])
    longest = max(len(encode_chat(c, toy_tok).ids) for c in chats)
    with caplog.at_level(logging.WARNING, logger="k3.train"):
        SFTLoader(chats, toy_tok, seq_len=longest - 10, batch_size=1)
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "2 of 2 conversations are longer than the row length" in msg and f"at least {longest}" in msg
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="k3.train"):
        SFTLoader(chats, toy_tok, seq_len=longest, batch_size=1)
    assert not caplog.records


def test_k3_sft_default_rows_hold_every_builtin_conversation(toy_tok):
    from k3.train.cli import SFT_DEFAULTS
    seq = SFT_DEFAULTS["stages"][0][0]
    enc = [encode_chat(c, toy_tok) for c in builtin_sft_set(3)]
    assert truncation_loss(enc, seq)["cut"] == 0, max(len(e.ids) for e in enc)
