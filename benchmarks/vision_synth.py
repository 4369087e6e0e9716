"""Learning check of the multimodal path: the `tiny` multimodal model on the synthetic image task (k3.vision.synth).

    PYTHONPATH=. python benchmarks/vision_synth.py --micro --time-budget 480 --seq-len 2048 --lr 2e-2 --adamw-lr 3e-3 \
        --warmup 5 --text-every 0 --sizes 84 --eval-n 120 --no-eval-before [--json out.json]

Trains from scratch on CPU for a wall-clock budget and prints held-out accuracy (argmax over the answer choices)
before and after, the chance level, steps and times. Results: benchmarks/vision_synth.md.
"""
import argparse
import json
import os
import sys
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads [1]: on a shared CPU 2 threads ran "
                    "~25x slower per step (OpenMP threads spinning against other jobs)")
    ap.add_argument("--time-budget", type=float, default=420.0, help="training seconds (evaluation excluded)")
    ap.add_argument("--steps", type=int, default=None, help="fixed step count (default: as the budget allows)")
    ap.add_argument("--lr", type=float, default=6e-3)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--eval-n", type=int, default=120)
    ap.add_argument("--text-every", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks", default="colour,shape,count,position")
    ap.add_argument("--train-weights", default=None, help="how often each of --tasks is drawn in training, "
                    "comma-separated (held-out examples stay uniform) [uniform]")
    ap.add_argument("--sizes", default=None, help="image side lengths in px, comma-separated [84,112]")
    ap.add_argument("--adamw-lr", type=float, default=None, help="LR of the AdamW parameters (embeddings, lm_head, "
                    "norms, the patch embedding) [--lr]")
    ap.add_argument("--micro", action="store_true", help="the micro text model (k3.vision.train.MICRO_TEXT) "
                    "instead of the tiny preset's (for a loaded CPU)")
    ap.add_argument("--no-eval-before", action="store_true", help="skip the evaluation before training (chance "
                    "is known; saves minutes on a loaded CPU)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(a.threads)
    from k3.vision.train import MICRO_TEXT, train_vision_synth
    t = time.time()
    res = train_vision_synth(steps=a.steps, time_budget_s=a.time_budget, lr=a.lr, warmup=a.warmup, seq_len=a.seq_len,
                             eval_n=a.eval_n, text_every=a.text_every, seed=a.seed, tasks=a.tasks.split(","),
                             sizes=[int(x) for x in a.sizes.split(",")] if a.sizes else None, adamw_lr=a.adamw_lr,
                             eval_before=not a.no_eval_before,
                             train_weights=([float(x) for x in a.train_weights.split(",")] if a.train_weights
                                            else None),
                             log_fn=lambda s: print(s, flush=True), **(MICRO_TEXT if a.micro else {}))
    out = {k: res[k] for k in ("before", "after", "chance", "steps", "train_s", "examples_seen")}
    out.update(wall_s=time.time() - t, threads=a.threads, micro=a.micro, lr=a.lr, adamw_lr=a.adamw_lr,
               sizes=a.sizes, train_weights=a.train_weights, load_avg=os.getloadavg(), warmup=a.warmup,
               seq_len=a.seq_len,
               first_losses=res["losses"][:3], last_losses=res["losses"][-3:],
               params=sum(p.numel() for p in res["model"].parameters()), torch=torch.__version__,
               command="python benchmarks/vision_synth.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
