"""Per-token text work of `k3 serve` (and k3.generate's stop strings / text streaming), CPU only, no model.

    python benchmarks/serve_text_overhead.py                      # toy BPE tokenizer, 16K chars, 4 stop strings
    python benchmarks/serve_text_overhead.py --chars 65536 --tokenizer CKPT_DIR

Feeds the ids of a ~N-character text token by token through the text path of one request and times it alone:

  old: the former algorithm: every token re-decodes the whole output, searches every stop string in all of it
       and checks the held-back tail against the whole text (O(output) per token, O(output^2) per request);
  new: k3.generation.generate.TextStream (what the scheduler and k3.generate use now): incremental detokenisation
       of a small id window + a stop scan of the new text and the last max(len(stop)) - 1 characters only.

The stop strings never occur (the worst case: the whole output is scanned). Both paths must produce the same
text (checked). Reported: total ms, mean us/token, and us/token over the last 10% of tokens (where the old path
is slowest), best of --repeat runs.
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

STOPS = ["\n\nUser:", "<|im_end|>", "### Instruction", "STOP SEQUENCE"]
TEXT = ("The quick brown fox jumps over the lazy dog; numbers 12, 345 and 6789. Naïve café owners say "
        "“hello” — 你好, 世界! Models generate tokens one at a time, and servers stream them to clients. ")


def old_path(tok, ids, stops):
    """The pre-change per-token work (k3/serve/scheduler.py _accept before issue 28.3)."""
    n = tok.vocab_size

    def decode(x):
        return tok.decode([i for i in x if i < n], skip_special=True)

    def hold(text):
        h = 0
        for s in stops:
            for k in range(min(len(s) - 1, len(text)), h, -1):
                if text.endswith(s[:k]):
                    h = k
                    break
        return h

    text_ids, emitted, out, marks = [], 0, [], []
    for t in ids:
        t0 = time.perf_counter()
        text_ids.append(t)
        text = decode(text_ids)
        hits = [h for h in (text.find(s) for s in stops) if h >= 0]
        assert not hits
        if not text.endswith("\ufffd"):
            end = len(text) - hold(text)
            if end > emitted:
                out.append(text[emitted:end])
                emitted = end
        marks.append(time.perf_counter() - t0)
    text = decode(text_ids)
    out.append(text[emitted:])
    return "".join(out), marks


def new_path(tok, ids, stops):
    from k3.generation.generate import TextStream
    ts = TextStream(tok, stops)
    out, marks = [], []
    for t in ids:
        t0 = time.perf_counter()
        out.append(ts.push(t))
        marks.append(time.perf_counter() - t0)
    out.append(ts.finish())
    assert not ts.stopped
    return "".join(out), marks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chars", type=int, default=16384, help="generated characters (default 16K)")
    ap.add_argument("--tokenizer", default=None, help="checkpoint dir / tokenizer file (default: toy BPE)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per path (best is reported)")
    a = ap.parse_args(argv)
    from k3.tokenizer import build_toy_tokenizer, load_tokenizer
    if a.tokenizer:
        tok = load_tokenizer(a.tokenizer)
        name = a.tokenizer
    else:
        tok = build_toy_tokenizer(tempfile.mkdtemp(prefix="k3_textbench_"), num_merges=300)
        name = "toy BPE (300 merges)"
    text = (TEXT * (a.chars // len(TEXT) + 1))[:a.chars]
    ids = tok.encode(text)
    ref = tok.decode(ids)
    rows = []
    for label, fn in (("old (full re-decode + full stop scan)", old_path),
                      ("new (TextStream, incremental)", new_path)):
        best = None
        for _ in range(a.repeat):
            out, marks = fn(tok, ids, STOPS)
            assert out == ref, f"{label}: text differs from the full decode"
            tot = sum(marks)
            if best is None or tot < best[0]:
                tail = marks[int(len(marks) * 0.9):]
                best = (tot, tot / len(marks), sum(tail) / len(tail))
        rows.append((label, *best))
    print(f"text path per token, {len(ref)} chars / {len(ids)} tokens, {len(STOPS)} stop strings "
          f"(max {max(map(len, STOPS))} chars); tokenizer: {name}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus; best of {a.repeat}")
    print(f"| {'path':<40} | {'total ms':>9} | {'us/token':>9} | {'us/token, last 10%':>18} |")
    print(f"|{'-' * 42}|{'-' * 11}|{'-' * 11}|{'-' * 20}|")
    for label, tot, mean, tail in rows:
        print(f"| {label:<40} | {tot * 1e3:9.1f} | {mean * 1e6:9.1f} | {tail * 1e6:18.1f} |")
    print(f"speed-up: {rows[0][1] / rows[1][1]:.1f}x total, {rows[0][3] / rows[1][3]:.1f}x per token at the end")


if __name__ == "__main__":
    main()
