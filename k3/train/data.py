"""Training data: an offline default corpus, a byte-level BPE tokenizer with K3's special-token layout, and a
deterministic, resumable packed loader.

Corpus
    `load_corpus()` with no argument returns the built-in "pydocs" corpus: English documentation prose that every
    CPython install carries (the `pydoc_data.topics` language-reference topics + the docstrings of the pure-Python
    standard library, one document per topic / per module). A frozen copy ships as `k3/data/pydocs.jsonl.gz` so
    every machine sees the same text; if that file is missing it is rebuilt from the local stdlib (and cached).
    User corpora: `.txt` files (one document per file, or one per blank-line-separated section with
    `split_sections=True`), `.jsonl` files (field "text", one document per line), or a directory of those.
    The train/validation split ranks documents by a hash of their name (deterministic; ~5% of the characters go
    to validation by default).

Tokenizer
    Byte-level BPE trained with `tokenizers` (pre-tokenizer = K3's split regex, spec §6) on the train documents at
    first use and cached under `$K3_CACHE` (default `~/.cache/k3`). The 256 special slots sit at the top of the
    vocabulary exactly like K3: ids [V-256, V) with K3's offsets ([BOS] at V-256, [EOS] at V-255, <|end_of_msg|>
    at V-254, ..., [UNK] at V-2, [PAD] at V-1); BPE ranks use [0, V-256).

Packing
    Every document is tokenised once (cached as .npy next to the tokenizer) with the document separator
    `[EOS]` (`eod_id`) appended. Training rows of `seq_len` tokens are cut from the stream of documents in a
    per-epoch shuffled order; a document that does not fit is continued in the next row. A batch is
    `{"input_ids": [1, B*T] int64, "labels": [1, B*T] int64, "cu_seqlens": [N+1] int32}` -- the keyword
    arguments of the model's forward for packed input. `cu_seqlens` holds every document start and every row
    start; `labels[i] = input_ids[i+1]` inside a segment and -100 at the last position of each segment, so no
    target crosses a document or row boundary. The loader state is (epoch, token position), independent of
    `seq_len`/`batch_size`, so those may change between batches (context extension) and a restored
    `state_dict()` reproduces the exact next batch.
"""
from __future__ import annotations

import ast
import glob
import gzip
import hashlib
import json
import logging
import os
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from k3 import knobs
from k3.errors import K3ConfigError, TokenizerError
from k3.ops.loss import IGNORE_INDEX  # one constant for the data and the loss
from k3.tokenizer.base import K3_SPECIAL_OFFSETS, NUM_SPECIAL_SLOTS, UNK, k3_special_tokens
from k3.tokenizer.bpe import K3_PAT_STR
from k3.tokenizer.hf import HFTokenizerWrapper

log = logging.getLogger("k3")

__all__ = [
    "load_corpus", "build_pydocs_corpus", "write_pydocs_corpus", "cache_dir",
    "SPECIAL_TOKEN_OFFSETS", "special_token_names", "train_tokenizer", "get_tokenizer", "HFTokenizer",
    "tokenize_documents", "PackedLoader", "ValLoader", "K3Data", "build_data", "IGNORE_INDEX",
]

NUM_SPECIAL = NUM_SPECIAL_SLOTS
_TOKENIZER_VERSION = "bpe-v1"
_CORPUS_VERSION = "pydocs-v1"
_BUILTIN_CORPUS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "pydocs.jsonl.gz")

# K3's named special slots (spec §6, offsets from V-256) and pre-tokenizer split regex (spec §6; the same
# string serves `tokenizers`' Oniguruma engine, tiktoken and the `regex` module): single definitions in
# k3.tokenizer, re-exported here under their historical names.
SPECIAL_TOKEN_OFFSETS = K3_SPECIAL_OFFSETS
K3_SPLIT_REGEX = K3_PAT_STR


