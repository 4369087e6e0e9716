"""Write the corpus of the `small` claim runs: the Python standard library's own source (every .py file of the
running interpreter's stdlib, one document per file, in sorted path order; site-packages and __pycache__ left out,
files that are not UTF-8 skipped) as JSONL for `--data`. Its size follows the interpreter's install: the
development VM's CPython 3.11 gives 1,758 files, 31.5M characters (7.0M training tokens with `small`'s 32K
tokenizer), the H200 machine's 569 files, 10.7M characters (2.40M training tokens): either way a `small` claim run of
1-2M tokens sees none of it twice, where the built-in pydocs corpus (~0.5M tokens) would go round 3-4 times and be
memorised. Generated on the machine that runs the claims (nothing is downloaded).

    python benchmarks/claims/pysrc_corpus.py OUT.jsonl [--prepare PRESET]

--prepare also trains the tokenizer for PRESET's vocabulary and tokenises the corpus into the k3 cache, once, so
jobs started side by side on it find both ready instead of each building them.
"""
from __future__ import annotations

import argparse
import json
import os
import sysconfig


def write_corpus(out: str, root: str | None = None) -> tuple[int, int]:
    """Write root's (default: the stdlib's) .py files to `out` as JSONL {"name", "text"}; returns (documents,
    characters). Written to a temporary name and renamed: a reader never sees half a file. A root that is not a
    directory, or holds no such file, is refused (ValueError naming it) and `out` is left as it was."""
    root = root or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise ValueError(f"pysrc corpus: {root!r} is not a directory")
    n = chars = 0
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    with open(path, encoding="utf-8") as src:
                        text = src.read()
                except (UnicodeDecodeError, OSError):
                    continue
                if text.strip():
                    f.write(json.dumps({"name": os.path.relpath(path, root), "text": text}) + "\n")
                    n += 1
                    chars += len(text)
    if not n:
        os.remove(tmp)
        raise ValueError(f"pysrc corpus: {root!r} holds no non-empty UTF-8 .py file")
    os.replace(tmp, out)
    return n, chars


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--root", default=None, help="source tree [the running interpreter's stdlib]")
    p.add_argument("--prepare", metavar="PRESET", default=None,
                   help="also build the tokenizer and token cache for this preset's vocabulary")
    args = p.parse_args(argv)
    try:
        n, chars = write_corpus(args.out, args.root)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(f"{args.out}: {n} documents, {chars / 1e6:.1f}M characters")
    if args.prepare:
        from k3.config import K3Config
        from k3.train.data import build_data
        d = build_data(args.out, vocab_size=K3Config.from_preset(args.prepare).vocab_size)
        print(f"tokenised for {args.prepare}: {d.train.tokens.shape[0]:,} training tokens, "
              f"{d.val.num_tokens:,} validation tokens")


if __name__ == "__main__":
    main()
