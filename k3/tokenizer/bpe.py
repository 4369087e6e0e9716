"""Byte-level BPE core shared by every k3 tokenizer backend.

Holds the K3 pre-tokenizer pattern (architecture.md §6), the long-input windowing rule, the tiktoken-format
file reader/writer, a pure-Python encoder that reproduces tiktoken's merge rule exactly, and a
tiny byte-level BPE trainer used to build toy vocabularies for tests (nothing is downloaded).
"""
from __future__ import annotations

import base64
import heapq
import binascii
import os
import re
from collections import Counter
from typing import Dict, Iterable, Iterator, List

from k3.errors import TokenizerError

# --------------------------------------------------------------------------------------------
# Pre-tokenizer pattern (architecture.md §6), alternatives in priority order. `&&[^\p{Han}]` is a class
# intersection: both tiktoken's Rust engine and the `regex` module (VERSION1) support it.
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_PREFIX = r"[^\r\n\p{L}\p{N}]?"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
K3_PAT_PARTS = (
    r"[\p{Han}]+",                                                     # (1) Han run
    _PREFIX + _NOT_HAN_UPPER + "*" + _NOT_HAN_LOWER + "+" + _CONTRACTION,  # (2) Xx / xx words
    _PREFIX + _NOT_HAN_UPPER + "+" + _NOT_HAN_LOWER + "*" + _CONTRACTION,  # (3) XX / Xx words
    r"\p{N}{1,3}",                                                     # (4) 1-3 digits
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",                                      # (5) punctuation run
    r"\s*[\r\n]+",                                                     # (6) newlines
    r"\s+(?!\S)",                                                      # (7) ws not before non-space
    r"\s+",                                                            # (8) any whitespace
)
K3_PAT_STR = "|".join(K3_PAT_PARTS)

# Long-input limits (architecture.md §6): ≤400k-char windows, then ≤25k-char same-class (space / non-space)
# runs, so the regex engine never sees pathological inputs.
MAX_ENCODE_CHARS = 400_000
MAX_SAME_CLASS_RUN = 25_000

_RUN_RE = re.compile(r"\s+|\S+")  # stdlib `re` \s on str == str.isspace()


def split_long_text(text: str, window: int = MAX_ENCODE_CHARS,
                    max_run: int = MAX_SAME_CLASS_RUN) -> Iterator[str]:
    """Yield the pieces the encoder sees: ``window``-char windows, each cut inside any run of
    same-class characters (``str.isspace`` or not) every ``max_run`` characters from the run start.
    Pieces are encoded independently and their ids concatenated."""
    for w0 in range(0, len(text), window):
        chunk = text[w0:w0 + window]
        if len(chunk) <= max_run:
            yield chunk
            continue
        start = 0
        for m in _RUN_RE.finditer(chunk):
            r0, r1 = m.span()
            cut = r0 + max_run
            while cut < r1:
                yield chunk[start:cut]
                start = cut
                cut += max_run
        yield chunk[start:]


def fix_surrogates(text: str) -> str:
    """Replace lone surrogates (unencodable in UTF-8) with U+FFFD, as tiktoken does."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


# --------------------------------------------------------------------------------------------
# tiktoken.model files: one "base64(token bytes) rank" per line, ranks 0..n-1 in file order.

def read_tiktoken_model(path: str) -> Dict[bytes, int]:
    """Read a tiktoken-format rank file, validating it. Raises TokenizerError naming the line."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TokenizerError(f"cannot read tiktoken file {path}: {e}") from e
    ranks: Dict[bytes, int] = {}
    for lineno, raw in enumerate(data.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        fields = line.decode("utf-8", "replace").split()
        if len(fields) != 2:
            raise TokenizerError(f"{path}: line {lineno}: expected 'base64token rank', got "
                                 f"{len(fields)} field(s): {line[:80]!r}")
        try:
            tok = base64.b64decode(fields[0], validate=True)
        except (binascii.Error, ValueError) as e:
            raise TokenizerError(f"{path}: line {lineno}: bad base64 token {fields[0][:60]!r}: {e}") from e
        try:
            if not fields[1].isascii():
                raise ValueError
            rank = int(fields[1])
        except ValueError:
            raise TokenizerError(f"{path}: line {lineno}: rank {fields[1][:40]!r} is not an integer") from None
        if not tok:
            raise TokenizerError(f"{path}: line {lineno}: empty token")
        if rank != len(ranks):
            raise TokenizerError(f"{path}: line {lineno}: rank {rank} breaks the contiguous sequence "
                                 f"(expected {len(ranks)}; ranks must be 0..n-1 in file order)")
        if tok in ranks:
            raise TokenizerError(f"{path}: line {lineno}: token {tok!r} duplicates rank {ranks[tok]}")
        ranks[tok] = rank
    if not ranks:
        raise TokenizerError(f"{path}: no tokens in tiktoken file")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: byte-level BPE needs all 256 single bytes; {len(missing)} missing "
                             f"(first: 0x{missing[0]:02x})")
    return ranks


