"""The shared closeness helpers (tests/helpers.py) fail, and say where."""
import math

import pytest
import torch

from helpers import assert_close, case, max_rel_err, rel_err, row


def test_rel_err_is_the_relative_rmse():
    b = torch.tensor([3.0, 4.0])
    assert rel_err(b + torch.tensor([0.0, 0.5]), b) == pytest.approx(0.1)
    assert rel_err(torch.zeros(3), torch.zeros(3)) == 0.0
    assert math.isnan(rel_err(torch.tensor([float("nan"), 1.0]), b))
    with pytest.raises(AssertionError, match="non-finite values in the result: 1 of 2"):
        rel_err(torch.tensor([float("inf"), 1.0]), b, finite=True)
    assert max_rel_err(b + torch.tensor([0.0, 0.5]), b) == pytest.approx(0.125)


def test_assert_close_names_the_worst_element():
    b = torch.zeros(2, 3, dtype=torch.float64)
    b[0, 0] = 1.0
    a = b.clone()
    a[1, 2] = 0.25
    assert_close(a, b, rel=0.26)
    with pytest.raises(AssertionError, match=r"dx: relative error 0\.25 .*bound 0\.2; max \|diff\| 0\.25 at \(1, 2\)"):
        assert_close(a, b, rel=0.2, what="dx")
    with pytest.raises(AssertionError, match=r"1 of 6 elements beyond atol 0\.1.*worst at \(1, 2\)"):
        assert_close(a, b, atol=0.1)
    assert_close(a.float(), b, atol=0.25)
    with pytest.raises(AssertionError, match=r"1 non-finite values .* first at \(0, 1\)"):
        assert_close(torch.tensor([[0.0, float("nan")]]), torch.zeros(1, 2), rtol=1.0)
    with pytest.raises(AssertionError, match=r"shape \(2,\) != expected \(3,\)"):
        assert_close(torch.zeros(2), torch.zeros(3), rel=1.0)
    with pytest.raises(TypeError):
        assert_close(a, b)


def test_child_rows_name_missing_and_failed_cases():
    rows = {}
    case(rows, "ok", lambda: {"y": 0.0})
    case(rows, "broken", lambda: 1 / 0)
    assert row(rows, "ok") == {"y": 0.0}
    with pytest.raises(AssertionError, match="(?s)case .broken. raised in the child:.*ZeroDivisionError"):
        row(rows, "broken")
    with pytest.raises(AssertionError, match=r"no row 'gone' \(rows: \['broken', 'ok'\]\)"):
        row(rows, "gone")
