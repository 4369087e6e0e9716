"""The one helper the distributed tests share: run a function on N gloo processes and collect what each returns.

    from launcher import run_dist
    results = run_dist("tests/parallel/cases.py:fsdp_step", world_size=2, kwargs={"steps": 2})

Each rank is a fresh `python` subprocess (spawned, not forked: the parent has live OpenMP/intra-op threads) with
the repository root on PYTHONPATH, one intra-op thread, a `gloo` default process group rendezvousing through a
FileStore in a temporary directory (no port to race for), and the RANK / WORLD_SIZE / LOCAL_RANK environment of
torchrun. The target `path.py:function` is called as `function(**kwargs)`; what it returns (tensors, dicts, ...)
is written with torch.save and read back (the files come from our own children). A failing rank's traceback is
raised in the parent (`DistFailure`); the other ranks are killed; a hang is killed after `timeout` seconds.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class DistFailure(RuntimeError):
    """A rank of a distributed test failed (its traceback is the message)."""


def _load(target: str):
    path, _, fn = target.rpartition(":")
    if not path or not fn:
        raise ValueError(f"target must be 'path/to/file.py:function', got {target!r}")
    if not os.path.isabs(path):
        path = os.path.join(ROOT, path)
    name = "_k3dist_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return getattr(mod, fn)


def run_dist(target: str, world_size: int, kwargs: dict | None = None, timeout: float = 240.0,
             threads: int = 1) -> list:
    """Run `target` on `world_size` ranks; returns the list of per-rank return values (rank order)."""
    with tempfile.TemporaryDirectory(prefix="k3dist-") as tmp:
        torch.save(kwargs or {}, os.path.join(tmp, "kwargs.pt"))
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), K3_DIST_THREADS=str(threads),
                   WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
        procs = []
        for rank in range(world_size):
            e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), tmp, target],
                                          env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        deadline = time.time() + timeout
        failed = None
        try:
            while True:
                codes = [p.poll() for p in procs]
                bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    failed = bad[0]
                    break
                if all(c == 0 for c in codes):
                    break
                if time.time() > deadline:
                    raise DistFailure(f"{target}: timed out after {timeout:.0f}s (ranks still running: "
                                      f"{[r for r, c in enumerate(codes) if c is None]})")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            outs = [p.communicate()[0].decode(errors="replace") for p in procs]
        if failed is not None:
            err = os.path.join(tmp, f"error-{failed}.txt")
            tb = open(err).read() if os.path.exists(err) else outs[failed][-6000:]
            raise DistFailure(f"{target}: rank {failed} of {world_size} failed:\n{tb}\n--- output of rank "
                              f"{failed}:\n{outs[failed][-3000:]}")
        return [torch.load(os.path.join(tmp, f"result-{r}.pt"), weights_only=False) for r in range(world_size)]


def _child(tmp: str, target: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        torch.set_num_threads(int(os.environ.get("K3_DIST_THREADS", "1")))
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank,
                                world_size=world)
        kwargs = torch.load(os.path.join(tmp, "kwargs.pt"), weights_only=False)
        out = _load(target)(**kwargs)
        torch.save(out, os.path.join(tmp, f"result-{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(tmp, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush()
        os._exit(1)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
