"""What a rank started by torchrun leaves for torchrun's failure summary.

torchrun (torch.distributed.elastic) prints, for a failed rank, the contents of the file named by
TORCHELASTIC_ERROR_FILE; a process that does not write it shows as `error_file: <N/A>` with no message, however
clearly the rank printed its error. `record_error(e)` writes the file (the format of
torch.distributed.elastic's ErrorHandler: the message and the traceback) when running under torchrun, and does
nothing otherwise; `k3.cli.main` calls it for every error that ends a command.
"""
from __future__ import annotations

import os

from k3 import knobs

__all__ = ["record_error"]


def record_error(e: BaseException) -> None:
    """Write `e` to torchrun's error file (first error wins; no-op outside torchrun)."""
    path = knobs.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        ErrorHandler().record_exception(e)
    except Exception:  # pragma: no cover - never hide the original error behind a reporting failure
        pass
