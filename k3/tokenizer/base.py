"""The common k3 tokenizer interface and the K3 special-token table (architecture.md §6)."""
from __future__ import annotations

import re
from typing import Collection, Dict, Iterable, List, Optional, Sequence, Union

from k3.errors import TokenizerError

NUM_SPECIAL_SLOTS = 256

# Offsets of the named specials inside the 256-slot block that follows the BPE ranks (architecture.md §6).
K3_SPECIAL_OFFSETS: Dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",               # document end (eod)
    2: "<|end_of_msg|>",      # turn end; generation stop token; config eos_token_id
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}

BOS, EOD, END_OF_MSG, PAD, UNK = "[BOS]", "[EOS]", "<|end_of_msg|>", "[PAD]", "[UNK]"
OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = (
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")


def reserved_token_name(token_id: int) -> str:
    """Name of an unnamed special slot: ``<|reserved_token_N|>`` with N the *absolute* token id
    (e.g. 163592 for the K3 vocabulary), the rule of the K2/K3 reference tokenizer code
    (``<|reserved_token_{i}|>`` for i in range(n_base, n_base + 256)). A checkpoint's
    tokenizer_config.json ``added_tokens_decoder`` overrides any name."""
    return f"<|reserved_token_{token_id}|>"


def k3_special_tokens(base_vocab: int, overrides: Optional[Dict[int, str]] = None) -> Dict[str, int]:
    """The 256 special names -> ids for a vocabulary with ``base_vocab`` BPE ranks: ids
    [base_vocab, base_vocab + 256), named by K3_SPECIAL_OFFSETS, else reserved_token_name(id).
    ``overrides`` maps absolute ids to names (tokenizer_config.json) and wins."""
    overrides = overrides or {}
    out: Dict[str, int] = {}
    for off in range(NUM_SPECIAL_SLOTS):
        i = base_vocab + off
        name = overrides.get(i) or K3_SPECIAL_OFFSETS.get(off) or reserved_token_name(i)
        if name in out:
            raise TokenizerError(f"special token name {name!r} used for both id {out[name]} and id {i}")
        out[name] = i
    return out


AllowSpecial = Union[bool, str, Collection[str]]


class K3TokenizerBase:
    """Duck-typed interface every k3 tokenizer implements.

    Subclasses set ``self._special_to_id`` (name -> id for every special/added token) and implement
    ``_encode_ordinary(text) -> ids`` (no special recognition), ``_decode_ordinary(ids) -> str``,
    ``_ordinary_token_to_id(str)``, ``_ordinary_id_to_token(int)``, ``vocab_size`` and ``save``.

    Ids: ``bos_id`` = ``[BOS]``, ``eos_id`` = ``<|end_of_msg|>`` (generation stop token, the
    config's eos_token_id), ``eod_id`` = ``[EOS]`` (document end, for packing), ``pad_id`` = ``[PAD]``.
    """

    _special_to_id: Dict[str, int]

    def _init_specials(self, special_to_id: Dict[str, int]) -> None:
        self._special_to_id = dict(special_to_id)
        self._id_to_special = {i: s for s, i in self._special_to_id.items()}
        # longest names first so a name that prefixes another never shadows it
        names = sorted(self._special_to_id, key=len, reverse=True)
        self._special_re_all = re.compile("|".join(re.escape(n) for n in names)) if names else None
        for need in (BOS, EOD, END_OF_MSG, PAD):
            if need not in self._special_to_id:
                raise TokenizerError(f"tokenizer has no {need!r} special token")

    # ---- ids ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def bos_id(self) -> int:
        return self._special_to_id[BOS]

    @property
    def eos_id(self) -> int:
        return self._special_to_id[END_OF_MSG]

    @property
    def eod_id(self) -> int:
        return self._special_to_id[EOD]

    @property
    def pad_id(self) -> int:
        return self._special_to_id[PAD]

    @property
    def unk_id(self) -> Optional[int]:
        return self._special_to_id.get(UNK)

    @property
    def stop_ids(self) -> List[int]:
        """Ids that end generation (the turn end)."""
        return [self.eos_id]

    @property
    def special_tokens(self) -> Dict[str, int]:
        """Copy of the special name -> id table."""
        return dict(self._special_to_id)

    @property
    def special_ids(self) -> frozenset:
        return frozenset(self._id_to_special)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._id_to_special

    def __len__(self) -> int:
        return self.vocab_size

    # ---- lookup ------------------------------------------------------------------------------
    def token_to_id(self, token: str) -> int:
        """Id of a special token name, or of the single ordinary token whose text is ``token``.
        Raises TokenizerError if there is none."""
        i = self._special_to_id.get(token)
        if i is not None:
            return i
        i = self._ordinary_token_to_id(token)
        if i is None:
            raise TokenizerError(f"{token!r} is not a single token of this vocabulary")
        return i

    def id_to_token(self, token_id: int) -> str:
        """Special name for special ids; otherwise the token's text (UTF-8, invalid bytes shown
        as backslash escapes so partial characters stay distinguishable)."""
        token_id = int(token_id)
        s = self._id_to_special.get(token_id)
        if s is not None:
            return s
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} out of range [0, {self.vocab_size})")
        return self._ordinary_id_to_token(token_id)

    # ---- encode / decode ---------------------------------------------------------------------
    def _allowed_re(self, allow_special: AllowSpecial):
        if allow_special is False or allow_special is None:
            return None
        if allow_special is True or allow_special == "all":
            return self._special_re_all
        if isinstance(allow_special, str):
            allow_special = [allow_special]
        names = list(allow_special)
        for n in names:
            if n not in self._special_to_id:
                raise TokenizerError(f"allow_special names unknown special token {n!r}")
        if not names:
            return None
        return re.compile("|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)))

    def encode(self, text: str, allow_special: AllowSpecial = False) -> List[int]:
        """Encode ``text``. With ``allow_special`` False (default) special-token names in the text
        are ordinary text; True/"all" recognizes every special name; a collection of names
        recognizes just those. No BOS/EOS is added."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects str, got {type(text).__name__}")
        pat = self._allowed_re(allow_special)
        if pat is None:
            return self._encode_ordinary(text)
        out: List[int] = []
        pos = 0
        for m in pat.finditer(text):
            if m.start() > pos:
                out.extend(self._encode_ordinary(text[pos:m.start()]))
            out.append(self._special_to_id[m.group()])
            pos = m.end()
        if pos < len(text):
            out.extend(self._encode_ordinary(text[pos:]))
        return out

    def encode_batch(self, texts: Sequence[str], allow_special: AllowSpecial = False) -> List[List[int]]:
        return [self.encode(t, allow_special=allow_special) for t in texts]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Decode ids to text; special ids become their names unless ``skip_special``. Invalid
        UTF-8 (e.g. a cut multi-byte character) decodes to U+FFFD."""
        parts: List[str] = []
        run: List[int] = []
        n = self.vocab_size
        for i in ids:
            i = int(i)
            s = self._id_to_special.get(i)
            if s is None:
                if not 0 <= i < n:
                    raise TokenizerError(f"token id {i} out of range [0, {n})")
                run.append(i)
                continue
            if run:
                parts.append(self._decode_ordinary(run))
                run = []
            if not skip_special:
                parts.append(s)
        if run:
            parts.append(self._decode_ordinary(run))
        return "".join(parts)

    # ---- abstract hooks ----------------------------------------------------------------------
    def _encode_ordinary(self, text: str) -> List[int]:  # pragma: no cover
        raise NotImplementedError

    def _decode_ordinary(self, ids: List[int]) -> str:  # pragma: no cover
        raise NotImplementedError

    def _ordinary_token_to_id(self, token: str) -> Optional[int]:  # pragma: no cover
        raise NotImplementedError

    def _ordinary_id_to_token(self, token_id: int) -> str:  # pragma: no cover
        raise NotImplementedError

    def save(self, directory: str) -> None:  # pragma: no cover
        raise NotImplementedError
