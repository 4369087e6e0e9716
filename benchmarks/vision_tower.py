"""Vision benchmark: images/s and ms per image through preprocessing + MoonViT-V2 tower + projector.

    python benchmarks/vision_tower.py [--config tiny|kimi-k3] [--config-json config.json] [--sizes 256 1024 2048]
                                      [--reps 3] [--threads N] [--attn auto|sdpa|varlen ...] [--json out.json]

Defaults: on CPU the `tiny` tower in fp32 with the per-image SDPA path; on CUDA the released width (`kimi-k3`, the
release's vision_config; or `--config-json` = a config.json whose `vision_config` is used; random weights) in bf16,
measured with both attention paths: `varlen` (one flash varlen call over the packed images,
torch.nn.attention.varlen) and `sdpa` (one SDPA call per image), after checking that they agree on 3 packed images.
One square RGB image per measurement (random pixels, PNG-free: a PIL image in memory), so preprocessing = resize
plan + RGB conversion + pad + normalise + patchify (no resize below the 65,536-patch budget: 2048^2 -> 148x148
patches). Prints medians; the first call per size and path is a warm-up.
"""
import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch
from PIL import Image

from k3.vision import VisionConfig, VisionModel, preprocess


def timed(fn, sync, reps):
    ts, out = [], None
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None, help="vision preset (default: tiny on CPU, kimi-k3 on CUDA)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--attn", nargs="+", default=None, choices=["auto", "sdpa", "varlen"],
                    help="attention paths to measure (default: varlen and sdpa on CUDA, sdpa on CPU)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1],
                    help="images packed per tower call (copies of the one image; images/s counts all of them)")
    ap.add_argument("--config-json", default=None, help="take the tower config from this file's vision_config")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    name = a.config or ("kimi-k3" if dev.type == "cuda" else "tiny")
    dtype = getattr(torch, a.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    if a.config_json:
        with open(a.config_json) as f:
            cfg = VisionConfig.from_dict(json.load(f))   # a container config: its vision_config is taken
        name = a.config_json
    else:
        cfg = VisionConfig.preset(name)
    with torch.device(dev):
        vm = VisionModel(cfg)
    vm = vm.to(dtype).eval()
    impls = a.attn or (["varlen", "sdpa"] if dev.type == "cuda" else ["sdpa"])
    res = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "device": str(dev),
           "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
           "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "config": name, "params": sum(p.numel() for p in vm.parameters()),
           "dtype": str(dtype).replace("torch.", ""), "attn": impls, "rows": []}
    print(f"# {name} vision tower + projector ({res['params'] / 1e6:.1f}M params), {res['dtype']}, {dev}, "
          f"torch {torch.__version__}, {res['threads']} threads, attention {impls}")
    rng = np.random.default_rng(0)
    if len(impls) > 1:   # the paths agree on packed images of different shapes before anything is timed
        imgs = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in
                ((224, 336), (112, 112), (448, 280))]
        pv, grid = preprocess(imgs, cfg)
        outs = {}
        with torch.inference_mode():
            for impl in list(impls):
                vm.vision_tower.attn_impl = impl
                try:
                    outs[impl] = vm(pv.to(dev), grid)[0].float()
                except (RuntimeError, NotImplementedError, ImportError) as e:   # e.g. no flash kernel here
                    print(f"# attention path {impl!r} failed, not measured: {type(e).__name__}: {str(e)[:300]}")
                    res.setdefault("failed", {})[impl] = f"{type(e).__name__}: {str(e)[:300]}"
                    impls.remove(impl)
        base = outs[impls[-1]]
        diff = {impl: float((o - base).abs().max()) for impl, o in outs.items()}
        res["max_abs_diff_vs_" + impls[-1]] = diff
        print(f"# max |out - {impls[-1]}| on 3 packed images: {diff} (output scale {float(base.abs().max()):.3g})")
    print("per image: prep = preprocessing, tower = tower + projector (a call of `batch` packed images / batch), "
          "img/s = 1 / (prep + tower)")
    print(f"{'size':>6} {'batch':>5} {'attn':>7} {'patches':>8} {'tokens':>7} {'prep ms':>8} {'tower ms':>9} "
          f"{'total ms':>9} {'img/s':>8} {'tower img/s':>11}")
    for s in a.sizes:
        img = Image.fromarray(rng.integers(0, 256, (s, s, 3), dtype=np.uint8))
        prep_s, (pv, grid) = timed(lambda: preprocess(img, cfg), lambda: None, a.reps)
        for nb in a.batch:
            pv_dev, grid_b = pv.to(dev).repeat(nb, 1, 1, 1), grid.repeat(nb, 1)

            def run():
                with torch.inference_mode():
                    return vm(pv_dev, grid_b)

            for impl in impls:
                vm.vision_tower.attn_impl = impl
                run()  # warm-up
                call_s, (emb, counts) = timed(run, sync, a.reps)
                tower_s = call_s / nb
                total = prep_s + tower_s
                row = {"size": s, "batch": nb, "attn": impl, "patches": int(pv.shape[0]), "tokens": int(counts[0]),
                       "prep_ms": prep_s * 1e3, "tower_proj_ms": tower_s * 1e3, "total_ms": total * 1e3,
                       "images_per_s": 1.0 / total, "tower_images_per_s": 1.0 / tower_s}
                res["rows"].append(row)
                print(f"{s:>5}² {nb:>5} {impl:>7} {row['patches']:>8} {row['tokens']:>7} {row['prep_ms']:>8.1f} "
                      f"{row['tower_proj_ms']:>9.2f} {row['total_ms']:>9.1f} {row['images_per_s']:>8.2f} "
                      f"{row['tower_images_per_s']:>11.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
