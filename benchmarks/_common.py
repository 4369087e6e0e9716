"""What several benchmark scripts share. benchmarks/ is no package: a script run as `python benchmarks/x.py` has
this folder first on sys.path, so it imports these as `from _common import ...` (also the scripts it loads)."""
from __future__ import annotations

import importlib.util
import os
import statistics
import time
from typing import Callable

__all__ = ["sibling", "median_s"]


def sibling(name: str):
    """The benchmark script benchmarks/<name>.py as a module, loaded by its path."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                      name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def median_s(fn: Callable[[], object], reps: int, warmup: int = 0) -> float:
    """Median wall-clock seconds of `reps` calls of fn(), after `warmup` untimed calls (CPU timing: no syncs)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
