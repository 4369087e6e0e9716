"""Tokenizer tests. Every vocabulary is generated in code (k3.tokenizer.build_toy_tokenizer trains a
few hundred byte-level BPE merges on a built-in corpus); nothing is downloaded."""
import base64
import json
import os
import random

import pytest

from k3.errors import TokenizerError
from k3.tokenizer import (K3_SPECIAL_OFFSETS, TOY_CORPUS, HFTokenizerWrapper, K3TiktokenTokenizer,
                          build_toy_tokenizer, check_tokenizer_matches, k3_special_tokens, load_tokenizer,
                          read_tiktoken_model, split_long_text, split_pieces, write_tiktoken_model)
from k3.tokenizer.bpe import _bpe_merge_heap, _bpe_merge_simple, train_bpe_ranks

try:
    import tiktoken  # noqa: F401
    HAVE_TIKTOKEN = True
except ImportError:
    HAVE_TIKTOKEN = False

UNICODE_CASES = [
    "Hello world",
    "你好，世界！今天天气很好。",
    "Café naïve résumé Ångström Zürich crème brûlée",
    "emoji 😀🎉👍🏽🚀 and 𝔸𝕓 and 𠀀",
    "digits 1 12 123 1234 12345678 ٣٤٥ ½ Ⅳ",
    "line one\nline two\r\nthree\n\n\n\tTabbed\n    spaced   \n",
    "we're they've I'm you'll he'd it's WE'RE I'M Don't",
    "mixed 中文English混合text 123abc",
    "  leading and trailing spaces   ",
    "\u00a0nbsp\u3000ideographic space\u2028sep",
    "Привет мир! Ελληνικά. שלום. مرحبا. नमस्ते. 한국어",
    "",
    "x",
]


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("toytok")
    build_toy_tokenizer(str(d))
    return str(d)


@pytest.fixture(scope="module")
def tok(toy_dir):
    return K3TiktokenTokenizer(toy_dir)  # tiktoken backend when installed


@pytest.fixture(scope="module")
def pytok(toy_dir):
    return K3TiktokenTokenizer(toy_dir, backend="python")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    t.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                             show_progress=False, special_tokens=[])
    t.train_from_iterator([TOY_CORPUS], tr)
    base = t.get_vocab_size()
    t.add_special_tokens(list(k3_special_tokens(base)))  # the 256 K3 names at [V-256, V)
    d = tmp_path_factory.mktemp("hftok")
    t.save(str(d / "tokenizer.json"))
    return str(d), base


# ---------------------------------------------------------------------------------------------
# loading and special ids

def test_load_generated_file(tok, toy_dir):
    ranks = read_tiktoken_model(os.path.join(toy_dir, "tiktoken.model"))
    n = len(ranks)
    assert n > 256 + 100  # bytes + trained merges
    assert tok.num_base_tokens == n and tok.vocab_size == n + 256 and len(tok) == n + 256


def test_specials_at_k3_offsets(tok, pytok):
    n = tok.num_base_tokens
    for off, name in K3_SPECIAL_OFFSETS.items():
        assert tok.token_to_id(name) == n + off
        assert tok.id_to_token(n + off) == name
    assert (tok.bos_id, tok.eod_id, tok.eos_id, tok.pad_id) == (n, n + 1, n + 2, n + 255)
    assert tok.token_to_id("<|open|>") == n + 3 and tok.token_to_id("<|sep|>") == n + 5
    assert tok.token_to_id("<|media_pad|>") == n + 21 and tok.token_to_id("<osagent_mode>") == n + 65
    assert tok.unk_id == n + 254 and tok.stop_ids == [n + 2]
    # unnamed slots: <|reserved_token_N|>, N = absolute id (K2/K3 reference rule)
    assert tok.id_to_token(n + 8) == f"<|reserved_token_{n + 8}|>"
    assert tok.token_to_id(f"<|reserved_token_{n + 100}|>") == n + 100
    assert len(tok.special_ids) == 256
    assert pytok.special_tokens == tok.special_tokens


