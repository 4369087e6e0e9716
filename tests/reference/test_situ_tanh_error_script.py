"""Smoke test of benchmarks/situ_tanh_error.py on CPU (no Triton kernels there: it must say so and still measure
the exact path against fp64)."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_situ_tanh_error_script_runs_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("situ_tanh_error",
                                                  os.path.join(ROOT, "benchmarks", "situ_tanh_error.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "r.json"
    mod.main(["--preset", "tiny", "--batch", "1", "--seq", "8", "--no-sweep", "--device", "cpu", "--out", str(out)])
    res = json.loads(out.read_text())
    assert not res["kernels_measured"] and "CUDA-only" in res["note"]
    kinds = {r["site"] for r in res["rows"]}
    assert kinds == {"dense", "shared", "routed"}
    for r in res["rows"]:
        # the eager fp32 formula rounds to bf16 correctly up to fp32 noise: <= ~half an ulp from fp64
        assert r["max_ulp_bf16"] <= 0.51, r
