"""`k3` command line. Thin: parses flags and calls library functions."""
from __future__ import annotations

import argparse
import json
import math
import sys

from k3.flags import finite_float, int_at_least  # shared flag types of every subcommand (re-exported)

__all__ = ["main", "build_parser", "int_at_least", "finite_float", "byte_size"]


def _cmd_info(a) -> int:
    from k3.config import K3Config
    from k3.info import count_params, format_info
    cfg = K3Config.load(a.config)
    info = count_params(cfg)
    print(json.dumps(info, indent=2) if a.json else format_info(info, a.config))
    return 0


def _cmd_smoke(a) -> int:
    """Build a preset on CPU and run one forward/backward pass."""
    import time
    import torch
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    torch.manual_seed(0)
    cfg = K3Config.load(a.config)
    model = K3ForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, a.seq_len))
    t = time.time()
    out = model(ids, labels=ids.roll(-1, 1))
    out.loss.backward()
    print(f"forward+backward on {a.seq_len} tokens: loss {out.loss.item():.4f} in {time.time() - t:.2f}s")
    return 0


def _cmd_export(a) -> int:
    from k3.export import export_release
    path = export_release(a.ckpt, a.out, quantize=a.quantize, dtype=a.dtype, max_shard_size=a.max_shard_size,
                          tokenizer=a.tokenizer, hf_shims=not a.no_hf_shims)
    print(f"exported {a.ckpt} -> {path} (released layout, {a.dtype}"
          f"{', MXFP4 routed experts' if a.quantize else ''})")
    return 0


def byte_size(text: str) -> float:
    """argparse type: a memory size, `141GB` (decimal units: KB, MB, GB, TB), `80GiB` (binary), or bytes."""
    import re
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]i?B|B)?\s*", text or "", re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 141GB or 80GiB, got {text!r}")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}[unit]
    v = float(m.group(1)) * scale
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size, got {text!r}")
    return v


def _cmd_plan(a) -> int:
    """Size a model on N GPUs: rank 0's memory under each candidate mesh, the recommended one (k3.parallel.plan)."""
    from k3.config import K3Config
    from k3.parallel.plan import GiB, plan
    cfg = K3Config.load(a.config)
    rep = plan(cfg, gpus=a.gpus, gpu_memory=a.gpu_memory, seq_len=a.seq_len, cp=a.cp)
    rec = rep.recommended
    if a.json:
        d = rep.to_dict()
        d["config"] = a.config
        d["cp"] = a.cp
        d["fits"] = rec is not None
        d["recommended_mesh"] = rec.mesh() if rec is not None else None
        d["recommended_flags"] = _mesh_flags(rec) if rec is not None else None
        for c, cd in zip(rep.candidates, d["candidates"]):
            cd["mesh"] = c.mesh()
        print(json.dumps(d, indent=2))
        return 0
    print(f"k3 plan: {a.config}, {rep.total_params / 1e9:.2f}B parameters on {a.gpus} GPUs of "
          f"{a.gpu_memory / GiB:.1f} GiB, {a.seq_len} tokens per sequence per micro-batch (rank 0's bytes)")
    print(rep.table())
    if rec is not None:
        print(f"run: torchrun --nproc-per-node <GPUs per node> --nnodes <nodes> ... -m k3.cli train "
              f"--config {a.config} {_mesh_flags(rec)} --activation-checkpointing")
    else:
        print(f"does not fit: no mesh of {a.gpus} GPUs holds the model; more GPUs, more memory per GPU, or a "
              f"shorter --seq-len")
    return 0


