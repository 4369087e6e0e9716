"""k3 tokenizers (architecture.md §6).

* ``K3TokenizerBase``: the common duck-typed interface (encode/decode/vocab_size/bos_id/eos_id/
  eod_id/pad_id/token_to_id/id_to_token/save).
* ``K3TiktokenTokenizer``: the released format (``tiktoken.model`` + 256 special slots).
* ``HFTokenizerWrapper``: a HuggingFace ``tokenizer.json`` (the k3 training tokenizer).
* ``load_tokenizer(path)`` picks one; ``check_tokenizer_matches(tok, vocab_size)`` guards a model.
"""
from __future__ import annotations

import os
from typing import Union

from k3.errors import TokenizerError
from k3.tokenizer.base import (BOS, CLOSE, EOD, END_OF_MSG, K3_SPECIAL_OFFSETS, MEDIA_BEGIN, MEDIA_CONTENT,
                               MEDIA_END, MEDIA_PAD, NUM_SPECIAL_SLOTS, OPEN, PAD, SEP, UNK, K3TokenizerBase,
                               k3_special_tokens, reserved_token_name)
from k3.tokenizer.bpe import (K3_PAT_STR, MAX_ENCODE_CHARS, MAX_SAME_CLASS_RUN, PurePythonBPE,
                              read_tiktoken_model, split_long_text, split_pieces, train_bpe_ranks,
                              write_tiktoken_model)
from k3.tokenizer.hf import HF_FILE, HFTokenizerWrapper
from k3.tokenizer.tiktoken_tokenizer import TIKTOKEN_FILE, K3TiktokenTokenizer
from k3.tokenizer.toy import TOY_CORPUS, build_toy_tokenizer

__all__ = [
    "K3TokenizerBase", "K3TiktokenTokenizer", "HFTokenizerWrapper", "load_tokenizer",
    "check_tokenizer_matches", "build_toy_tokenizer", "k3_special_tokens", "reserved_token_name",
    "K3_PAT_STR", "MAX_ENCODE_CHARS", "MAX_SAME_CLASS_RUN", "K3_SPECIAL_OFFSETS", "NUM_SPECIAL_SLOTS", "read_tiktoken_model", "write_tiktoken_model",
    "train_bpe_ranks", "split_long_text", "split_pieces", "PurePythonBPE", "TOY_CORPUS",
    "BOS", "EOD", "END_OF_MSG", "PAD", "UNK", "OPEN", "CLOSE", "SEP",
    "MEDIA_BEGIN", "MEDIA_CONTENT", "MEDIA_END", "MEDIA_PAD", "TIKTOKEN_FILE", "HF_FILE",
]


def load_tokenizer(path: str, backend: str = "auto") -> K3TokenizerBase:
    """Load a tokenizer from a directory or file.

    Directory: ``tiktoken.model`` -> K3TiktokenTokenizer (preferred when both exist: it is the
    released, authoritative file; a tokenizer.json beside it is usually a conversion), else
    ``tokenizer.json`` -> HFTokenizerWrapper. File: ``*.json`` -> HF wrapper; ``tiktoken.model``,
    ``*.model`` or ``*.tiktoken`` -> K3TiktokenTokenizer. ``backend`` applies to tiktoken files.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        tk = os.path.join(path, TIKTOKEN_FILE)
        hf = os.path.join(path, HF_FILE)
        if os.path.isfile(tk):
            return K3TiktokenTokenizer(tk, backend=backend)
        if os.path.isfile(hf):
            return HFTokenizerWrapper(hf)
        raise TokenizerError(f"no {TIKTOKEN_FILE} or {HF_FILE} in directory {path}")
    if not os.path.isfile(path):
        raise TokenizerError(f"tokenizer path does not exist: {path}")
    name = os.path.basename(path)
    if name.endswith(".json"):
        return HFTokenizerWrapper(path)
    if name == TIKTOKEN_FILE or name.endswith(".model") or name.endswith(".tiktoken"):
        return K3TiktokenTokenizer(path, backend=backend)
    raise TokenizerError(f"cannot tell the tokenizer format of {path} (expected {TIKTOKEN_FILE} or *.json)")


def check_tokenizer_matches(tokenizer: K3TokenizerBase, vocab_size: Union[int, object],
                            max_padding: int = 256) -> None:
    """Raise TokenizerError unless ``tokenizer`` fits a model with ``vocab_size`` embedding rows.

    ``vocab_size`` may be an int or a config object with ``vocab_size`` (and optionally
    ``bos_token_id``/``eos_token_id``/``pad_token_id``, which must then equal the tokenizer's).
    Errors: any tokenizer id >= vocab_size (tokenizer larger than the model), or the model
    larger by >= ``max_padding`` rows (a different tokenizer, not just padding to a multiple).
    """
    cfg = None
    if not isinstance(vocab_size, int):
        cfg = vocab_size
        try:
            vocab_size = int(getattr(cfg, "vocab_size"))
        except (AttributeError, TypeError, ValueError):
            raise TokenizerError(f"cannot read vocab_size from {type(cfg).__name__}") from None
    tv = int(tokenizer.vocab_size)
    max_id = max([tv - 1, *tokenizer.special_ids])
    if max_id >= vocab_size:
        raise TokenizerError(f"tokenizer ids reach {max_id} (tokenizer vocab_size {tv}) but the model "
                             f"vocab_size is {vocab_size}")
    if vocab_size - tv >= max_padding:
        raise TokenizerError(f"model vocab_size {vocab_size} exceeds tokenizer vocab_size {tv} by "
                             f"{vocab_size - tv} (>= {max_padding}): tokenizer and model do not match")
    if cfg is not None:
        for key, mine in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id),
                          ("pad_token_id", tokenizer.pad_id)):
            theirs = getattr(cfg, key, None)
            if theirs is not None and int(theirs) != mine:
                raise TokenizerError(f"config {key}={theirs} but the tokenizer's is {mine}")
