"""Running Triton kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1): what the tests and the
benchmarks' --smoke modes share.

- `run_interpreted(script)`: run a test file as a script in a subprocess with TRITON_INTERPRET=1 (it must be set
  before triton is imported, and pytest imports every test module into one process) and return the JSON object
  that the script prints last.
- `fix_interpreter_bf16_dot()`: Triton's interpreter (3.9) keeps bf16 tensors as raw uint16 bits and tl.dot
  multiplies the bits; the patch widens bf16 dot operands to fp32 (exact) first.
- `emulate_gpu(True)`: after the patch, fp32 dots of input precision tf32 / tf32x3 round their operands as
  tensor cores do, and fp32 -> bf16 casts round to nearest even (the interpreter truncates), so CPU accuracy
  checks see GPU-like rounding.
CPU/test-only: kernels compiled for a GPU are unaffected.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Iterable, Optional

from k3 import knobs

_GPU = {"on": False}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(script: str, timeout: float = 300, env_pop: Iterable[str] = (),
                    env_set: Optional[dict] = None) -> dict:
    env = knobs.child_env(TRITON_INTERPRET="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for k in env_pop:
        env.pop(k, None)
    env.update(env_set or {})
    p = subprocess.run([sys.executable, os.path.abspath(script)], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    if p.returncode != 0:
        raise AssertionError(f"{script} under TRITON_INTERPRET=1 failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def fix_interpreter_bf16_dot() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as itp
    orig = itp.InterpreterBuilder.create_dot
    if getattr(orig, "_k3_bf16_fix", False):
        return

    def up(h):
        if h.dtype.scalar == tl.bfloat16:
            return itp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def tf32(x):  # keep sign, exponent and the top 10 mantissa bits (truncation: the conservative assumption)
        return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = up(a), up(b)
        prec = str(input_precision).split(".")[-1].upper()
        if _GPU["on"] and a.dtype.scalar == tl.float32 and prec in ("TF32", "TF32X3"):
            ah, bh = tf32(a.data), tf32(b.data)
            if prec == "TF32":
                out = np.matmul(ah, bh)
            else:
                out = np.matmul(ah, bh) + np.matmul(ah, tf32(b.data - bh)) + np.matmul(tf32(a.data - ah), bh)
            return itp.TensorHandle(out.astype(d.data.dtype) + d.data, d.dtype.scalar)
        return orig(self, a, b, d, input_precision, max_num_imprecise_acc)

    orig_cast = itp.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if _GPU["on"] and src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            u = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rn = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
            return itp.TensorHandle(np.where(np.isnan(src.data), np.uint16(0x7FC0), rn), tl.bfloat16)
        return orig_cast(self, src, dst_type)

    create_dot._k3_bf16_fix = True
    itp.InterpreterBuilder.create_dot = create_dot
    itp.InterpreterBuilder.cast_impl = cast_impl


def emulate_gpu(on: bool = True) -> None:
    _GPU["on"] = bool(on)
