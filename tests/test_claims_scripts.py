"""The claim scripts (benchmarks/claims/*.py) run end to end at the micro size: a smoke run each of the report
path (k3.sweep, the JSON / markdown report, plots) and of the per-layer probes. Their numbers say nothing here."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script,extra,key", [
    ("balancing.py", [], "maxvio"),
    ("attnres.py", ["--block-sizes", "2"], "act_rms_by_layer"),
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