def cache_dir(override: Optional[str] = None) -> str:
    """`override` > the K3_CACHE knob (k3/knobs.py: `$K3_CACHE`, else `knobs.set(K3_CACHE=...)`) > `~/.cache/k3`."""
    d = override or knobs.get("K3_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "k3")
    os.makedirs(d, exist_ok=True)
    return d


def _sha(*parts: Union[str, bytes]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8") if isinstance(p, str) else p)
        h.update(b"\x00")
    return h.hexdigest()


def _atomic_write(path: str, write) -> None:
    """write(tmp_path) then rename: concurrent processes never see a partial file."""
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=os.path.splitext(path)[1])
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ------------------------------------------------------------------------------------------------- corpus

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3",
              "turtledemo", "ensurepip", "idlelib", "__phello__"}


def _clean(text: str) -> str:
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    return "\n".join(lines).strip()


def build_pydocs_corpus(stdlib_dir: Optional[str] = None) -> list[dict]:
    """Build the "pydocs" corpus from this Python install: [{"name", "text"}], one document per
    `pydoc_data.topics` topic and per stdlib module (its module/class/function docstrings, read with `ast`,
    nothing is imported)."""
    docs = []
    try:
        from pydoc_data.topics import topics
        for key in sorted(topics):
            t = _clean(topics[key])
            if len(t) >= 200:
                docs.append({"name": f"topic:{key}", "text": t})
    except ImportError:  # pragma: no cover - stripped installs
        log.warning("pydoc_data is not available; the pydocs corpus has module docstrings only")
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    for dp, dns, fns in os.walk(root):
        dns[:] = sorted(d for d in dns if d not in _SKIP_DIRS and not d.startswith("."))
        for fn in sorted(fns):
            if not fn.endswith(".py") or fn.startswith("test_"):
                continue
            path = os.path.join(dp, fn)
            try:
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                continue
            parts, seen = [], set()
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    d = ast.get_docstring(node)
                    if d and len(d) >= 40:
                        d = _clean(d)
                        if d not in seen:
                            seen.add(d)
                            parts.append(d)
            text = "\n\n".join(parts)
            if len(text) >= 200:
                mod = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                if mod.endswith(".__init__"):
                    mod = mod[: -len(".__init__")]
                docs.append({"name": f"module:{mod}", "text": text})
    return docs


def write_pydocs_corpus(path: str = _BUILTIN_CORPUS) -> int:
    """(Re)generate the shipped corpus file from the local Python install; returns the number of documents."""
    docs = build_pydocs_corpus()

    def w(tmp):
        # mtime=0 and a fixed name: the .gz bytes depend only on the text
        with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
            for d in docs:
                f.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))
    _atomic_write(path, w)
    return len(docs)


def _read_jsonl(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    out = []
    base = os.path.basename(path)
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if "text" not in rec:
                raise K3ConfigError(f"{path}:{i + 1}: jsonl record has no 'text' field")
            if rec["text"] and rec["text"].strip():
                out.append({"name": rec.get("name") or f"{base}:{i}", "text": rec["text"]})
    return out


def _pydocs_records() -> list[dict]:
    if os.path.exists(_BUILTIN_CORPUS):
        return _read_jsonl(_BUILTIN_CORPUS)
    cached = os.path.join(cache_dir(), "corpus", f"{_CORPUS_VERSION}.jsonl.gz")
    if not os.path.exists(cached):
        log.info("building the pydocs corpus from the local stdlib into %s", cached)
        write_pydocs_corpus(cached)
    return _read_jsonl(cached)


def _file_records(path: str, split_sections: bool) -> list[dict]:
    base = os.path.basename(path)
    if path.endswith((".jsonl", ".jsonl.gz")):
        return _read_jsonl(path)
    if path.endswith(".txt"):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if not split_sections:
            return [{"name": base, "text": text}] if text.strip() else []
        secs = [s.strip("\n") for s in text.replace("\r\n", "\n").split("\n\n")]
        return [{"name": f"{base}#{i}", "text": s} for i, s in enumerate(secs) if s.strip()]
    raise K3ConfigError(f"corpus file {path!r}: expected .txt, .jsonl or .jsonl.gz")


def _expand(paths: Sequence[str]) -> list[str]:
    out = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "**", "*.txt"), recursive=True)
                           + glob.glob(os.path.join(p, "**", "*.jsonl"), recursive=True)
                           + glob.glob(os.path.join(p, "**", "*.jsonl.gz"), recursive=True))
            if not found:
                raise K3ConfigError(f"corpus directory {p!r} holds no .txt/.jsonl files")
            out.extend(found)
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise K3ConfigError(f"corpus path {p!r} does not exist (built-in corpus name: 'pydocs')")
    return out


