"""The claim scripts (benchmarks/claims/*.py) run end to end at the micro size: a smoke run each of the report
path (k3.sweep, the JSON / markdown report, plots) and of the per-layer probes. Their numbers say nothing here."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script,extra,key", [
    ("balancing.py", [], "maxvio"),
    ("attnres.py", ["--block-sizes", "2"], "act_rms_by_layer"),
    ("mla_gate.py", [], "first_token_ratio"),
])
def test_claim_script_micro_run_writes_its_report(tmp_path, script, extra, key):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "claims", script), "--micro", "--steps", "2",
                        "--seeds", "1", "--threads", "1", "--out", str(out)] + extra,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    name = script[:-3]
    rep = json.loads((out / f"{name}.json").read_text())
    assert rep["groups"] and all(g["n"] == 1 and not g["failed"] for g in rep["groups"]), rep["groups"]
    assert key in json.dumps(rep)
    assert (out / f"{name}.md").read_text().startswith("# ")
    assert any(p.suffix == ".png" for p in out.iterdir())


def _claim(script, *args):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", "claims", script), "--micro", "--steps",
                             "2", "--threads", "1", "--val-tokens", "256"] + [str(a) for a in args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _done(proc, ok=True):
    out, err = proc.communicate(timeout=300)
    if ok:
        assert proc.returncode == 0, err[-3000:]
    return proc.returncode, out, err


def test_first_seed_and_merge_report_split_seeds_together(tmp_path):
    """Seed 0 in job A and seed 1 (--first-seed 1) in job B; `--seeds 2 --out A --merge B` takes B's finished runs
    into A and reports both seeds without training again. situ.py: its GLUMaxAct step metric is in metrics.jsonl."""
    a, b = tmp_path / "a", tmp_path / "b"
    jobs = [_claim("situ.py", "--seeds", 1, "--out", a),  # side by side, as the split jobs run
            _claim("situ.py", "--seeds", 1, "--first-seed", 1, "--out", b)]
    for j in jobs:
        _done(j)
    b_runs = sorted((b / "sweep" / "runs").glob("*/seed1"))
    assert len(b_runs) == 2 and not list((b / "sweep" / "runs").glob("*/seed0"))
    _, out, err = _done(_claim("situ.py", "--seeds", 2, "--out", a, "--merge", b))
    assert "took 2 finished run(s)" in err
    assert "4 run(s)" in out and "4 finished before, 0 to run" in out, out
    rep = json.loads((a / "situ.json").read_text())
    assert sorted(g["variant"] for g in rep["groups"]) == ["SiTU-GLU", "SwiGLU"]
    assert all(g["n"] == 2 and not g["failed"] for g in rep["groups"]), rep["groups"]
    for run in b_runs:  # not retrained: the merged run is B's, byte for byte
        merged = a / "sweep" / "runs" / run.parent.name / "seed1" / "metrics.jsonl"
        assert merged.read_bytes() == (run / "metrics.jsonl").read_bytes()
    logs = sorted((a / "sweep" / "runs").glob("*/seed*/metrics.jsonl"))
    assert len(logs) == 4
    for m in logs:
        train = [json.loads(l) for l in m.read_text().splitlines() if '"train"' in l]
        assert len(train) == 2 and all(isinstance(t.get("glu_max_abs"), float) for t in train), m

    # --report-only asked for a third seed: nothing trains, the missing runs are named, the report keeps n = 2
    _, out, err = _done(_claim("situ.py", "--seeds", 3, "--out", a, "--report-only"))
    assert "2 run(s) not trained (--report-only)" in err and "seed 2" in err, err[-2000:]
    assert not list((a / "sweep" / "runs").glob("*/seed2"))
    assert all(g["n"] == 2 for g in json.loads((a / "situ.json").read_text())["groups"])

    bad = a / "situ.json"
    rc, _, err = _done(_claim("situ.py", "--seeds", 2, "--out", tmp_path / "c", "--merge", bad), ok=False)
    assert rc != 0 and f"--merge: {bad} is not a directory" in err, err[-2000:]


def test_stages_reports_training_flops_by_row_length(tmp_path):
    """stages.py's cost column: FLOPs summed over the steps at each step's row length; the direct run (all steps at
    the long length) against a written-out count, and the staged run cheaper (its short steps' MLA attention); the
    equal-FLOPs direct run within one step below the staged run's FLOPs."""
    from k3.config import K3Config
    out = tmp_path / "st"
    _done(_claim("stages.py", "--seeds", "1", "--steps", "4", "--short", "32", "--long", "64", "--short-share", "0.5",
                 "--batch-tokens", "256", "--equal-flops", "--out", out))
    rep = json.loads((out / "stages.json").read_text())
    g = {x["variant"]: x for x in rep["groups"]}
    assert g["staged"]["n"] == g["direct"]["n"] == 1
    cfg = K3Config.from_json(str(next(out.glob("sweep/runs/*/seed0/config.json"))))
    from k3.info import count_params
    act = count_params(cfg)["active_params"]

    def per_token(t):  # 6 x active params + causal MLA attention (fwd+bwd) + KDA's chunked form (C = 64)
        H, K = cfg.num_attention_heads, cfg.linear_attn_config.head_dim
        mla = 3 * 2 * H * (cfg.qk_head_dim + cfg.v_head_dim) * (t + 1) / 2
        kda = 3 * cfg.linear_attn_config.num_heads * (2 * 64 * 2 * K + 6 * K * K)
        return 6 * act + mla * cfg.layer_types.count("mla") + kda * cfg.layer_types.count("kda")
    assert abs(g["direct"]["train_pflop"][0] - 4 * 256 * per_token(64) / 1e15) < 1e-12
    assert abs(g["staged"]["train_pflop"][0] - 2 * 256 * (per_token(32) + per_token(64)) / 1e15) < 1e-12
    assert g["staged"]["train_pflop"][0] < g["direct"]["train_pflop"][0]
    # --equal-flops: the direct run gets the most whole steps whose FLOPs stay within the staged run's (3 of 4 here)
    eq = g["direct (equal FLOPs, 3 steps)"]
    assert eq["n"] == 1 and abs(eq["train_pflop"][0] - 3 * 256 * per_token(64) / 1e15) < 1e-12
    assert eq["train_pflop"][0] <= g["staged"]["train_pflop"][0] < eq["train_pflop"][0] + 256 * per_token(64) / 1e15


def _probes():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "claims"))
    try:
        import claim_probes
    finally:
        sys.path.pop(0)
    return claim_probes


