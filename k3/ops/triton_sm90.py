"""Compile Triton kernels for sm_90 (H100/H200) on any machine, without a GPU, and read what the compiler did:
registers, spill stack, shared memory, resident programs per SM and the SASS instruction mix (via the cuobjdump
that ships with triton's NVIDIA backend). Used by CI (tests/ops/test_triton_sm90_compile.py) and by the
benchmarks' static analyses (benchmarks/kda_triton.py --static, benchmarks/kda_bwd_static.py).
"""
from __future__ import annotations

import collections
import math
import os
import re
import subprocess
import tempfile
from typing import Dict, Mapping

SMEM_LIMIT = 232448   # bytes of shared memory per block on sm_90
_INSTR = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def signature(fn, consts: Mapping, types: Mapping[str, str], default: str = "*bf16") -> Dict[str, str]:
    """Triton signature of `fn`: constexpr for `consts`, `types[name]` where given, else `default`."""
    return {n: ("constexpr" if n in consts else types.get(n, default)) for n in fn.arg_names}


def compile_sm90(fn, consts: Mapping, types: Mapping[str, str], num_warps: int = 4, num_stages: int = 2,
                 default: str = "*bf16", divisible: tuple = (), **options):
    """Compile the @triton.jit `fn` for sm_90 (pointers assumed 16-byte aligned; the integer arguments named in
    `divisible` assumed multiples of 16, as the JIT specializes them at launch when they are, e.g. row strides).
    Extra options (e.g. maxnreg) go to triton.compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = signature(fn, consts, types, default)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
             if t.startswith("*") or n in divisible}
    return triton.compile(ASTSource(fn, sig, dict(consts), attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, **options))


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        return subprocess.run([exe, flag, fh.name], capture_output=True, text=True, check=True).stdout


def sass(ck) -> str:
    """The SASS listing of a compiled kernel."""
    return _cuobjdump(ck.asm["cubin"], "-sass")


def stats(ck, num_warps: int) -> dict:
    """regs, stack_B (spill stack per thread), smem_B, cta_per_SM (resident programs: registers, shared memory,
    the 32-block and 64-warp limits), ops (Counter of SASS opcodes) and n_instr."""
    use = _cuobjdump(ck.asm["cubin"], "-res-usage")
    ops = collections.Counter()
    for line in sass(ck).splitlines():
        m = _INSTR.match(line)
        if m:
            ops[m.group(1)] += 1
    regs = int(re.search(r"REG:(\d+)", use).group(1))
    stack = int(re.search(r"STACK:(\d+)", use).group(1))
    shared = ck.metadata.shared
    reg_alloc = math.ceil(regs * 32 / 256) * 256   # registers per warp, allocated in units of 256
    cta = min(65536 // (reg_alloc * num_warps), SMEM_LIMIT // (shared + 1024), 32, 64 // num_warps)
    return dict(regs=regs, stack_B=stack, smem_B=shared, cta_per_SM=cta, ops=ops, n_instr=sum(ops.values()))
