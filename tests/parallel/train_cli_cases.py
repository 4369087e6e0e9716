"""What the `k3 train` / `k3 plan` CLI tests run on every rank (through launcher.run_dist): the real entry point
`k3.cli.main(argv)` with torchrun's environment (RANK / WORLD_SIZE / LOCAL_RANK, set by the launcher) and the
launcher's gloo process group already initialised, as torchrun + `-m k3.cli` would run it."""
from __future__ import annotations

import io
import sys
from contextlib import redirect_stderr


def train_cli(argv: list) -> dict:
    """`k3 <argv>` on this rank -> {"rc": exit code, "stderr": what it printed to stderr}."""
    from k3.cli import main
    err = io.StringIO()
    with redirect_stderr(err):
        rc = main(list(argv))
    sys.stderr.write(err.getvalue())
    return {"rc": rc, "stderr": err.getvalue()}


def train_cli_ctrl_c(argv: list, signal_rank: int, after_step: int) -> dict:
    """`k3 <argv>` where Ctrl-C reaches only rank `signal_rank`, after step `after_step` (its SIGINT handler runs
    there): every rank must agree to stop at the same step and save one checkpoint."""
    import os
    import signal
    import torch.distributed as dist
    from k3.parallel.training import DistTrainer
    step = DistTrainer.train_step

    def train_step(self):
        rec = step(self)
        if dist.get_rank() == signal_rank and self.step == after_step:
            os.kill(os.getpid(), signal.SIGINT)
        return rec
    DistTrainer.train_step = train_step
    try:
        return train_cli(argv)
    finally:
        DistTrainer.train_step = step


def train_cli_label_counts(argv: list) -> dict:
    """`k3 <argv>` recording, per training micro-batch, the global batch's supervised positions and IGNORE_INDEX
    fraction (`target_count`, what the loss is divided by) and this rank's supervised positions after the
    data-parallel split: {"rc", "stderr", "global_targets", "global_ignored", "local_targets"}."""
    from k3.ops.loss import IGNORE_INDEX
    from k3.parallel.batching import target_count
    from k3.parallel.training import DistTrainer
    local = DistTrainer._local_batch
    seen = {"global_targets": [], "global_ignored": [], "local_targets": []}

    def _local_batch(self, b, seq, allow_uneven=False):
        loc = local(self, b, seq, allow_uneven)
        if not allow_uneven:   # a training micro-batch (evaluation passes allow_uneven=True)
            seen["global_targets"].append(target_count(b))
            seen["global_ignored"].append(float((b["labels"] == IGNORE_INDEX).float().mean()))
            seen["local_targets"].append(int((loc["labels"] != IGNORE_INDEX).sum()))
        return loc
    DistTrainer._local_batch = _local_batch
    try:
        return {**train_cli(argv), **seen}
    finally:
        DistTrainer._local_batch = local
