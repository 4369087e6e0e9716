"""Wrapper giving a HuggingFace `tokenizers` tokenizer.json the k3 tokenizer interface.

Expected layout (the k3 training tokenizer): ordinary tokens [0, V-256), the 256 K3 special names
at [V-256, V) as *special* added tokens (see k3_special_tokens). Only the special names that
the interface needs ([BOS], [EOS], <|end_of_msg|>, [PAD]) are required to exist.
"""
from __future__ import annotations

import os
import shutil
from typing import List, Optional

from k3.errors import TokenizerError
from k3.tokenizer.base import K3TokenizerBase

HF_FILE = "tokenizer.json"


class HFTokenizerWrapper(K3TokenizerBase):
    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise TokenizerError("loading tokenizer.json needs the `tokenizers` package") from e
        if os.path.isdir(path):
            path = os.path.join(path, HF_FILE)
        if not os.path.isfile(path):
            raise TokenizerError(f"tokenizer.json not found: {path}")
        self.path = path
        try:
            # two instances: one recognizes special tokens in text, one treats them as ordinary text
            self._tok = Tokenizer.from_file(path)
            self._plain = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise TokenizerError(f"cannot load {path}: {e}") from e
        for t in (self._tok, self._plain):
            t.no_padding()
            t.no_truncation()
        self._plain.encode_special_tokens = True
        specials = {tok.content: int(i) for i, tok in self._plain.get_added_tokens_decoder().items()
                    if tok.special}
        self._vocab_size = self._plain.get_vocab_size(with_added_tokens=True)
        self._init_specials(specials)

    @classmethod
    def from_tokenizer(cls, tokenizer, directory: str) -> "HFTokenizerWrapper":
        """Save a `tokenizers.Tokenizer` object into ``directory`` and wrap it."""
        os.makedirs(directory, exist_ok=True)
        p = os.path.join(directory, HF_FILE)
        tokenizer.save(p)
        return cls(p)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _encode_ordinary(self, text: str) -> List[int]:
        if not text:
            return []
        return self._plain.encode(text, add_special_tokens=False).ids

    def _decode_ordinary(self, ids: List[int]) -> str:
        return self._plain.decode(ids, skip_special_tokens=False)

    def _ordinary_token_to_id(self, token: str) -> Optional[int]:
        ids = self._encode_ordinary(token)
        if len(ids) == 1 and self._decode_ordinary(ids) == token:
            return ids[0]
        return self._plain.token_to_id(token)  # raw model-vocab form, e.g. "Ġworld"

    def _ordinary_id_to_token(self, token_id: int) -> str:
        return self._decode_ordinary([token_id])

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        dst = os.path.join(directory, HF_FILE)
        if os.path.abspath(dst) != os.path.abspath(self.path):
            shutil.copyfile(self.path, dst)

    def __repr__(self) -> str:
        return f"HFTokenizerWrapper(path={self.path!r}, vocab_size={self.vocab_size})"
