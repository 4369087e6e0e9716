"""argparse types shared by every `k3` subcommand (kept below k3.cli, which imports the subcommands' parsers)."""
from __future__ import annotations

import argparse
import math

__all__ = ["int_at_least", "finite_float"]


# ------------------------------------------------------------------ shared flag types (every subcommand)
# argparse calls these on the flag's text; a bad value becomes `k3 <cmd>: error: argument --flag: ...` (exit 2).

def int_at_least(lo: int):
    """argparse type: an integer >= `lo` (e.g. `--threads`, `--keep`, `--save-every`)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    parse.__name__ = f"integer >= {lo}"
    return parse


def finite_float(lo: float = None, hi: float = None, lo_open: bool = False):
    """argparse type: a finite number (never nan / inf) in [lo, hi] (`lo_open`: > lo), e.g. `--lr`."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if lo_open else '>='} {lo:g}, got {text}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi:g}, got {text}")
        return v
    parse.__name__ = "finite number"
    return parse
