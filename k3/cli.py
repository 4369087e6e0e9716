"""`k3` command line. Thin: parses flags and calls library functions."""
from __future__ import annotations

import argparse
import json
import sys


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3", description="Kimi K3 models: build, train, run")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("info", help="parameter counts (total / active per token) by component")
    s.add_argument("--config", default="tiny", help="preset name, config.json path, or checkpoint dir")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_cmd_info)
    s = sub.add_parser("smoke", help="one forward/backward pass of a preset on CPU")
    s.add_argument("--config", default="tiny")
    s.add_argument("--seq-len", type=int, default=256)
    s.set_defaults(fn=_cmd_smoke)
    for mod in ("k3.train.cli", "k3.generation.cli", "k3.serve.cli"):
        try:
            __import__(mod, fromlist=["add_parser"]).add_parser(sub)
        except ModuleNotFoundError as e:  # that part of k3 is not installed/built yet
            if e.name != mod:
                raise
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from k3.errors import K3Error
    try:
        return args.fn(args) or 0
    except K3Error as e:
        print(f"k3: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
