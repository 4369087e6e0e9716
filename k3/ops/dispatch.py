"""One place that chooses a backend per op family, logs the choice once, and lets users override it.

Order: explicit `backend=` argument > the K3_BACKEND knob (k3/knobs.py: the environment variable, else
`k3.knobs.set(K3_BACKEND=...)`; global, or per op: `K3_BACKEND=kda:fla,moe:torch`) > automatic (best available
for the device). Unknown names fail with the list of known ones; a *global*
K3_BACKEND name (no `op:`) applies only to the op families that know it (e.g. `K3_BACKEND=torch` forces the
pure-PyTorch KDA and AttnRes paths and leaves MoE on auto).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from k3 import knobs

log = logging.getLogger("k3")
_REGISTRY: dict[str, dict[str, tuple[Callable[[], bool], int]]] = {}
_LOGGED: set = set()


def register(op: str, name: str, available: Callable[[], bool], priority: int = 0) -> None:
    """Register backend `name` for op family `op`; `available()` says if it can run (imports, CUDA)."""
    _REGISTRY.setdefault(op, {})[name] = (available, priority)


def backends(op: str) -> list[str]:
    return sorted(_REGISTRY.get(op, {}))


def env_choice(op: str) -> Optional[str]:
    """The backend the K3_BACKEND knob names for `op` (None: none, or a global name this op family does not know)."""
    spec = (knobs.get("K3_BACKEND") or "").strip()
    if not spec:
        return None
    glob = None
    for part in spec.split(","):
        if ":" in part:
            o, n = part.split(":", 1)
            if o.strip() == op:
                return n.strip()
        elif part.strip() and glob is None:
            glob = part.strip()
    if glob is not None and glob not in _REGISTRY.get(op, {}) and glob != "auto":
        return None  # a global choice this op family does not know: leave it on auto
    return glob


@torch.compiler.assume_constant_result
def resolve(op: str, backend: Optional[str] = None, device_type: str = "cpu") -> str:
    """The backend to use for `op` on `device_type`. Under torch.compile the call is evaluated once while tracing and
    its result is a constant of the graph (no graph break from the availability checks or the log line)."""
    table = _REGISTRY.get(op, {})
    choice = backend or env_choice(op)
    if choice and choice != "auto":
        if choice not in table:
            raise ValueError(f"unknown backend {choice!r} for {op}; known: {', '.join(sorted(table))}")
        avail, _ = table[choice]
        if not avail():
            raise RuntimeError(f"backend {choice!r} for {op} is not available here "
                               f"(missing package or device); known: {', '.join(sorted(table))}")
        name = choice
    else:
        cands = [(p, n) for n, (a, p) in table.items()
                 if (device_type == "cuda" or p <= 0) and a()]
        name = max(cands)[1] if cands else "torch"
    key = (op, name, device_type)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("k3: %s backend = %s (device %s)", op, name, device_type)
    return name


def triton_interpreting() -> bool:
    """TRITON_INTERPRET is set: Triton kernels run on CPU tensors through its interpreter (the CPU tests)."""
    return knobs.get("TRITON_INTERPRET")


def triton_runs() -> bool:
    """Triton kernels can run here: triton is installed and there is CUDA, or its interpreter."""
    import importlib.util
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or triton_interpreting()


def is_available(op: str, name: str) -> bool:
    """`name` is registered for `op` and can run here."""
    entry = _REGISTRY.get(op, {}).get(name)
    return bool(entry and entry[0]())


def log_once(op: str, name: str, device_type: str, why: str = "") -> None:
    """The once-per-(op, backend, device) log line of resolve(), for choices made after it."""
    key = (op, name, device_type)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("k3: %s backend = %s (device %s)%s", op, name, device_type, f" for {why}" if why else "")
