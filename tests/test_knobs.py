"""The knob table (k3/knobs.py): one module reads the environment, docs/knobs.md is the generated table, every knob
is reachable from Python, the environment overrides the Python setting, bad values are refused by name."""
import os
import re

import pytest
import torch

from k3 import knobs
from k3.errors import K3ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ENV_READERS_NOT_YET_CONVERTED: set = set()   # every module reads the environment through k3.knobs


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in knobs.KNOBS:
        if name != "TRITON_INTERPRET":
            monkeypatch.delenv(name, raising=False)
    knobs.reset()
    yield
    knobs.reset()


def test_docs_page_is_the_generated_table():
    with open(os.path.join(ROOT, "docs", "knobs.md")) as f:
        page = f.read()
    assert page == knobs.table_markdown(), \
        "docs/knobs.md is stale: regenerate it with python -c \"from k3 import knobs; " \
        "open('docs/knobs.md', 'w').write(knobs.table_markdown())\""
    for name in knobs.KNOBS:
        assert f"`{name}`" in page


def test_only_knobs_module_reads_the_environment():
    pat = re.compile(r"os\.environ|getenv|from os import .*environ|putenv")
    offenders, stale = [], []
    for dp, _, fns in os.walk(os.path.join(ROOT, "k3")):
        for fn in fns:
            if not fn.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dp, fn), ROOT).replace(os.sep, "/")
            with open(os.path.join(dp, fn), encoding="utf-8") as f:
                hit = bool(pat.search(f.read()))
            if rel == "k3/knobs.py":
                assert hit
            elif hit and rel not in ENV_READERS_NOT_YET_CONVERTED:
                offenders.append(rel)
            elif not hit and rel in ENV_READERS_NOT_YET_CONVERTED:
                stale.append(rel)
    assert not offenders, f"read the environment through k3.knobs, not in {offenders}"
    assert not stale, f"converted: drop {stale} from ENV_READERS_NOT_YET_CONVERTED"


def test_every_knob_is_documented_and_read_where_it_says():
    for name, k in knobs.KNOBS.items():
        assert k.kind in ("user", "experiment", "debug", "external"), name
        assert k.values and k.default_text and k.doc and k.python and k.readers, name
        for r in k.readers:
            with open(os.path.join(ROOT, r), encoding="utf-8") as f:
                src = f.read()
            assert name in src or f'"{name}"' in src, (name, r)


def test_allowed_values_match_the_modules():
    from k3.ops.kda.triton.chunk import BWD_IMPLS
    assert set(knobs.KNOBS["K3_KDA_TRITON_BWD"].values.replace("`", "").split(", ")) == set(BWD_IMPLS)


def test_precedence_set_override_reset(monkeypatch):
    assert knobs.get("K3_SITU_TANH") == "auto" and knobs.source("K3_SITU_TANH") == "default"
    knobs.set(K3_SITU_TANH="approx")
    assert knobs.get("K3_SITU_TANH") == "approx" and knobs.source("K3_SITU_TANH") == "python"
    with knobs.override(K3_SITU_TANH="exact"):
        assert knobs.get("K3_SITU_TANH") == "exact"
        with knobs.override(K3_SITU_TANH=None):        # None: no Python setting inside the block
            assert knobs.get("K3_SITU_TANH") == "auto"
        assert knobs.get("K3_SITU_TANH") == "exact"
    assert knobs.get("K3_SITU_TANH") == "approx"
    monkeypatch.setenv("K3_SITU_TANH", " Exact ")        # the environment overrides (stripped, case-folded)
    assert knobs.get("K3_SITU_TANH") == "exact" and knobs.source("K3_SITU_TANH") == "environment"
    assert knobs.python_value("K3_SITU_TANH") == "approx"
    monkeypatch.setenv("K3_SITU_TANH", "")              # empty counts as unset
    assert knobs.get("K3_SITU_TANH") == "approx"
    knobs.reset("K3_SITU_TANH")
    assert knobs.get("K3_SITU_TANH") == "auto"


def test_unknown_names_bad_values_and_external_variables():
    with pytest.raises(K3ConfigError, match="unknown knob 'K3_NOPE'.*K3_BACKEND"):
        knobs.get("K3_NOPE")
    with pytest.raises(K3ConfigError, match="unknown knob"):
        knobs.set(K3_NOPE=1)
    with pytest.raises(K3ConfigError, match=r"K3_SITU_TANH must be one of auto, approx, exact, got 'fast' \(from knobs"):
        knobs.set(K3_SITU_TANH="fast")
    with pytest.raises(K3ConfigError, match="K3_FUSED_CE must be 0 or 1"):
        knobs.set(K3_FUSED_CE="yes")
    with pytest.raises(K3ConfigError, match="TRITON_INTERPRET is read from the environment only"):
        knobs.set(TRITON_INTERPRET=True)
    with pytest.raises(K3ConfigError):   # a failed set changes nothing
        knobs.set(K3_SITU_NODE=True, K3_SITU_TANH="fast")
    assert knobs.source("K3_SITU_NODE") == "default"
    with pytest.raises(K3ConfigError, match="K3_KDA_STATE_CFG must be a JSON object"):
        knobs.set(K3_KDA_STATE_CFG="[1]")
    assert knobs.KNOBS["K3_KDA_BWD_LAUNCH"].parse('{"pmat": {"INV_PREC": "tf32"}}') == {"pmat": {"INV_PREC": "tf32"}}


# ------------------------------------------------------------------- each converted knob, through its reader