def test_k3_full_size_ids():
    sp = k3_special_tokens(163584)
    assert sp["[BOS]"] == 163584 and sp["<|end_of_msg|>"] == 163586 and sp["[PAD]"] == 163839
    assert sp["<|media_pad|>"] == 163605 and sp["<osagent_mode>"] == 163649 and sp["[EOT]"] == 163593
    assert sp["<|reserved_token_163592|>"] == 163592 and len(sp) == 256


def test_token_lookup(tok):
    i = tok.token_to_id(" world")
    assert tok.id_to_token(i) == " world" and tok.decode([i]) == " world"
    with pytest.raises(TokenizerError, match="not a single token"):
        tok.token_to_id("definitely-not-a-token-xyz")
    with pytest.raises(TokenizerError, match="out of range"):
        tok.id_to_token(tok.vocab_size)


# ---------------------------------------------------------------------------------------------
# encode / decode

@pytest.mark.parametrize("text", UNICODE_CASES)
def test_round_trip_unicode(tok, pytok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.num_base_tokens for i in ids)
    assert tok.decode(ids) == text
    assert pytok.encode(text) == ids


def test_pre_tokenizer_split():
    assert split_pieces("Hello world") == ["Hello", " world"]
    assert split_pieces("你好世界abc") == ["你好世界", "abc"]          # Han run, then letters
    assert split_pieces("12345") == ["123", "45"]                     # 1-3 digits
    assert split_pieces("we're I'M") == ["we're", " I'M"]            # contractions, case-insensitive
    assert split_pieces("HTTPServer camelCase") == ["HTTPServer", " camel", "Case"]
    assert split_pieces("\n\n  x") == ["\n\n", " ", " x"]            # newline run; ws before a word
    assert split_pieces(" ...\n\nx") == [" ...\n\n", "x"]             # punctuation + trailing newlines
    assert split_pieces("hello   \n") == ["hello", "   \n"]


def test_allow_special(tok):
    text = "a<|open|>b<|end_of_msg|>"
    plain = tok.encode(text)
    assert not any(tok.is_special(i) for i in plain)          # default: names are ordinary text
    assert tok.decode(plain) == text
    sp = tok.encode(text, allow_special=True)
    assert tok.token_to_id("<|open|>") in sp and sp[-1] == tok.eos_id
    assert tok.decode(sp) == text
    only_open = tok.encode(text, allow_special={"<|open|>"})
    assert tok.token_to_id("<|open|>") in only_open and tok.eos_id not in only_open
    assert tok.decode(sp, skip_special=True) == "ab"
    with pytest.raises(TokenizerError, match="unknown special"):
        tok.encode(text, allow_special={"<|nope|>"})


def test_decode_errors_and_partial_utf8(tok):
    with pytest.raises(TokenizerError, match="out of range"):
        tok.decode([tok.vocab_size + 5])
    with pytest.raises(TokenizerError, match="expects str"):
        tok.encode(b"bytes")
    ids = tok.encode("😀")
    assert tok.decode(ids[:1]).endswith("\ufffd") or len(ids) == 1  # cut multi-byte char -> U+FFFD


@pytest.mark.skipif(not HAVE_TIKTOKEN, reason="tiktoken not installed")
def test_tiktoken_and_python_paths_agree(tok, pytok):
    assert tok.backend == "tiktoken" and pytok.backend == "python"
    rng = random.Random(0)
    pool = [" ", "\n", "\r", "\t", "\u00a0", "\u3000", "'", "s", "S", "t", "re", "LL", "a", "Z", "é", "É", "ǅ",
            "ʰ", "ª", "\u0301", "中", "文", "あ", "ア", "한", "1", "٣", "½", "Ⅳ", "!", "?", ".", "$", "😀", "👍🏽",
            "\x1c", "\u2028", "ſ", "K", "ß", "ﬀ", "-", "_", "\u200b", "\ufeff", "\x00", "𝔸", "𠀀", "the", " and"]
    for _ in range(1500):
        s = "".join(rng.choice(pool) for _ in range(rng.randint(0, 40)))
        assert tok.encode(s) == pytok.encode(s), repr(s)
    big = TOY_CORPUS * 3
    assert tok.encode(big) == pytok.encode(big)


