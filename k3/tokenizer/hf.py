"""Wrapper giving a HuggingFace `tokenizers` tokenizer.json the k3 tokenizer interface.

Expected layout (the k3 training tokenizer): ordinary tokens [0, V-256), the 256 K3 special names
at [V-256, V) as *special* added tokens (see k3_special_tokens). Only the special names that
the interface needs ([BOS], [EOS], <|end_of_msg|>, [PAD]) are required to exist.

The same class serves the training pipeline (``k3.train.data.HFTokenizer`` is a thin subclass):
it can wrap an in-memory ``tokenizers.Tokenizer`` (``from_object``), encodes batches in the
library's native parallel path, and exposes ``fingerprint`` (checkpoints store it).
"""
from __future__ import annotations

import hashlib
import os
from typing import List, Optional, Sequence

from k3.errors import TokenizerError
from k3.tokenizer.base import AllowSpecial, K3TokenizerBase

HF_FILE = "tokenizer.json"


def _tokenizer_class():
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise TokenizerError("loading tokenizer.json needs the `tokenizers` package") from e
    return Tokenizer


def _is_tokenizer_object(obj) -> bool:
    return not isinstance(obj, (str, bytes, os.PathLike)) and callable(getattr(obj, "to_str", None))


class HFTokenizerWrapper(K3TokenizerBase):
    """A ``tokenizers.Tokenizer`` with the K3 special ids.

    ``HFTokenizerWrapper(path)``: ``path`` is a tokenizer.json or a directory holding one;
    ``HFTokenizerWrapper(tokenizer)`` / ``from_object(tokenizer)``: a ``tokenizers.Tokenizer``
    object (copied, so later changes to the caller's object do not leak in).

    ``tokenizer`` is the raw ``tokenizers.Tokenizer`` as loaded (never modified); encoding uses a
    private copy with padding/truncation off that treats special names as ordinary text."""

    def __init__(self, path):
        if _is_tokenizer_object(path):
            self._load(path.to_str(), path=None)
            return
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, HF_FILE)
        if not os.path.isfile(path):
            raise TokenizerError(f"tokenizer.json not found: {path}")
        try:
            with open(path, "rb") as f:
                raw = f.read()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot load {path}: {e}") from e
        self._load(text, path=path, file_bytes=raw)

    @classmethod
    def from_object(cls, tokenizer) -> "HFTokenizerWrapper":
        """Wrap an in-memory ``tokenizers.Tokenizer`` (via ``Tokenizer.from_str(tokenizer.to_str())``)."""
        if not _is_tokenizer_object(tokenizer):
            raise TokenizerError(f"expected a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        return cls(tokenizer)

    @classmethod
    def from_pretrained(cls, path: str) -> "HFTokenizerWrapper":
        """Load ``path`` (a tokenizer.json or a directory holding one, e.g. a checkpoint)."""
        return cls(path)

    @classmethod
    def from_tokenizer(cls, tokenizer, directory: str) -> "HFTokenizerWrapper":
        """Save a `tokenizers.Tokenizer` object into ``directory`` and wrap it."""
        os.makedirs(directory, exist_ok=True)
        p = os.path.join(directory, HF_FILE)
        tokenizer.save(p)
        return cls(p)

    def _load(self, json_text: str, path: Optional[str], file_bytes: Optional[bytes] = None) -> None:
        """Build from a tokenizer.json string. ``path``/``file_bytes``: the file it was read from and
        its exact bytes (what ``save`` writes back), or None for an in-memory tokenizer."""
        Tokenizer = _tokenizer_class()
        self.path = path
        self._file_bytes = file_bytes
        try:
            # two instances: the raw one as loaded, and one that treats special names as ordinary text
            self.tokenizer = Tokenizer.from_str(json_text)
            self._plain = Tokenizer.from_str(json_text)
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise TokenizerError(f"cannot load {path or 'tokenizer'}: {e}") from e
        self._plain.no_padding()
        self._plain.no_truncation()
        self._plain.encode_special_tokens = True
        # an in-memory tokenizer: hash the exact string it was given (same as hashing the object)
        self._fingerprint = _sha_json(json_text) if path is None else None
        specials = {tok.content: int(i) for i, tok in self._plain.get_added_tokens_decoder().items()
                    if tok.special}
        self._vocab_size = self._plain.get_vocab_size(with_added_tokens=True)
        self._init_specials(specials)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def fingerprint(self) -> str:
        """sha256 of the tokenizer's canonical JSON (``Tokenizer.to_str()``), the same value for the
        same tokenizer.json content; checkpoints store it and resume compares it."""
        if self._fingerprint is None:
            self._fingerprint = _sha_json(self.tokenizer.to_str())
        return self._fingerprint

    def token_id(self, token: str) -> int:
        """Id of ``token`` exactly as the tokenizer's vocabulary spells it: an added/special token
        name, or a model-vocabulary entry in its raw byte-level form (e.g. "Ġworld" for " world";
        compare ``token_to_id``, which takes the token's text). Raises TokenizerError if unknown."""
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise TokenizerError(f"unknown token {token!r}")
        return i

    def encode_batch(self, texts: Sequence[str], allow_special: AllowSpecial = False) -> List[List[int]]:
        """``[encode(t, allow_special) for t in texts]``; without special recognition the batch goes
        through the `tokenizers` native (parallel) batch encoder."""
        texts = list(texts)
        for t in texts:
            if not isinstance(t, str):
                raise TokenizerError(f"encode expects str, got {type(t).__name__}")
        if self._allowed_re(allow_special) is not None:
            return [self.encode(t, allow_special=allow_special) for t in texts]
        return [e.ids for e in self._plain.encode_batch(texts, add_special_tokens=False)]

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

    def save(self, directory: str) -> str:
        """Write ``directory/tokenizer.json`` and return its path: the loaded file's exact bytes, or
        the in-memory tokenizer serialized by `tokenizers`."""
        os.makedirs(directory, exist_ok=True)
        dst = os.path.join(directory, HF_FILE)
        if self._file_bytes is None:
            self.tokenizer.save(dst)
        elif not (os.path.abspath(dst) == os.path.abspath(self.path) and os.path.isfile(dst)):
            with open(dst, "wb") as f:
                f.write(self._file_bytes)
        return dst

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={self.path!r}, vocab_size={self.vocab_size})"


def _sha_json(json_text: str) -> str:
    # == k3.train.data._sha(json_text): sha256 of the UTF-8 text followed by a NUL separator
    return hashlib.sha256(json_text.encode("utf-8") + b"\x00").hexdigest()