def write_tiktoken_model(ranks: Dict[bytes, int], path: str) -> None:
    """Write ``ranks`` (must be 0..n-1) in tiktoken format, atomically."""
    items = sorted(ranks.items(), key=lambda kv: kv[1])
    if [r for _, r in items] != list(range(len(items))):
        raise TokenizerError("ranks must be exactly 0..n-1 to be written as a tiktoken file")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        for tok, rank in items:
            f.write(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Pure-Python encoder (fallback when `tiktoken` is not importable).

def bpe_merge(piece: bytes, ranks: Dict[bytes, int]) -> List[int]:
    """tiktoken's merge rule: repeatedly merge the adjacent pair whose concatenation has the
    lowest rank (leftmost on ties) until no adjacent concatenation is a token."""
    if len(piece) == 1:
        return [ranks[piece]]
    if len(piece) > 48:
        return _bpe_merge_heap(piece, ranks)
    return _bpe_merge_simple(piece, ranks)


def _bpe_merge_simple(piece: bytes, ranks: Dict[bytes, int]) -> List[int]:
    """Quadratic reference form of the merge loop (fast for the short pieces of real text)."""
    bounds = list(range(len(piece) + 1))  # token i spans piece[bounds[i]:bounds[i+1]]
    get = ranks.get
    big = 1 << 62
    pair = [get(piece[bounds[i]:bounds[i + 2]], big) for i in range(len(bounds) - 2)]
    while pair:
        best = min(pair)
        if best == big:
            break
        i = pair.index(best)
        del bounds[i + 1]
        del pair[i]
        if i < len(pair):
            pair[i] = get(piece[bounds[i]:bounds[i + 2]], big)
        if i > 0:
            pair[i - 1] = get(piece[bounds[i - 1]:bounds[i + 1]], big)
    return [ranks[piece[bounds[i]:bounds[i + 1]]] for i in range(len(bounds) - 1)]


def _bpe_merge_heap(piece: bytes, ranks: Dict[bytes, int]) -> List[int]:
    """Same result as the quadratic loop in bpe_merge, in O(n log n) for long pieces: a heap of
    (rank, start, end) candidate pairs over a linked list of token starts; stale entries (whose
    pair no longer consists of two current tokens) are skipped. (rank, start) ordering reproduces
    "lowest rank, leftmost on ties"."""
    n = len(piece)
    get = ranks.get
    nxt = list(range(1, n + 1))
    prv = list(range(-1, n - 1))
    alive = [True] * n
    heap = []
    for i in range(n - 1):
        r = get(piece[i:i + 2])
        if r is not None:
            heap.append((r, i, i + 2))
    heapq.heapify(heap)
    while heap:
        _, i, end = heapq.heappop(heap)
        if not alive[i]:
            continue
        j = nxt[i]
        if j >= n or nxt[j] != end:
            continue
        alive[j] = False
        nxt[i] = end
        if end < n:
            prv[end] = i
            e2 = nxt[end]
            r = get(piece[i:e2])
            if r is not None:
                heapq.heappush(heap, (r, i, e2))
        p = prv[i]
        if p >= 0:
            r = get(piece[p:end])
            if r is not None:
                heapq.heappush(heap, (r, p, end))
    out = []
    i = 0
    while i < n:
        out.append(ranks[piece[i:nxt[i]]])
        i = nxt[i]
    return out


class PurePythonBPE:
    """Encoder/decoder over a rank table using the `regex` module for the pre-tokenizer."""

    def __init__(self, ranks: Dict[bytes, int], pat_str: str = K3_PAT_STR, cache_size: int = 1 << 16):
        try:
            import regex
        except ImportError as e:  # pragma: no cover - regex is a hard dependency
            raise TokenizerError("the pure-Python tokenizer backend needs the `regex` package") from e
        try:
            self._pat = regex.compile(pat_str, flags=regex.VERSION1)
        except regex.error as e:
            raise TokenizerError(f"bad pre-tokenizer pattern: {e}") from e
        self.ranks = ranks
        self._cache: Dict[bytes, List[int]] = {}
        self._cache_size = cache_size

    def encode_ordinary(self, text: str) -> List[int]:
        ranks, cache, out = self.ranks, self._cache, []
        for m in self._pat.finditer(text):
            piece = m.group().encode("utf-8")
            r = ranks.get(piece)
            if r is not None:
                out.append(r)
                continue
            ids = cache.get(piece)
            if ids is None:
                ids = bpe_merge(piece, ranks)
                if len(cache) >= self._cache_size:
                    cache.clear()
                cache[piece] = ids
            out.extend(ids)
        return out


def split_pieces(text: str, pat_str: str = K3_PAT_STR) -> List[str]:
    """The pre-tokenizer pieces of ``text`` (debugging aid)."""
    import regex
    return [m.group() for m in regex.compile(pat_str, flags=regex.VERSION1).finditer(text)]


# --------------------------------------------------------------------------------------------
# A tiny byte-level BPE trainer (for toy vocabularies in tests; not meant for real corpora).

def train_bpe_ranks(texts: Iterable[str], num_merges: int, pat_str: str = K3_PAT_STR,
                    min_count: int = 2) -> Dict[bytes, int]:
    """Train ``num_merges`` merges on ``texts``; ranks 0..255 are the single bytes, then merged
    tokens in merge order (so rank order == merge order, as tiktoken's encoder requires)."""
    import regex
    pat = regex.compile(pat_str, flags=regex.VERSION1)
    words: Counter = Counter()
    for t in texts:
        for m in pat.finditer(t):
            words[m.group().encode("utf-8")] += 1
    ranks: Dict[bytes, int] = {bytes([b]): b for b in range(256)}
    seqs = [([bytes([c]) for c in w], n) for w, n in words.items() if len(w) > 1]
    for _ in range(num_merges):
        counts: Counter = Counter()
        for seq, n in seqs:
            for a, b in zip(seq, seq[1:]):
                counts[(a, b)] += n
        if not counts:
            break
        # most frequent pair; ties broken by the lexicographically smallest pair (deterministic)
        (a, b), n = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        if n < min_count:
            break
        new = a + b
        if new in ranks:  # already a token via another merge path: skip applying as a new rank
            pass
        else:
            ranks[new] = len(ranks)
        for k, (seq, cnt) in enumerate(seqs):
            if len(seq) < 2:
                continue
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[k] = (out, cnt)
    return ranks