def test_heap_merge_equals_simple_merge():
    ranks = train_bpe_ranks([TOY_CORPUS, "aaaa abab aaaaaa ababab " * 20], 300)
    rng = random.Random(1)
    alphabet = b"ab aeiouthe\xe4\xbd\xa0"
    for _ in range(1000):
        p = bytes(rng.choice(alphabet) for _ in range(rng.randint(2, 100)))
        assert _bpe_merge_heap(p, ranks) == _bpe_merge_simple(p, ranks)


def test_long_input_windows(tok, pytok):
    pieces = list(split_long_text("a" * 60_000 + " " * 30_000 + "b"))
    # cuts fall every 25k chars inside a same-class run; a piece may still span class changes
    assert [len(p) for p in pieces] == [25_000, 25_000, 35_000, 5_001]
    assert list(split_long_text("x" * 10, window=4, max_run=100)) == ["xxxx", "xxxx", "xx"]
    s = "ab" * 20_000 + "\n" * 30_000 + "c"
    ids = tok.encode(s)
    assert ids == pytok.encode(s)
    assert ids == [i for p in split_long_text(s) for i in tok.encode(p)]
    assert tok.decode(ids) == s


# ---------------------------------------------------------------------------------------------
# save / config overrides / corrupt files

def test_save_and_reload(tok, tmp_path):
    tok.save(str(tmp_path))
    cfg = json.load(open(tmp_path / "tokenizer_config.json"))
    assert len(cfg["added_tokens_decoder"]) == 256 and cfg["eos_token"] == "<|end_of_msg|>"
    again = load_tokenizer(str(tmp_path))
    assert isinstance(again, K3TiktokenTokenizer)
    assert again.special_tokens == tok.special_tokens
    for t in UNICODE_CASES:
        assert again.encode(t) == tok.encode(t)


def test_config_overrides_names(toy_dir, tmp_path):
    base = K3TiktokenTokenizer(toy_dir, backend="python")
    n = base.num_base_tokens
    (tmp_path / "tiktoken.model").write_bytes(open(os.path.join(toy_dir, "tiktoken.model"), "rb").read())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(n + 8): {"content": "<|custom|>", "special": True}}}))
    t = K3TiktokenTokenizer(str(tmp_path), backend="python")
    assert t.token_to_id("<|custom|>") == n + 8 and t.eos_id == n + 2
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(n + 300): {"content": "<|far|>"}}}))
    with pytest.raises(TokenizerError, match="outside the special slots"):
        K3TiktokenTokenizer(str(tmp_path))


def _write_lines(path, lines):
    path.write_bytes(b"".join(l + b"\n" for l in lines))


def _byte_lines():
    return [base64.b64encode(bytes([b])) + b" " + str(b).encode() for b in range(256)]


def test_corrupt_bad_base64(tmp_path):
    lines = _byte_lines()
    lines[2] = b"!!notbase64!! 2"
    _write_lines(tmp_path / "tiktoken.model", lines)
    with pytest.raises(TokenizerError, match=r"line 3: bad base64"):
        K3TiktokenTokenizer(str(tmp_path))


def test_corrupt_non_contiguous_ranks(tmp_path):
    lines = _byte_lines() + [base64.b64encode(b"ab") + b" 300"]
    _write_lines(tmp_path / "tiktoken.model", lines)
    with pytest.raises(TokenizerError, match=r"line 257: rank 300 .*expected 256"):
        K3TiktokenTokenizer(str(tmp_path))