def _mesh_flags(est) -> str:
    s = f"--dp-shard {est.dp_shard}"
    if est.dp_replicate > 1:
        s = f"--dp-replicate {est.dp_replicate} " + s
    s += f" --cp {est.cp}" if est.cp > 1 else ""
    return s + (f" --ep {est.ep}" if est.ep > 1 else "")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3", description="Kimi K3 models: build, train, run")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("info", help="parameter counts (total / active per token) by component")
    s.add_argument("--config", default="tiny", help="preset name, config.json path, or checkpoint dir")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_cmd_info)
    s = sub.add_parser("smoke", help="one forward/backward pass of a preset on CPU")
    s.add_argument("--config", default="tiny")
    s.add_argument("--seq-len", type=int_at_least(1), default=256)
    s.set_defaults(fn=_cmd_smoke)
    s = sub.add_parser("export", help="write a checkpoint in the released K3 layout (vLLM / transformers load it)")
    s.add_argument("--format", choices=("release",), default="release",
                   help="release: container config.json, language_model.* + per-expert w1/w2/w3, tiktoken files")
    s.add_argument("--ckpt", required=True, help="k3 checkpoint directory (e.g. RUN/final)")
    s.add_argument("--out", required=True, help="output directory (written atomically)")
    s.add_argument("--quantize", choices=("mxfp4",), default=None,
                   help="routed experts as MXFP4 compressed-tensors (as released); default: --dtype")
    s.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"),
                   help="dtype of the tensors the release stores in bf16 (fp32-kept ones stay fp32)")
    s.add_argument("--max-shard-size", default="5GB", help="shard size (one model.safetensors when it fits)")
    s.add_argument("--tokenizer", default=None, help="tokenizer file/dir (default: the one in --ckpt)")
    s.add_argument("--no-hf-shims", action="store_true",
                   help="do not write the transformers trust_remote_code shims (configuration_k3.py, ...)")
    s.set_defaults(fn=_cmd_export)
    s = sub.add_parser("plan", help="size a model on N GPUs: per-rank memory of candidate meshes, the recommended one",
                       description="Build the model on `meta` and report, for candidate meshes (dp_replicate x "
                                   "dp_shard, ep), rank 0's bytes of parameters, gradients, optimizer state, "
                                   "transient all-gathers and activations (with activation checkpointing), whether "
                                   "they fit, and the recommended mesh (docs/parallelism.md).")
    s.add_argument("--config", default="kimi-k3", help="preset name, config.json path, or checkpoint dir [kimi-k3]")
    s.add_argument("--gpus", type=int_at_least(1), required=True, help="number of GPUs (world size)")
    s.add_argument("--gpu-memory", type=byte_size, default=141e9, help="memory per GPU, e.g. 141GB, 80GiB [141GB]")
    s.add_argument("--seq-len", type=int_at_least(1), default=8192,
                   help="tokens per sequence per micro-batch; each rank holds seq-len / cp of them [8192]")
    s.add_argument("--cp", type=int_at_least(1), default=None,
                   help="context-parallel degree (default: 1, plus cp candidates when --seq-len >= 32768)")
    s.add_argument("--json", action="store_true", help="the report as JSON")
    s.set_defaults(fn=_cmd_plan)
    for mod in ("k3.train.cli", "k3.sweep", "k3.generation.cli", "k3.serve.cli", "k3.parallel.convert"):
        try:
            __import__(mod, fromlist=["add_parser"]).add_parser(sub)
        except ModuleNotFoundError as e:  # that part of k3 is not installed/built yet
            if e.name != mod:
                raise
    # post-training (k3/train/cli.py: sft; k3/rl/cli.py: rl)
    from k3.train.cli import add_sft_parser
    add_sft_parser(sub)
    __import__("k3.rl.cli", fromlist=["add_parser"]).add_parser(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from k3.errors import K3Error
    try:
        return args.fn(args) or 0
    except K3Error as e:
        print(f"k3: error: {e}", file=sys.stderr)
        _record_error(e)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        _record_error(e)
        raise


def _record_error(e: BaseException) -> None:
    """Under torchrun: the error in torchrun's failure summary (k3/parallel/launch.py)."""
    from k3.parallel.launch import record_error
    record_error(e)


if __name__ == "__main__":
    sys.exit(main())
