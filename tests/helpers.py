"""What the tests share besides fixtures: one closeness measure, one closeness assertion, and the JSON tables of the
TRITON_INTERPRET=1 child scripts.

Test modules import it as `from helpers import ...` (pytest puts tests/ on sys.path for tests/conftest.py); child
scripts run as `python tests/x/_child.py` put tests/ on sys.path first.
"""
from __future__ import annotations

import importlib.util
import traceback
from typing import Any, Callable, Optional

import torch

__all__ = ["rel_err", "max_rel_err", "assert_close", "case", "row", "interpreted_results"]


def rel_err(actual: torch.Tensor, expected: torch.Tensor, finite: bool = False) -> float:
    """||actual - expected|| / ||expected|| in fp64 (Frobenius norms over all elements; the same number as the
    relative RMSE). 0 when both are zero. NaN in `actual` gives NaN (never below a bound); finite=True raises
    instead, naming the count."""
    a = actual.detach().double().cpu()
    b = expected.detach().double().cpu() if torch.is_tensor(expected) else torch.as_tensor(expected, dtype=torch.float64)
    if finite and not torch.isfinite(a).all():
        raise AssertionError(f"non-finite values in the result: {int((~torch.isfinite(a)).sum())} of {a.numel()}")
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| in fp64: the worst element against the largest one (the KDA tests'
    measure; stricter than rel_err on a few bad elements)."""
    a = actual.detach().double().cpu()
    b = expected.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _where(diff: torch.Tensor) -> tuple:
    i = int(diff.reshape(-1).argmax())
    return tuple(int(j) for j in torch.unravel_index(torch.tensor(i), diff.shape)) if diff.dim() else ()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rel: Optional[float] = None,
                 rtol: Optional[float] = None, atol: Optional[float] = None, what: str = "") -> None:
    """Fail unless `actual` is close to `expected`, naming the largest error and where it is.

    rel=: rel_err(actual, expected) < rel (strict, as the suite's bounds are written).
    rtol= / atol=: every element |actual - expected| <= atol + rtol * |expected| (torch.allclose's rule; each
    defaults to 0 when only the other is given). Shapes must match (no broadcasting)."""
    if (rel is None) == (rtol is None and atol is None):
        raise TypeError("assert_close: give rel=, or rtol= / atol=")
    a = actual.detach().double().cpu()
    b = expected.detach().double().cpu() if torch.is_tensor(expected) else torch.as_tensor(expected, dtype=torch.float64)
    label = f"{what}: " if what else ""
    if a.shape != b.shape:
        raise AssertionError(f"{label}shape {tuple(a.shape)} != expected {tuple(b.shape)}")
    bad = ~torch.isfinite(a) & torch.isfinite(b)
    if bad.any():
        at = tuple(int(j) for j in bad.nonzero()[0])
        raise AssertionError(f"{label}{int(bad.sum())} non-finite values where the expected ones are finite, "
                             f"first at {at}: {a[at].item()} vs {b[at].item()}")
    diff = (a - b).abs().nan_to_num(nan=0.0)
    at = _where(diff) if diff.numel() else ()
    worst = f"max |diff| {diff.max().item():.3g} at {at} ({a[at].item():.6g} vs {b[at].item():.6g})" \
        if diff.numel() else "empty"
    if rel is not None:
        err = rel_err(a, b)
        if not err < rel:
            raise AssertionError(f"{label}relative error {err:.3g} (||actual - expected|| / ||expected||), bound "
                                 f"{rel:.3g}; {worst}")
        return
    rtol, atol = rtol or 0.0, atol or 0.0
    excess = diff - (atol + rtol * b.abs())
    if (excess > 0).any():
        at = _where(excess)
        raise AssertionError(f"{label}{int((excess > 0).sum())} of {a.numel()} elements beyond atol {atol:.3g} + "
                             f"rtol {rtol:.3g} * |expected|; worst at {at}: {a[at].item():.6g} vs {b[at].item():.6g} "
                             f"(|diff| {diff[at].item():.3g}); {worst}")


# ------------------------------------------------------------------ JSON tables of TRITON_INTERPRET=1 child scripts

def interpreted_results(script: str, **kw) -> dict:
    """In a parent test (its module fixture): the JSON table `script` prints when run under TRITON_INTERPRET=1
    (k3.ops.triton_interp.run_interpreted, `kw` passed on); skips the test when triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        import pytest
        pytest.skip("triton is not installed")
    from k3.ops.triton_interp import run_interpreted
    return run_interpreted(script, **kw)


def case(rows: dict, name: str, fn: Callable[[], Any]) -> None:
    """In a child script: rows[name] = fn(), or the error it raised (so one broken case fails only its own test)."""
    try:
        rows[name] = fn()
    except Exception:   # noqa: BLE001 - reported to the parent by name
        rows[name] = {"error": traceback.format_exc(limit=8)}


def row(rows: dict, name: str) -> Any:
    """In a parent test: the child's row `name`, failing clearly when the child did not produce it or raised."""
    if name not in rows:
        raise AssertionError(f"the child printed no row {name!r} (rows: {sorted(rows)})")
    r = rows[name]
    if isinstance(r, dict) and set(r) == {"error"}:
        raise AssertionError(f"case {name!r} raised in the child:\n{r['error']}")
    return r
