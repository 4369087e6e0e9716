import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def two_rank_results(tmp_path_factory):
    """tests/parallel/cases.py:two_rank_suite on 2 gloo ranks, launched once per session: [rank0, rank1]."""
    from launcher import run_dist
    ck = str(tmp_path_factory.mktemp("async_ckpt"))
    return run_dist("tests/parallel/cases.py:two_rank_suite", 2, {"ckpt_dir": ck})
