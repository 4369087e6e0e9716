"""Toy tokenizers built from code (for tests and tiny experiments; nothing is downloaded)."""
from __future__ import annotations

import os
from typing import Iterable, Optional

from k3.tokenizer.bpe import train_bpe_ranks, write_tiktoken_model

TOY_CORPUS = """\
Hello world! Hello there, world. The quick brown fox jumps over the lazy dog; the dog didn't mind.
We're testing a tokenizer: it's small, they've trained it, I'm sure you'll like it and we'd agree.
Numbers like 1, 12, 123, 1234, 3.14159 and 2026-05-09 appear in text; so do prices ($19.99) and 100%.
def encode(text):\n    return [ord(c) for c in text]\n\nclass Model:\n    pass\n
The model reads messages with roles: system, user, assistant and tool. Tools have names and arguments.
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3, "ok": true}}
Café, naïve, résumé, façade, Ångström, São Paulo, Zürich, smörgåsbord, crème brûlée.
Привет мир! Ελληνικά γράμματα. שלום עולם. مرحبا بالعالم. नमस्ते दुनिया.
你好，世界！今天天气很好。我们正在测试分词器。机器学习和自然语言处理。
こんにちは世界。カタカナとひらがな。한국어 문장도 있습니다.
Emoji: 😀 🎉 👍🏽 🚀 and symbols → ← ≤ ≥ ∑ ∞ © ™.
Line one\nLine two\r\nLine three\n\n\tIndented with a tab\n    Indented with spaces\n
THE UPPERCASE WORDS and MixedCase identifiers like camelCase, snake_case, HTTPServer, XMLParser.
assistant user system tool message role name think response call argument json object array string
number boolean null index type key value open close sep the and of to in is that for it with as was
"""


def build_toy_tokenizer(directory: str, num_merges: int = 400, texts: Optional[Iterable[str]] = None,
                        backend: str = "auto"):
    """Train a tiny byte-level BPE (256 bytes + ``num_merges`` merges) on ``texts`` (default:
    TOY_CORPUS, repeated so frequent pairs win), write ``directory/tiktoken.model`` and return a
    K3TiktokenTokenizer over it (specials at ids n..n+255 with the K3 names)."""
    from k3.tokenizer.tiktoken_tokenizer import TIKTOKEN_FILE, K3TiktokenTokenizer
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, TIKTOKEN_FILE)
    if not os.path.isfile(path):
        ranks = train_bpe_ranks(list(texts) if texts is not None else [TOY_CORPUS], num_merges)
        write_tiktoken_model(ranks, path)
    return K3TiktokenTokenizer(path, backend=backend)
