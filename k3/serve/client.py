"""Small client-side helpers for a running `k3 serve` (used by the tests and benchmarks/serve_load.py)."""
from __future__ import annotations

import subprocess
import time
from typing import Optional


def wait_ready(base_url: str, proc: Optional[subprocess.Popen] = None, timeout: float = 120.0,
               poll: float = 0.2) -> None:
    """Block until GET {base_url}/health answers 200. Raises RuntimeError if `proc` (the server process, when
    given) exits first or `timeout` seconds pass."""
    import httpx
    t0 = time.time()
    while True:
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"k3 serve exited with code {proc.returncode} before answering {base_url}/health")
        if time.time() - t0 > timeout:
            raise RuntimeError(f"k3 serve did not answer {base_url}/health within {timeout:.0f} s")
        time.sleep(poll)


def stop_server(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """Stop a server process started by the caller: SIGTERM, wait up to `timeout` seconds, then SIGKILL (and
    reap it)."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