def test_corrupt_other(tmp_path):
    _write_lines(tmp_path / "tiktoken.model", _byte_lines()[:10] + [b"YQ== 10 extra"])
    with pytest.raises(TokenizerError, match="line 11: expected 'base64token rank'"):
        K3TiktokenTokenizer(str(tmp_path))
    _write_lines(tmp_path / "tiktoken.model", _byte_lines()[:10] + [b"YQ== ten"])
    with pytest.raises(TokenizerError, match="line 11: rank 'ten'"):
        K3TiktokenTokenizer(str(tmp_path))
    _write_lines(tmp_path / "tiktoken.model", _byte_lines()[:100])
    with pytest.raises(TokenizerError, match="256 single bytes"):
        K3TiktokenTokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="not found"):
        K3TiktokenTokenizer(str(tmp_path / "missing.model"))


def test_write_tiktoken_model_round_trip(tmp_path):
    ranks = train_bpe_ranks(["hello hello world world world"], 5)
    write_tiktoken_model(ranks, str(tmp_path / "x.model"))
    assert read_tiktoken_model(str(tmp_path / "x.model")) == ranks


# ---------------------------------------------------------------------------------------------
# HF wrapper, detection, model match

def test_hf_wrapper_interface(hf_dir):
    d, base = hf_dir
    t = HFTokenizerWrapper(d)
    assert t.vocab_size == base + 256
    assert (t.bos_id, t.eod_id, t.eos_id, t.pad_id) == (base, base + 1, base + 2, base + 255)
    assert t.token_to_id("<|open|>") == base + 3
    for text in UNICODE_CASES:
        ids = t.encode(text)
        assert not any(t.is_special(i) for i in ids)
        assert t.decode(ids) == text
    text = "x<|open|>y"
    assert t.token_to_id("<|open|>") not in t.encode(text)
    assert t.token_to_id("<|open|>") in t.encode(text, allow_special=True)
    assert t.decode(t.encode(text, allow_special=True), skip_special=True) == "xy"
    i = t.token_to_id(" world")
    assert t.id_to_token(i) == " world"
    check_tokenizer_matches(t, base + 256)


def test_load_tokenizer_detection(toy_dir, hf_dir, tmp_path):
    hd, _ = hf_dir
    assert isinstance(load_tokenizer(toy_dir), K3TiktokenTokenizer)
    assert isinstance(load_tokenizer(os.path.join(toy_dir, "tiktoken.model")), K3TiktokenTokenizer)
    assert isinstance(load_tokenizer(hd), HFTokenizerWrapper)
    assert isinstance(load_tokenizer(os.path.join(hd, "tokenizer.json")), HFTokenizerWrapper)
    assert load_tokenizer(toy_dir, backend="python").backend == "python"
    with pytest.raises(TokenizerError, match="no tiktoken.model or tokenizer.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "weird.bin").write_bytes(b"x")
    with pytest.raises(TokenizerError, match="cannot tell"):
        load_tokenizer(str(tmp_path / "weird.bin"))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        load_tokenizer(str(tmp_path))


def test_check_tokenizer_matches(tok):
    v = tok.vocab_size
    check_tokenizer_matches(tok, v)
    check_tokenizer_matches(tok, v + 64)        # padded embedding table is fine
    with pytest.raises(TokenizerError, match="model vocab_size"):
        check_tokenizer_matches(tok, v - 1)      # tokenizer ids exceed the model
    with pytest.raises(TokenizerError, match="do not match"):
        check_tokenizer_matches(tok, 163840)     # e.g. the real K3 model with the toy tokenizer

    class Cfg:
        vocab_size = v
        bos_token_id = tok.bos_id
        eos_token_id = tok.eos_id
        pad_token_id = tok.pad_id
    check_tokenizer_matches(tok, Cfg())
    Cfg.eos_token_id = tok.eod_id
    with pytest.raises(TokenizerError, match="eos_token_id"):
        check_tokenizer_matches(tok, Cfg())


def test_k3_config_ids_match_special_table():
    from k3.config import K3Config
    cfg = K3Config()
    sp = k3_special_tokens(cfg.vocab_size - 256)
    assert (sp["[BOS]"], sp["<|end_of_msg|>"], sp["[PAD]"]) == (cfg.bos_token_id, cfg.eos_token_id,
                                                                 cfg.pad_token_id)
