"""`k3 train --task vision-synth | image-text` under torchrun: the multimodal model trained by `DistTrainer`
(k3.parallel.training), FSDP2 over the language model, the MoonViT tower blocks and the projector
(k3.parallel.vision), every rank running the tower on every step.

    torchrun --nproc-per-node 2 -m k3.cli train --task vision-synth --steps 200 --batch-tokens 4096 \\
        --stages 1024 --dp-shard 2 --out runs/vision2

`run_train_dist(args)` is what `k3 train` runs for a vision task under torchrun (k3.train.cli routes it here when
torchrun's environment is set; a single process keeps k3.vision.train's compact loop). The run is a `k3 train` run
(metrics.jsonl, DCP checkpoints, --resume on any mesh, final/ in the multimodal checkpoint layout):

* data (`VisionTrainData`): rows of `VisionSynthLoader` (k3.vision.synth; `image-text`: k3.vision.pairs), each at
  most `seq_len` *expanded* positions (image tokens counted), right-padded with [PAD] (ignored labels, its own
  document) to `seq_len` placeholder-level tokens, so a step is `rows` = --batch-tokens / seq_len rows of equal
  length that the ranks split as text rows; the images travel with their placeholders (k3.parallel.batching).
  Every rank renders the same global batch, so the data order and losses do not depend on the mesh.
* model: `build_synth_model`'s config (the `tiny` multimodal preset; the micro text model unless --preset names
  another), the tokenizer `synth_tokenizer` (trained on the task's strings, deterministic, per rank).
* recipe (k3.vision.train.run_train_cli's, where not given): --lr 2e-2 (AdamW at 0.15 lr), --warmup 5,
  --weight-decay 0, one context stage (--stages, default min(2048, --batch-tokens)); no recall probe, no
  samples. --steps is required (no --time-budget); --cp > 1 is refused (k3.parallel.setup).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Iterator, Optional

import torch

from k3.errors import K3ConfigError
from k3.ops.loss import IGNORE_INDEX

__all__ = ["VisionTrainData", "SynthTokenizer", "vision_train_setup", "run_train_dist"]


class SynthTokenizer:
    """The trainer's tokenizer interface over a `K3TiktokenTokenizer` (k3.vision.train.synth_tokenizer):
    `fingerprint`, `special_base`, `decode(ids, skip_special_tokens=)`; everything else is the tokenizer's."""

    def __init__(self, tok, path: str):
        self._tok = tok
        with open(path, "rb") as f:
            self.fingerprint = hashlib.sha256(f.read()).hexdigest()[:16]

    def __getattr__(self, name):
        return getattr(self._tok, name)

    @property
    def special_base(self) -> int:
        return self._tok.bos_id

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special=skip_special_tokens)


def pack_rows(rows: list, seq: int, pad_id: int) -> dict:
    """One global batch from `VisionSynthLoader` rows: each right-padded to `seq` tokens ([PAD], ignored labels,
    its own document), concatenated ([1, len(rows) * seq]); images in row-major placeholder order."""
    ids, labels, cu, pvs, grids = [], [], [0], [], []
    for r in rows:
        n = r["input_ids"].shape[1]
        if n > seq:
            raise K3ConfigError(f"a vision row of {n} tokens is longer than seq_len {seq}")
        base = len(ids)
        ids += r["input_ids"][0].tolist() + [pad_id] * (seq - n)
        labels += r["labels"][0].tolist() + [IGNORE_INDEX] * (seq - n)
        cu += [base + int(c) for c in r["cu_seqlens"][1:].tolist()] + ([base + seq] if n < seq else [])
        if r["grid_thw"] is not None and len(r["grid_thw"]):
            pvs.append(r["pixel_values"])
            grids.append(r["grid_thw"])
    return {"input_ids": torch.tensor([ids], dtype=torch.long), "labels": torch.tensor([labels], dtype=torch.long),
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
            "pixel_values": torch.cat(pvs) if pvs else None,
            "grid_thw": torch.cat(grids).to(torch.long) if grids else None}


class _Split:
    def __init__(self, task, split: str, pad_id: int):
        from k3.vision.synth import VisionSynthLoader
        self.task, self.split, self.pad_id = task, split, pad_id
        self.loader = VisionSynthLoader(task, seq_len=2, split=split)   # text_every 0: image examples only

    # the train interface (Trainer._micro_batches, checkpoints)
    def next_batch(self, seq: int, rows: int) -> dict:
        self.loader.seq_len = int(seq)
        return pack_rows([next(self.loader) for _ in range(rows)], seq, self.pad_id)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, s: dict) -> None:
        self.loader.load_state_dict(s)

    @property
    def epoch_progress(self) -> float:
        return 0.0   # a generated task: no epochs

    # the val interface (k3.train.probes.evaluate): the same fixed batches every time
    def batches(self, seq_len: int, batch_size: int, max_batches: Optional[int] = None) -> Iterator[dict]:
        fresh = _Split(self.task, self.split, self.pad_id)
        for _ in range(max_batches or 1):
            yield fresh.next_batch(seq_len, batch_size)