def test_backend(monkeypatch):
    from k3.ops import dispatch
    knobs.set(K3_BACKEND="kda:torch,moe:padded_bmm")
    assert dispatch.env_choice("kda") == "torch" and dispatch.env_choice("moe") == "padded_bmm"
    assert dispatch.env_choice("conv") is None
    monkeypatch.setenv("K3_BACKEND", "moe:loop")      # the environment replaces the Python spec as a whole
    assert dispatch.env_choice("moe") == "loop" and dispatch.env_choice("kda") is None
    monkeypatch.setenv("K3_BACKEND", "kda:")
    with pytest.raises(K3ConfigError, match=r"K3_BACKEND must be a backend name, or op:name pairs.*'kda:'"):
        dispatch.env_choice("kda")
    monkeypatch.delenv("K3_BACKEND")
    with knobs.override(K3_BACKEND="moe:grouped_mm"):
        assert dispatch.env_choice("moe") == "grouped_mm"


def test_triton_interpret(monkeypatch):
    from k3.ops import dispatch
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.triton_interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not dispatch.triton_interpreting()


def test_fused_ce(monkeypatch, micro_model_overrides):
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    cfg = K3Config.from_preset("tiny", **micro_model_overrides)
    assert K3ForCausalLM(cfg, init=False).fused_ce is True
    with knobs.override(K3_FUSED_CE=False):
        assert K3ForCausalLM(cfg, init=False).fused_ce is False
        monkeypatch.setenv("K3_FUSED_CE", "1")
        assert K3ForCausalLM(cfg, init=False).fused_ce is True
        monkeypatch.setenv("K3_FUSED_CE", "no")
        with pytest.raises(K3ConfigError, match=r"K3_FUSED_CE must be 0 or 1, got 'no' \(from the environment\)"):
            K3ForCausalLM(cfg, init=False)


def test_muon_fused(monkeypatch, micro_model_overrides):
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.ops import dispatch
    from k3.train.optim import build_optimizer
    monkeypatch.setattr(dispatch, "triton_runs", lambda: False)
    model = K3ForCausalLM(K3Config.from_preset("tiny", **micro_model_overrides), init=False)
    assert build_optimizer(model, lr=0.01).fused is False
    with knobs.override(K3_MUON_FUSED=True):
        with pytest.raises(K3ConfigError, match="K3_MUON_FUSED"):   # nowhere to run the kernels
            build_optimizer(model, lr=0.01)
        monkeypatch.setenv("K3_MUON_FUSED", "0")
        assert build_optimizer(model, lr=0.01).fused is False
        monkeypatch.setenv("K3_MUON_FUSED", "yes")
        with pytest.raises(K3ConfigError, match="K3_MUON_FUSED must be 0 or 1"):
            build_optimizer(model, lr=0.01)
        assert build_optimizer(model, lr=0.01, fused=False).fused is False   # the argument wins


def test_situ_node_and_triton(monkeypatch):
    from k3.ops import activations as A
    x = torch.zeros(2)
    assert not A._use_node(x)
    knobs.set(K3_SITU_NODE=True)
    assert A._use_node(x)
    monkeypatch.setenv("K3_SITU_NODE", "0")
    assert not A._use_node(x)
    monkeypatch.setenv("K3_SITU_NODE", "2")
    with pytest.raises(K3ConfigError, match="K3_SITU_NODE must be 0 or 1"):
        A._use_node(x)
    assert knobs.get("K3_SITU_TRITON") is True
    knobs.set(K3_SITU_TRITON=False)
    assert knobs.get("K3_SITU_TRITON") is False
    monkeypatch.setenv("K3_SITU_TRITON", "1")
    assert knobs.get("K3_SITU_TRITON") is True
    monkeypatch.setenv("K3_SITU_TRITON", "off")
    with pytest.raises(K3ConfigError, match="K3_SITU_TRITON must be 0 or 1"):
        knobs.get("K3_SITU_TRITON")


def test_situ_tanh(monkeypatch):
    pytest.importorskip("triton")
    from k3.ops import activations_triton as at
    x = torch.zeros(2, dtype=torch.bfloat16)
    assert knobs.get("K3_SITU_TANH") == "auto" and not at._approx(x)   # CPU tensors: always exact
    knobs.set(K3_SITU_TANH="exact")
    monkeypatch.setenv("K3_SITU_TANH", "APPROX")
    assert knobs.get("K3_SITU_TANH") == "approx"
    monkeypatch.setenv("K3_SITU_TANH", "fast")
    with pytest.raises(K3ConfigError, match=r"K3_SITU_TANH must be one of auto, approx, exact, got 'fast'"):
        at._approx(x)


def test_cache_dir(monkeypatch, tmp_path):
    from k3.train.data import cache_dir
    knobs.set(K3_CACHE=str(tmp_path / "py"))
    assert cache_dir() == str(tmp_path / "py")
    monkeypatch.setenv("K3_CACHE", str(tmp_path / "env"))
    assert cache_dir() == str(tmp_path / "env")
    assert cache_dir(str(tmp_path / "arg")) == str(tmp_path / "arg")
    with pytest.raises(K3ConfigError, match="K3_CACHE must be a string"):
        knobs.set(K3_CACHE=3)


def test_knobs_trace_under_torch_compile():
    """Compiled code reads knobs while tracing (as os.environ before): no graph break, and a changed Python
    setting is seen on the next call (Dynamo guards on the settings)."""
    def f(x):
        return x * 2 if knobs.get("K3_SITU_NODE") else x + 1
    c = torch.compile(f, fullgraph=True, backend="eager")
    x = torch.full((2,), 3.0)
    assert c(x).tolist() == [4.0, 4.0]
    with knobs.override(K3_SITU_NODE=True):
        assert c(x).tolist() == [6.0, 6.0]
