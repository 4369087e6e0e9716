"""Profile single-token decode steps of a preset (where does a decode step's time go?).

    python benchmarks/profile_decode.py --device cuda --preset small --context 512 --steps 3
    python benchmarks/profile_decode.py --preset tiny --static              # the fused StaticDecoder step
    python benchmarks/profile_decode.py --device cuda --preset small --static --cuda-graph

Prints ms/step (wall clock, median of --steps after warm-up), the number of aten ops one step dispatches (all
ops, and ops that are not views/reshapes: roughly the kernels an eager CUDA step launches), host syncs seen in the
step (`aten::item` / `aten::_local_scalar_dense`), and a profiler table (--table). With --cuda-graph the op count
is the one of the captured step (a replay is one graph launch).
"""
import argparse
import collections
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from k3.config import K3Config
from k3.generation.cache import K3Cache
from k3.generation.static import StaticDecoder
from k3.model import K3ForCausalLM

VIEWS = {"view", "_unsafe_view", "as_strided", "slice", "select", "expand", "unsqueeze", "squeeze", "transpose",
         "t", "permute", "split", "split_with_sizes", "chunk", "unbind", "narrow", "alias", "detach", "reshape",
         "unfold", "view_as", "expand_as", "contiguous", "to", "_to_copy_noop", "lift_fresh"}
SYNCS = {"item", "_local_scalar_dense", "tolist", "nonzero", "is_nonzero"}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--static", action="store_true", help="time the StaticDecoder step instead of model(...)")
    ap.add_argument("--cuda-graph", action="store_true", help="with --static on CUDA: capture + replay")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--table", action="store_true", help="print the profiler table")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    cfg = K3Config.from_preset(a.preset)
    torch.manual_seed(0)
    with dev:
        model = K3ForCausalLM(cfg).to(dtype).eval()
    cache = K3Cache.for_model(model, a.batch, max_length=a.context + 8 + a.steps * 2)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.context), device=dev)
    tok = torch.randint(0, cfg.vocab_size, (a.batch, 1), device=dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        model(ids, cache=cache, logits_to_keep=1)
        cache.advance(a.context)
        if a.static:
            dec = StaticDecoder(model, cache, a.batch, cuda_graph=a.cuda_graph and dev.type == "cuda")

            def step():
                return dec.step(tok)
        else:
            def step():
                out = model(tok, cache=cache, logits_to_keep=1).logits[:, -1].float()
                cache.advance(1)
                return out
        for _ in range(3):
            step()
        with OpCounter() as oc:     # one step (for --cuda-graph: a replay, i.e. no aten ops on the host)
            if a.static and a.cuda_graph and dev.type == "cuda":
                pass
            else:
                step()
        if a.static and a.cuda_graph and dev.type == "cuda":
            with OpCounter() as oc:
                dec._forward()       # what the graph holds (runs one extra real step: timing only)
        n_all = sum(oc.ops.values())
        n_real = sum(v for k, v in oc.ops.items() if k not in VIEWS)
        n_sync = sum(v for k, v in oc.ops.items() if k in SYNCS)
        times = []
        for _ in range(a.steps):
            sync()
            t = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t)
        mode = "static" + ("+cuda-graph" if a.cuda_graph and dev.type == "cuda" else "") if a.static else "eager"
        print(f"preset {a.preset} {dev.type} {str(dtype).replace('torch.', '')} batch {a.batch} context "
              f"{a.context} {mode}: {statistics.median(times) * 1e3:.2f} ms/step (median of {a.steps}); "
              f"ops/step {n_all} (non-view {n_real}); host syncs/step {n_sync}")
        print("top ops:", ", ".join(f"{k} {v}" for k, v in oc.ops.most_common(15)))
        if a.table:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with profile(activities=acts) as prof:
                for _ in range(a.steps):
                    step()
                sync()
            key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=25))


if __name__ == "__main__":
    main()
