"""Write a tokenizer in K3's released format (architecture.md §6): ``tiktoken.model`` (base64 token + rank per line) and a
``tokenizer_config.json`` naming the 256 special slots, whatever the source tokenizer is.

* a ``K3TiktokenTokenizer`` is written as it is;
* a byte-level BPE ``tokenizer.json`` (the k3 training tokenizer: K3 split regex + ByteLevel, ordinary ids
  0..n-1, the 256 specials right after) is converted: each ordinary token's byte string gets its id as rank.
  That is the same BPE when merge priority follows id order (how `tokenizers` numbers merged tokens); the
  conversion re-encodes probe texts with both and raises ``TokenizerError`` on any difference.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional, Sequence

from k3.errors import TokenizerError
from k3.tokenizer.base import NUM_SPECIAL_SLOTS, K3TokenizerBase
from k3.tokenizer.bpe import write_tiktoken_model
from k3.tokenizer.tiktoken_tokenizer import CONFIG_FILE, TIKTOKEN_FILE, K3TiktokenTokenizer

__all__ = ["byte_level_decoder", "tiktoken_ranks", "save_release_tokenizer", "PROBE_TEXTS"]

PROBE_TEXTS = ("Hello world! It's 2026, isn't it?\n\n  indented\tand tabs",
               "def f(x):\n    return x ** 2  # comment\r\n",
               "Ünïcödé — 中文字符 and emoji 🙂 ok; numbers 1234567 3.14159",
               "   leading spaces, trailing spaces   \n\n\n")


def byte_level_decoder() -> Dict[str, int]:
    """The byte-level alphabet of GPT-2-style BPE vocabularies: printable char -> byte. Printable Latin-1 bytes
    map to themselves; the other 68 bytes map to code points 256, 257, ... in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def tiktoken_ranks(tok: K3TokenizerBase) -> Dict[bytes, int]:
    """``{token bytes: rank}`` of the ordinary tokens of ``tok`` (ids 0..n-1)."""
    if isinstance(tok, K3TiktokenTokenizer):
        return dict(tok.ranks)
    raw = getattr(tok, "_plain", None) or getattr(tok, "tokenizer", None)
    if raw is None or not hasattr(raw, "get_vocab"):
        raise TokenizerError(f"cannot export a {type(tok).__name__} as tiktoken.model (need a tiktoken or a "
                             f"byte-level BPE tokenizer.json)")
    specials = set(tok.special_tokens)
    vocab = {t: i for t, i in raw.get_vocab(with_added_tokens=True).items() if t not in specials}
    dec = byte_level_decoder()
    ranks: Dict[bytes, int] = {}
    for t, i in vocab.items():
        try:
            b = bytes(dec[c] for c in t)
        except KeyError:
            raise TokenizerError(f"token {t!r} (id {i}) is not byte-level BPE: cannot write it as tiktoken.model") \
                from None
        ranks[b] = i
    n = len(ranks)
    if sorted(ranks.values()) != list(range(n)):
        raise TokenizerError(f"ordinary token ids are not 0..{n - 1}: cannot write them as tiktoken ranks")
    bad = [i for i in tok.special_ids if not n <= i < n + NUM_SPECIAL_SLOTS]
    if bad:
        raise TokenizerError(f"special id {bad[0]} lies outside the 256 slots [{n}, {n + NUM_SPECIAL_SLOTS}) after "
                             f"the {n} ordinary tokens")
    return ranks


def save_release_tokenizer(tok: K3TokenizerBase, directory: str, extra_config: Optional[dict] = None,
                           probe_texts: Sequence[str] = PROBE_TEXTS) -> K3TiktokenTokenizer:
    """Write ``tiktoken.model`` + ``tokenizer_config.json`` (all 256 special names, bos / eos / pad / unk, plus
    ``extra_config`` keys, e.g. ``auto_map``) into ``directory``; returns the written tokenizer, loaded back.
    The written tokenizer must encode ``probe_texts`` exactly as ``tok`` does."""
    os.makedirs(directory, exist_ok=True)
    ranks = tiktoken_ranks(tok)
    path = os.path.join(directory, TIKTOKEN_FILE)
    write_tiktoken_model(ranks, path)
    cfg_path = os.path.join(directory, CONFIG_FILE)
    names = {i: name for name, i in tok.special_tokens.items()}
    with open(cfg_path, "w", encoding="utf-8") as f:  # the source's special names, read back by the loader
        json.dump({"added_tokens_decoder": {str(i): {"content": s} for i, s in sorted(names.items())}}, f)
    out = K3TiktokenTokenizer(path, config_path=cfg_path)
    out.save(directory)  # the full tokenizer_config.json (every slot, bos/eos/pad/unk)
    if extra_config:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        cfg.update(extra_config)
        with open(cfg_path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=1, ensure_ascii=False)
    out = K3TiktokenTokenizer(path, config_path=cfg_path)
    for text in probe_texts:
        a, b = tok.encode(text), out.encode(text)
        if a != b:
            raise TokenizerError(f"the exported tiktoken.model encodes {text[:40]!r} differently from the source "
                                 f"tokenizer ({b[:12]} vs {a[:12]}): not a plain byte-level BPE")
    for name in (tok.special_tokens):
        if out.special_tokens.get(name) != tok.special_tokens[name]:
            raise TokenizerError(f"special {name!r}: id {out.special_tokens.get(name)} after export, "
                                 f"{tok.special_tokens[name]} before")
    return out