class VisionTrainData:
    """The trainer's data interface (`Trainer(data=...)`) over an image-text task: `tokenizer`, `train`
    (next_batch / state_dict / load_state_dict / epoch_progress) and `val` (batches)."""

    def __init__(self, task, tokenizer):
        self.tokenizer = tokenizer
        self.train = _Split(task, "train", tokenizer.pad_id)
        self.val = _Split(task, "val", tokenizer.pad_id)


def _task_pairs(args):
    """The image-text pairs of `--data` (`--task image-text`); None for vision-synth, which makes its own data."""
    if args.task == "vision-synth":
        if args.data:
            raise K3ConfigError("--task vision-synth makes its own data; for your image/text pairs use --task "
                                "image-text --data PAIRS.jsonl")
        return None
    if not args.data or len(args.data) != 1:
        raise K3ConfigError("--task image-text needs --data PAIRS.jsonl (one JSONL file of image/text records)")
    from k3.vision.pairs import ImageTextPairs
    return ImageTextPairs(args.data[0], None)


def vision_train_setup(args, out_dir: str, processor_config=None):
    """(model config, data factory) of a vision task: the synthetic task (`args.task == "vision-synth"`) or the
    pairs of `--data` (`image-text`), with `synth_tokenizer` built in a private directory (deterministic)."""
    from k3.vision.train import MICRO_TEXT, build_synth_model, synth_tokenizer
    from k3.vision.synth import TASKS, VisionSynthTask
    pairs = _task_pairs(args)
    tok_dir = tempfile.mkdtemp(prefix="k3-synth-tok-")
    tok = synth_tokenizer(tok_dir, extra_texts=pairs.texts() if pairs else ())
    micro = args.preset in (None, "micro")
    with torch.device("meta"):   # the config only
        model = build_synth_model(tok, text_preset="tiny" if micro else args.preset, seed=args.seed or 0,
                                  **(dict(MICRO_TEXT) if micro else {}))
    mcfg, proc = model.config, model.processor_config
    if pairs is not None:
        pairs.tokenizer = tok
        pairs.processor_config = proc
        task = pairs
    else:
        task = VisionSynthTask(tok, tasks=TASKS, seed=args.seed or 0, processor_config=proc, sizes=(84,))
    wrapped = SynthTokenizer(tok, os.path.join(tok_dir, "tiktoken.model"))

    def factory(_tokenizer, seq_len, batch_size, seed):
        return VisionTrainData(task, wrapped)
    return mcfg, factory


def _train_config(args, build_train_config):
    if args.resume:
        return build_train_config(args)
    if args.steps is None:
        raise K3ConfigError(f"--task {args.task} under torchrun: give --steps (--time-budget is the single-process "
                            f"loop's)")
    if args.time_budget is not None:
        raise K3ConfigError(f"--task {args.task} under torchrun: --time-budget is not supported; give --steps")
    if args.init is not None or args.tokenizer is not None:
        raise K3ConfigError(f"--task {args.task} under torchrun: --init / --tokenizer are not supported (the "
                            f"tokenizer is the task's own)")
    args.lr = args.lr or 2e-2
    if args.warmup is None:
        args.warmup = 5
    if args.weight_decay is None:
        args.weight_decay = 0.0
    if args.batch_tokens is None:
        args.batch_tokens = 2048
    if args.stages is None:
        args.stages = str(min(2048, args.batch_tokens))
    preset, args.preset = args.preset, None    # the model config comes from vision_train_setup
    try:
        cfg = build_train_config(args)
    finally:
        args.preset = preset
    cfg.adamw_lr = 0.15 * cfg.lr
    cfg.recall_examples = 0
    cfg.samples = False
    cfg.out_dir = args.out or "runs/vision"
    return cfg


def run_train_dist(args, build_train_config) -> int:
    """`k3 train --task vision-synth | image-text` under torchrun (module doc). `build_train_config(args)`: k3 train's
    TrainConfig from its flags (k3.train.cli passes its own: this module sits below the CLI)."""
    import logging
    from k3.parallel.training import MeshFlags, make_trainer
    from k3.train.report import format_summary
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from k3.parallel.training import torchrun_env
    if torchrun_env() is None:
        raise K3ConfigError("k3.parallel.vision_train runs under torchrun; a single process trains a vision task "
                            "with `k3 train --task ...` (k3.vision.train)")
    cfg = _train_config(args, build_train_config)
    mcfg, factory = vision_train_setup(args, cfg.out_dir)
    flags = MeshFlags(*(getattr(args, k, None) for k in ("dp_replicate", "dp_shard", "cp", "ep")))
    trainer = make_trainer(cfg, flags, model_config=mcfg, data=factory)
    summary = trainer.train()
    if getattr(trainer, "is_rank0", True):
        print(format_summary(summary), flush=True)
    return 130 if summary["status"] == "interrupted" else 0
