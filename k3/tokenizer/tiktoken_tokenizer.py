"""K3's released tokenizer format: ``tiktoken.model`` + 256 special slots (architecture.md §6)."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

from k3.errors import TokenizerError
from k3.tokenizer.base import (BOS, END_OF_MSG, NUM_SPECIAL_SLOTS, PAD, UNK, K3TokenizerBase,
                               k3_special_tokens)
from k3.tokenizer.bpe import (K3_PAT_STR, PurePythonBPE, fix_surrogates, read_tiktoken_model,
                              split_long_text, write_tiktoken_model)

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"


def _read_added_tokens(config_path: str) -> Dict[int, str]:
    try:
        with open(config_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError as e:
        raise TokenizerError(f"cannot read {config_path}: {e}") from e
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{config_path}: invalid JSON: {e}") from e
    dec = cfg.get("added_tokens_decoder") or {}
    if not isinstance(dec, dict):
        raise TokenizerError(f"{config_path}: added_tokens_decoder must be an object")
    out: Dict[int, str] = {}
    for k, v in dec.items():
        try:
            i = int(k)
        except ValueError:
            raise TokenizerError(f"{config_path}: added_tokens_decoder key {k!r} is not an id") from None
        name = v.get("content") if isinstance(v, dict) else v
        if not isinstance(name, str) or not name:
            raise TokenizerError(f"{config_path}: added_tokens_decoder[{k}] has no string 'content'")
        out[i] = name
    return out


class K3TiktokenTokenizer(K3TokenizerBase):
    """Byte-level BPE from a tiktoken-format rank file (ranks 0..n-1), specials at ids n..n+255.

    ``backend``: "auto" (tiktoken if importable, else pure Python), "tiktoken" or "python". Both
    produce identical ids. ``config_path`` defaults to ``tokenizer_config.json`` beside the rank
    file if present; its ``added_tokens_decoder`` renames special slots (ids outside the 256-slot
    block are rejected, since the model has no rows for them).
    """

    def __init__(self, path: str, config_path: Optional[str] = None, backend: str = "auto"):
        if os.path.isdir(path):
            path = os.path.join(path, TIKTOKEN_FILE)
        if not os.path.isfile(path):
            raise TokenizerError(f"tiktoken file not found: {path}")
        self.path = path
        self.ranks = read_tiktoken_model(path)
        n = len(self.ranks)
        self.num_base_tokens = n
        if config_path is None:
            cand = os.path.join(os.path.dirname(os.path.abspath(path)), CONFIG_FILE)
            config_path = cand if os.path.isfile(cand) else None
        overrides: Dict[int, str] = {}
        if config_path is not None:
            overrides = _read_added_tokens(config_path)
            bad = [i for i in overrides if not n <= i < n + NUM_SPECIAL_SLOTS]
            if bad:
                raise TokenizerError(
                    f"{config_path}: added token id {bad[0]} ({overrides[bad[0]]!r}) is outside the special "
                    f"slots [{n}, {n + NUM_SPECIAL_SLOTS}) of {path}")
        self.config_path = config_path
        self._init_specials(k3_special_tokens(n, overrides))
        self._decoder: Dict[int, bytes] = {r: b for b, r in self.ranks.items()}
        self._pure: Optional[PurePythonBPE] = None
        self._tk = None
        if backend not in ("auto", "tiktoken", "python"):
            raise TokenizerError(f"unknown tokenizer backend {backend!r} (auto|tiktoken|python)")
        if backend in ("auto", "tiktoken"):
            try:
                import tiktoken
            except ImportError:
                if backend == "tiktoken":
                    raise TokenizerError("backend='tiktoken' but the tiktoken package is not installed") from None
            else:
                self._tk = tiktoken.Encoding(name=f"k3:{os.path.basename(path)}", pat_str=K3_PAT_STR,
                                             mergeable_ranks=self.ranks, special_tokens=self._special_to_id)
        if self._tk is None:
            self._pure = PurePythonBPE(self.ranks, K3_PAT_STR)
        self.backend = "tiktoken" if self._tk is not None else "python"

    @property
    def vocab_size(self) -> int:
        return self.num_base_tokens + NUM_SPECIAL_SLOTS

    def _encode_ordinary(self, text: str) -> List[int]:
        text = fix_surrogates(text)
        enc = self._tk.encode_ordinary if self._tk is not None else self._pure.encode_ordinary
        if len(text) <= 25_000:  # fast path: no window or run split can apply
            return enc(text)
        out: List[int] = []
        for piece in split_long_text(text):
            out.extend(enc(piece))
        return out

    def decode_bytes(self, ids) -> bytes:
        """Raw bytes of ordinary ids (special ids contribute their UTF-8 names)."""
        out = bytearray()
        for i in ids:
            i = int(i)
            b = self._decoder.get(i)
            if b is None:
                s = self._id_to_special.get(i)
                if s is None:
                    raise TokenizerError(f"token id {i} out of range [0, {self.vocab_size})")
                b = s.encode()
            out += b
        return bytes(out)

    def _decode_ordinary(self, ids: List[int]) -> str:
        d = self._decoder
        return b"".join(d[i] for i in ids).decode("utf-8", errors="replace")

    def _ordinary_token_to_id(self, token: str) -> Optional[int]:
        return self.ranks.get(token.encode("utf-8"))

    def _ordinary_id_to_token(self, token_id: int) -> str:
        return self._decoder[token_id].decode("utf-8", errors="backslashreplace")

    def save(self, directory: str) -> None:
        """Write ``tiktoken.model`` and a ``tokenizer_config.json`` naming all 256 special slots."""
        os.makedirs(directory, exist_ok=True)
        write_tiktoken_model(self.ranks, os.path.join(directory, TIKTOKEN_FILE))
        dec = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
               for i, s in sorted(self._id_to_special.items())}
        cfg = {"added_tokens_decoder": dec, "bos_token": BOS, "eos_token": END_OF_MSG,
               "pad_token": PAD, "tokenizer_class": "TikTokenTokenizer", "k3_tokenizer": "tiktoken"}
        if UNK in self._special_to_id:
            cfg["unk_token"] = UNK
        with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=1, ensure_ascii=False)

    def __repr__(self) -> str:
        return (f"K3TiktokenTokenizer(path={self.path!r}, vocab_size={self.vocab_size}, "
                f"backend={self.backend!r})")
