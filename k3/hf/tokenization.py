"""`TikTokenTokenizer`: a transformers (slow, Python) tokenizer around `k3.tokenizer.K3TiktokenTokenizer`.

Reads the exported `tiktoken.model` + `tokenizer_config.json`; token strings are the byte-level spellings of the
token bytes (reversible for any byte sequence), ids are k3's, the 256 specials are transformers added tokens
(named by `added_tokens_decoder`)."""
from __future__ import annotations

import os
import shutil
from typing import Optional

from transformers import PreTrainedTokenizer

__all__ = ["TikTokenTokenizer"]


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="<|end_of_msg|>", pad_token="[PAD]",
                 unk_token=None, clean_up_tokenization_spaces=False, **kwargs):
        from k3.tokenizer import K3TiktokenTokenizer
        from k3.tokenizer.export import byte_level_decoder
        self._k3 = K3TiktokenTokenizer(vocab_file)
        self.vocab_file = vocab_file
        self._u2b = byte_level_decoder()
        self._b2u = {b: c for c, b in self._u2b.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, unk_token=unk_token,
                         clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)

    @property
    def k3_tokenizer(self):
        return self._k3

    @property
    def vocab_size(self) -> int:
        return self._k3.num_base_tokens

    def _spell(self, b: bytes) -> str:
        return "".join(self._b2u[x] for x in b)

    def get_vocab(self):
        v = {self._spell(b): i for b, i in self._k3.ranks.items()}
        v.update(self._k3.special_tokens)
        return v

    def _tokenize(self, text, **kwargs):
        return [self._spell(self._k3.decode_bytes([i])) for i in self._k3.encode(text)]

    def _convert_token_to_id(self, token):
        sp = self._k3.special_tokens.get(token)
        if sp is not None:
            return sp
        try:
            return self._k3.ranks[bytes(self._u2b[c] for c in token)]
        except KeyError:
            return self.unk_token_id

    def _convert_id_to_token(self, index):
        index = int(index)
        if index < self._k3.num_base_tokens:
            return self._spell(self._k3.decode_bytes([index]))
        return self._k3.id_to_token(index)

    def convert_tokens_to_string(self, tokens):
        out, buf = [], bytearray()
        for t in tokens:
            if t in self._k3.special_tokens:
                if buf:
                    out.append(buf.decode("utf-8", errors="replace"))
                    buf = bytearray()
                out.append(t)
            else:
                buf += bytes(self._u2b[c] for c in t)
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def save_vocabulary(self, save_directory, filename_prefix: Optional[str] = None):
        name = (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model"
        dst = os.path.join(save_directory, name)
        if os.path.abspath(dst) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, dst)
        return (dst,)
