"""Per run directory of `k3 train`: steps, skipped (non-finite) steps, max / median grad norm, the first step whose
grad norm exceeds 10x the median so far, and the last logged loss. Usage: python benchmarks/train_stability.py RUN...
(the `kda-stability` stage of gpu_run.sh compares the KDA paths with it)."""
import json
import os
import statistics
import sys


def summary(run: str) -> dict:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if r.get("type") == "train"]
    norms, spike = [], None
    for r in steps:
        g = r.get("grad_norm")
        if g is not None:
            if spike is None and len(norms) >= 5 and g > 10 * statistics.median(norms):
                spike = r["step"]
            norms.append(g)
    losses = [r["loss"] for r in steps if r.get("loss") is not None]
    return {"run": run, "steps": len(steps), "skipped": sum(bool(r.get("skipped")) for r in steps),
            "max_grad_norm": max(norms) if norms else None,
            "median_grad_norm": statistics.median(norms) if norms else None,
            "first_spike_step": spike, "last_loss": losses[-1] if losses else None}


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for run in sys.argv[1:]:
        try:
            print(json.dumps(summary(run)))
        except (OSError, ValueError) as e:
            print(json.dumps({"run": run, "error": str(e)}))
