import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def two_rank_results():
    """tests/dist/cases.py:two_rank_suite on 2 gloo ranks, launched once per session: [rank0, rank1]."""
    from launcher import run_dist
    return run_dist("tests/dist/cases.py:two_rank_suite", 2)