def test_first_token_mass_per_document_against_the_written_out_formula():
    """claim_probes.segment_first_token_mass against an fp64 loop over documents, heads and queries
    (p_t0 = exp(q_t.k_0 s) / sum_{j<=t} exp(q_t.k_j s)); zero queries attend uniformly, so the mass is the uniform
    mass; documents are not crossed (one segment over all tokens gives another number)."""
    import torch
    cp = _probes()
    g = torch.Generator().manual_seed(3)
    N, H, D, scale = 23, 3, 8, 0.4
    q, k = torch.randn(1, N, H, D, generator=g), torch.randn(1, N, H, D, generator=g)
    k[0, [0, 5, 17]] *= 3.0                                  # make first keys stand out
    cu = torch.tensor([0, 5, 6, 17, N], dtype=torch.int32)    # documents of 5, 1, 11 and 6 tokens
    mass = uni = n = 0.0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for t in range(1, b - a):
            for h in range(H):
                logits = [float(q[0, a + t, h].double() @ k[0, a + j, h].double()) * scale for j in range(t + 1)]
                m = max(logits)
                w = [math.exp(x - m) for x in logits]
                mass += w[0] / sum(w) / H
            uni += 1.0 / (t + 1)
            n += 1
    got = cp.segment_first_token_mass(q, k, cu, scale)
    assert got[0] == pytest.approx(mass / n, rel=1e-5) and got[1] == pytest.approx(uni / n, rel=1e-12)
    zero = cp.segment_first_token_mass(torch.zeros_like(q), k, cu, scale)
    assert zero[0] == pytest.approx(zero[1], rel=1e-6)
    assert cp.segment_first_token_mass(q, k, None, scale)[0] != pytest.approx(got[0], rel=1e-3)
    # two rows without cu_seqlens: each row one document
    q2, k2 = torch.cat([q, q]), torch.cat([k, k])
    one_row = cp.segment_first_token_mass(q, k, None, scale)
    assert cp.segment_first_token_mass(q2, k2, None, scale) == pytest.approx(one_row)


def test_pysrc_corpus_one_document_per_source_file(tmp_path):
    """benchmarks/claims/pysrc_corpus.py: every non-empty UTF-8 .py file of the tree, sorted by path, named
    relative to the root; caches, site-packages, other files and undecodable files left out; the same tree gives
    the same bytes."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "claims"))
    try:
        import pysrc_corpus
    finally:
        sys.path.pop(0)
    root = tmp_path / "lib"
    for rel, data in [("b.py", "x = 1\n"), ("a.py", "def f():\n    return 2\n"), ("pkg/c.py", "# c\n"),
                      ("pkg/__pycache__/c.py", "cached\n"), ("site-packages/d.py", "third party\n"),
                      ("notes.txt", "not source\n"), ("empty.py", "  \n")]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(data)
    (root / "latin.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    out = tmp_path / "c.jsonl"
    assert pysrc_corpus.write_corpus(str(out), str(root)) == (3, 6 + 22 + 4)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["name"] for r in rows] == ["a.py", "b.py", os.path.join("pkg", "c.py")]
    assert rows[0]["text"] == "def f():\n    return 2\n"
    first = out.read_bytes()
    pysrc_corpus.write_corpus(str(out), str(root))
    assert out.read_bytes() == first and not list(tmp_path.glob("c.jsonl.tmp*"))
    (tmp_path / "no_source").mkdir()
    (tmp_path / "no_source" / "notes.txt").write_text("text\n")
    for bad in (tmp_path / "missing", tmp_path / "no_source"):
        with pytest.raises(ValueError, match=str(bad.name)):
            pysrc_corpus.write_corpus(str(out), str(bad))
        assert out.read_bytes() == first and not list(tmp_path.glob("c.jsonl.tmp*"))


def test_rms_summary_leaves_the_embedding_out():
    """ActivationNorms' summary: the max and the growth (final / second layer's input) skip entry 0, the embedding,
    whose own small scale would otherwise dominate the ratio."""
    s = _probes().rms_summary([0.05, 2.0, 7.0, 5.0, 4.0])
    assert s == {"act_rms_max": 7.0, "act_rms_growth": 2.0, "act_rms_final": 4.0}