def _split(records: list[dict], val_fraction: float) -> tuple[list[str], list[str]]:
    """Deterministic split: documents are ranked by a hash of their name and taken into validation in that
    order until they hold `val_fraction` of the characters (at least one document when there are >= 2)."""
    if not records:
        raise K3ConfigError("the corpus is empty")
    if not 0.0 <= val_fraction < 1.0:
        raise K3ConfigError(f"val_fraction={val_fraction} not in [0, 1)")
    ranked = sorted(range(len(records)), key=lambda i: (_sha("k3-split", records[i]["name"]), i))
    budget = val_fraction * sum(len(r["text"]) for r in records)
    val_ids, got = set(), 0
    if val_fraction > 0 and len(records) >= 2:
        for i in ranked[:-1]:  # never everything
            if got >= budget and val_ids:
                break
            val_ids.add(i)
            got += len(records[i]["text"])
    train = [r["text"] for i, r in enumerate(records) if i not in val_ids]
    val = [r["text"] for i, r in enumerate(records) if i in val_ids]
    return train, val


def load_corpus(name_or_paths: Union[None, str, Sequence[str]] = None, *, split_sections: bool = False,
                val_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """-> (train_docs, val_docs). `None`/"pydocs": the built-in corpus; otherwise a path or list of paths
    (.txt, .jsonl[.gz], or directories of them). `split_sections`: a .txt file holds one document per
    blank-line-separated section instead of being one document."""
    if name_or_paths is None or name_or_paths in ("pydocs", "default"):
        records = _pydocs_records()
    else:
        paths = [name_or_paths] if isinstance(name_or_paths, (str, os.PathLike)) else list(name_or_paths)
        records = []
        for p in _expand([os.fspath(p) for p in paths]):
            records.extend(_file_records(p, split_sections))
    return _split(records, val_fraction)


def _corpus_fingerprint(docs: Sequence[str]) -> str:
    h = hashlib.sha256()
    for d in docs:
        b = d.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- tokenizer

def special_token_names(vocab_size: int) -> list[str]:
    """The 256 special-token strings of a `vocab_size` vocabulary in slot order (offset 0 = [BOS] ...
    255 = [PAD]); unnamed slots are `<|reserved_token_N|>` with N the absolute id (K2/K3 reference rule,
    shared with `k3.tokenizer.base.k3_special_tokens`)."""
    table = k3_special_tokens(vocab_size - NUM_SPECIAL)
    names = sorted(table, key=table.get)
    if len(names) != NUM_SPECIAL:
        raise TokenizerError(f"expected {NUM_SPECIAL} special names, got {len(names)}")
    return names


def _base_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(K3_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(docs: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2):
    """Train a byte-level BPE with `vocab_size - 256` ranks and put K3's 256 specials at [V-256, V).
    If the corpus is too small to fill every rank, the unused ranks are padded with inert placeholder tokens
    so the special ids stay at the top."""
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    n_bpe = vocab_size - NUM_SPECIAL
    if n_bpe < 256:
        raise K3ConfigError(f"vocab_size={vocab_size}: needs at least 256 byte tokens + 256 specials = 512")
    tok = _base_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, min_frequency=min_frequency, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(docs, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    if len(vocab) > n_bpe:  # pragma: no cover - the trainer respects vocab_size
        raise TokenizerError(f"BPE trainer produced {len(vocab)} > {n_bpe} tokens")
    for i in range(len(vocab), n_bpe):  # pad unused ranks; no merge produces these strings
        vocab[f"<|unused_bpe_{i}|>"] = i
    spec["added_tokens"] = [
        {"id": n_bpe + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, s in enumerate(special_token_names(vocab_size))
    ]
    tok = Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    if tok.get_vocab_size() != vocab_size or tok.token_to_id("[BOS]") != n_bpe:
        raise TokenizerError("special tokens did not land at the top of the vocabulary")
    return tok


def get_tokenizer(vocab_size: int = 8192, corpus=None, path: Optional[str] = None,
                  cache: Optional[str] = None):
    """`tokenizers.Tokenizer`: loaded from `path` (a tokenizer.json or a directory holding one) if given,
    else trained on the train documents of `corpus` (None = built-in; a name/path for `load_corpus`; or a
    list of document strings) and cached under `cache_dir()/bpe-v1-<V>-<corpus hash>/tokenizer.json`."""
    from tokenizers import Tokenizer
    if path is not None:
        p = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(p):
            raise TokenizerError(f"no tokenizer.json at {path!r}")
        return Tokenizer.from_file(p)
    docs = corpus if _is_doc_list(corpus) else load_corpus(corpus)[0]
    d = _tokenizer_dir(vocab_size, docs, cache)
    p = os.path.join(d, "tokenizer.json")
    if os.path.isfile(p):
        return Tokenizer.from_file(p)
    t0 = time.time()
    tok = train_tokenizer(docs, vocab_size)
    log.info("trained a %d-token BPE in %.1f s -> %s", vocab_size, time.time() - t0, p)
    _atomic_write(p, lambda tmp: tok.save(tmp))
    return tok


def _save_npy(path: str, arr: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, arr)


def _is_doc_list(x) -> bool:
    """A list of document strings (as opposed to a list of corpus paths, which all exist on disk)."""
    if not isinstance(x, (list, tuple)) or not x or not all(isinstance(s, str) for s in x):
        return False
    return not all(len(s) < 4096 and "\n" not in s and os.path.exists(s) for s in x)


def _tokenizer_dir(vocab_size: int, docs: Sequence[str], cache: Optional[str]) -> str:
    key = _sha(_TOKENIZER_VERSION, str(vocab_size), K3_SPLIT_REGEX, *special_token_names(vocab_size),
               _corpus_fingerprint(docs))[:16]
    return os.path.join(cache_dir(cache), f"{_TOKENIZER_VERSION}-{vocab_size}-{key}")


class HFTokenizer(HFTokenizerWrapper):
    """The training pipeline's view of `k3.tokenizer.HFTokenizerWrapper` (one implementation; this subclass only
    keeps the training API): built from a `tokenizers.Tokenizer` or a tokenizer.json path (or its directory);
    `encode`/`encode_batch` recognise special-token strings by default (`allow_special=True`); `decode` takes
    `skip_special_tokens=`; `[UNK]` is required and `special_base` is the first special id.

    `eod_id` = `[EOS]` (document separator used in pre-training data); `eos_id` = `<|end_of_msg|>` (turn end,
    generation stop, config eos); `bos_id` = `[BOS]` (K3 does not prepend it); `pad_id` = `[PAD]`."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        if self.unk_id is None:
            raise TokenizerError(f"tokenizer has no {UNK} token (not a K3-layout tokenizer)")

    @property
    def special_base(self) -> int:
        return self.bos_id

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """`allow_special=False` encodes literal special-token strings (e.g. "[EOS]") as ordinary text,
        as K3 does for user and document text."""
        return super().encode(text, allow_special=allow_special)

    def encode_batch(self, texts: Sequence[str], allow_special: bool = True) -> list[list[int]]:
        return super().encode_batch(texts, allow_special=allow_special)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """`tokenizers`' own decode: with `skip_special_tokens` the special ids are dropped before the
        remaining bytes are decoded as one run."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def tokenize_documents(tokenizer: HFTokenizer, docs: Sequence[str], cache: Optional[str] = None,
                       use_cache: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """-> (tokens, offsets): all documents' ids, each followed by `eod_id`, concatenated; document i is
    tokens[offsets[i]:offsets[i+1]]. Cached as .npy under cache_dir()/tok-<tokenizer hash>/."""
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    if use_cache:
        d = os.path.join(cache_dir(cache), f"tok-{tokenizer.fingerprint[:16]}")
        stem = os.path.join(d, f"tokens-{_corpus_fingerprint(docs)[:16]}")
        if os.path.isfile(stem + ".offsets.npy") and os.path.isfile(stem + ".ids.npy"):
            try:
                return (np.load(stem + ".ids.npy", allow_pickle=False),
                        np.load(stem + ".offsets.npy", allow_pickle=False))
            except (ValueError, OSError):  # pragma: no cover - corrupt cache: rebuild
                pass
    enc = []
    step = 4096
    for i in range(0, len(docs), step):
        enc.extend(tokenizer.encode_batch(docs[i:i + step], allow_special=False))
    lens = np.fromiter((len(e) + 1 for e in enc), dtype=np.int64, count=len(enc))
    offsets = np.zeros(len(enc) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    tokens = np.empty(int(offsets[-1]), dtype=dtype)
    for i, e in enumerate(enc):
        s = offsets[i]
        tokens[s:s + len(e)] = e
        tokens[s + len(e)] = tokenizer.eod_id
    if use_cache:
        for suffix, arr in ((".ids.npy", tokens), (".offsets.npy", offsets)):
            _atomic_write(stem + suffix, lambda tmp, arr=arr: _save_npy(tmp, arr))
    return tokens, offsets


# ------------------------------------------------------------------------------------------------ packing

def _check_shape(seq_len: int, batch_size: int) -> None:
    if int(seq_len) < 2 or int(batch_size) < 1:
        raise K3ConfigError(f"seq_len={seq_len} (>= 2) / batch_size={batch_size} (>= 1)")


class _Stream:
    """Token stream over documents in a given order: cum[j] = start of the j-th document of the order."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, order: np.ndarray):
        self.tokens, self.offsets, self.order = tokens, offsets, order
        lens = (offsets[1:] - offsets[:-1])[order]
        self.cum = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(lens, out=self.cum[1:])
        self.total = int(self.cum[-1])

    def take(self, pos: int, n: int) -> tuple[list[np.ndarray], list[int]]:
        """Tokens [pos, pos+n) (n <= total - pos) and the positions (relative to pos) where documents start."""
        end = pos + n
        j0 = int(np.searchsorted(self.cum, pos, side="right")) - 1
        j1 = int(np.searchsorted(self.cum, end, side="left"))  # documents j0..j1-1 overlap [pos, end)
        pieces, starts = [], []
        for j in range(j0, j1):
            doc = self.order[j]
            a, b = max(pos, int(self.cum[j])), min(end, int(self.cum[j + 1]))
            base = int(self.offsets[doc]) - int(self.cum[j])
            pieces.append(self.tokens[base + a: base + b])
            if j > j0 or a == int(self.cum[j]):
                starts.append(a - pos)
        return pieces, starts


def _finish_batch(rows: list[np.ndarray], row_starts: list[list[int]], seq_len: int) -> dict:
    ids = np.concatenate(rows).astype(np.int64)
    n = ids.shape[0]
    starts = sorted({r * seq_len + s for r, ss in enumerate(row_starts) for s in ([0] + ss) if s < seq_len})
    cu = np.array(starts + [n], dtype=np.int32)
    labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = ids[1:]
    labels[cu[1:] - 1] = IGNORE_INDEX  # last position of each segment (and of each row)
    return {"input_ids": torch.from_numpy(ids).view(1, n), "labels": torch.from_numpy(labels).view(1, n),
            "cu_seqlens": torch.from_numpy(cu)}


class PackedLoader:
    """Infinite, deterministic, resumable packed training batches (see module docstring).

    State = (epoch, pos): the token position in epoch `epoch`'s shuffled document stream. Every epoch uses
    its own permutation drawn from (seed, epoch). Rows are always full: a row that reaches the end of an
    epoch continues with the first document of the next one."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, seq_len: int, batch_size: int, seed: int = 0,
                 shuffle: bool = True):
        if len(offsets) < 2 or int(offsets[-1]) == 0:
            raise K3ConfigError("PackedLoader needs at least one non-empty document")
        _check_shape(seq_len, batch_size)
        self.tokens, self.offsets = tokens, np.asarray(offsets, dtype=np.int64)
        self.seq_len, self.batch_size = int(seq_len), int(batch_size)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.epoch, self.pos = 0, 0
        self._stream_epoch, self._stream = None, None

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def tokens_per_epoch(self) -> int:
        return int(self.offsets[-1])

    @property
    def epoch_progress(self) -> float:
        """Fractional epochs consumed so far."""
        return self.epoch + self.pos / self.tokens_per_epoch

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_docs)
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
        return rng.permutation(self.num_docs)

    def _get_stream(self) -> _Stream:
        if self._stream_epoch != self.epoch:
            self._stream = _Stream(self.tokens, self.offsets, self.order(self.epoch))
            self._stream_epoch = self.epoch
        return self._stream

    def set_shape(self, seq_len: Optional[int] = None, batch_size: Optional[int] = None) -> None:
        """Change the row length / rows per batch for the following batches; the data position is kept."""
        _check_shape(seq_len or self.seq_len, batch_size or self.batch_size)
        self.seq_len = int(seq_len or self.seq_len)
        self.batch_size = int(batch_size or self.batch_size)

    def _row(self, seq_len: int) -> tuple[np.ndarray, list[int]]:
        pieces, starts, filled = [], [], 0
        while filled < seq_len:
            st = self._get_stream()
            n = min(seq_len - filled, st.total - self.pos)
            p, s = st.take(self.pos, n)
            pieces.extend(p)
            starts.extend(filled + x for x in s)
            filled += n
            self.pos += n
            if self.pos >= st.total:
                self.epoch, self.pos = self.epoch + 1, 0
        return np.concatenate(pieces), starts

    def next_batch(self, seq_len: Optional[int] = None, batch_size: Optional[int] = None) -> dict:
        """One batch; `seq_len`/`batch_size` override the current shape for this batch only."""
        T, B = int(seq_len or self.seq_len), int(batch_size or self.batch_size)
        _check_shape(T, B)
        rows, starts = zip(*(self._row(T) for _ in range(B)))
        return _finish_batch(list(rows), list(starts), T)

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        return self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "shuffle": self.shuffle,
                "seq_len": self.seq_len, "batch_size": self.batch_size,
                "num_docs": self.num_docs, "num_tokens": self.tokens_per_epoch}

    def load_state_dict(self, state: dict) -> None:
        if (state["num_docs"], state["num_tokens"]) != (self.num_docs, self.tokens_per_epoch):
            raise K3ConfigError(
                f"loader state is for a different corpus/tokenizer ({state['num_docs']} docs / "
                f"{state['num_tokens']} tokens, this loader has {self.num_docs} / {self.tokens_per_epoch})")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self.seq_len, self.batch_size = int(state["seq_len"]), int(state["batch_size"])
        self._stream_epoch = None


class ValLoader:
    """Fixed validation batches: the validation documents in corpus order, packed from the start each time
    it is iterated (same batches every time for the same shape). The last row is padded with `pad_id`
    (labels -100, its own segment); iteration stops after one pass or `max_batches`."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, seq_len: int, batch_size: int, pad_id: int,
                 max_batches: Optional[int] = None):
        _check_shape(seq_len, batch_size)
        self.tokens, self.offsets = tokens, np.asarray(offsets, dtype=np.int64)
        self.seq_len, self.batch_size, self.pad_id = int(seq_len), int(batch_size), int(pad_id)
        self.max_batches = max_batches
        self._stream = _Stream(tokens, self.offsets, np.arange(len(self.offsets) - 1))

    @property
    def num_tokens(self) -> int:
        return self._stream.total

    def batches(self, seq_len: Optional[int] = None, batch_size: Optional[int] = None,
                max_batches: Optional[int] = None) -> Iterator[dict]:
        T, B = int(seq_len or self.seq_len), int(batch_size or self.batch_size)
        _check_shape(T, B)
        limit = max_batches if max_batches is not None else self.max_batches
        st, pos, done = self._stream, 0, 0
        while pos < st.total and (limit is None or done < limit):
            rows, starts = [], []
            while len(rows) < B and pos < st.total:
                n = min(T, st.total - pos)
                p, s = st.take(pos, n)
                pos += n
                if n < T:  # pad the tail as a separate segment
                    p.append(np.full(T - n, self.pad_id, dtype=st.tokens.dtype))
                    s = s + [n]
                rows.append(np.concatenate(p))
                starts.append(s)
            batch = _finish_batch(rows, starts, T)
            batch["labels"][batch["input_ids"] == self.pad_id] = IGNORE_INDEX
            yield batch
            done += 1

    def __iter__(self) -> Iterator[dict]:
        return self.batches()


# ------------------------------------------------------------------------------------------------ bundle

@dataclass
class K3Data:
    tokenizer: HFTokenizer
    train: PackedLoader
    val: ValLoader
    num_train_docs: int
    num_val_docs: int


def build_data(corpus=None, vocab_size: int = 8192, seq_len: int = 256, batch_size: int = 8, seed: int = 0,
               tokenizer_path: Optional[str] = None, cache: Optional[str] = None, split_sections: bool = False,
               val_fraction: float = 0.05, val_max_batches: Optional[int] = None) -> K3Data:
    """Corpus -> tokenizer (loaded or trained+cached) -> cached token arrays -> train/val loaders."""
    if _is_doc_list(corpus):
        missing = [c for c in corpus if len(c) < 4096 and "\n" not in c and not os.path.exists(c)][:3]
        raise K3ConfigError(f"corpus path(s) {missing} do not exist (give .txt/.jsonl files or directories, or the "
                            f"built-in corpus name 'pydocs'; raw document strings go to the loaders directly)"
                            if missing else "a corpus is a name or paths; raw document strings go to the loaders "
                            "directly")
    train_docs, val_docs = load_corpus(corpus, split_sections=split_sections, val_fraction=val_fraction)
    if tokenizer_path is not None:
        tok = HFTokenizer(get_tokenizer(path=tokenizer_path))
    else:
        tok = HFTokenizer(get_tokenizer(vocab_size, corpus=train_docs, cache=cache))
    tr_tok, tr_off = tokenize_documents(tok, train_docs, cache=cache)
    train = PackedLoader(tr_tok, tr_off, seq_len, batch_size, seed=seed)
    if val_docs:
        va_tok, va_off = tokenize_documents(tok, val_docs, cache=cache)
    else:
        va_tok, va_off = np.zeros(0, dtype=tr_tok.dtype), np.zeros(1, dtype=np.int64)
    val = ValLoader(va_tok, va_off, seq_len, batch_size, pad_id=tok.pad_id, max_batches=val_max_batches)
    return K3Data(tok, train, val, len(train_docs), len(val_docs))
