"""A compact training loop for the multimodal model on the synthetic image task (k3.vision.synth), CPU-friendly.

    from k3.vision.train import train_vision_synth
    res = train_vision_synth(steps=300, time_budget_s=600)   # tiny multimodal model, a toy tokenizer
    res["before"]["accuracy"], res["after"]["accuracy"], res["chance"]

The pieces are separate so a trainer can reuse them: `synth_tokenizer` (a small BPE trained on the task's own text,
offline), `build_synth_model` (the `tiny` multimodal preset sized to a tokenizer), `text_documents` (token lists of
the built-in corpus, packed between the image examples), `VisionSynthTask` / `VisionSynthLoader` /
`choice_accuracy` (k3.vision.synth), and `train_step`. Optimiser: `k3.train.optim.build_optimizer` (Muon + AdamW),
the `qb` balancer for the MoE routing bias, warm-up + cosine LR (`k3.train.schedule`).
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Callable, Optional, Sequence

import torch

from k3.config import K3Config
from k3.vision.synth import (CHOICES, COLOURS, QUESTIONS, TASKS, VisionSynthLoader, VisionSynthTask,
                             choice_accuracy)

__all__ = ["MICRO_TEXT", "synth_tokenizer", "build_synth_model", "text_documents", "train_step", "train_vision_synth",
           "val_loss", "run_train_cli"]

log = logging.getLogger("k3.vision.train")


# a ~0.3M-parameter text model (the trainer tests' micro variant of `tiny`) for quick CPU runs on a busy machine
MICRO_TEXT = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=2,
                  num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
                  moe_intermediate_size=32, routed_expert_hidden_size=32, kda_gate_low_rank=16, attn_res_block_size=2,
                  **{"linear_attn_config.num_heads": 2, "linear_attn_config.head_dim": 16,
                     "linear_attn_config.full_attn_layers": [4], "linear_attn_config.kda_layers": [1, 2, 3]})


def synth_tokenizer(directory: Optional[str] = None, num_merges: int = 400, extra_texts: Sequence[str] = ()):
    """A byte-level BPE with K3's 256 specials on top, trained (pure Python, ~1 s) on the chat tags, questions
    and answers of the task plus a little prose; cached in `directory` (default: a temp dir)."""
    from k3.tokenizer import build_toy_tokenizer
    words = ['<message role="user">', '<message role="assistant">', "<response>", "<message>"]
    words += [f"image {w}x{h}" for w in (56, 84, 112, 140) for h in (56, 84, 112, 140)]
    words += list(QUESTIONS.values()) + [a for t in CHOICES for a in CHOICES[t]] + list(COLOURS)
    words += [f"<{w}>" for w in words]  # also glued to the tags, as the chat renders them
    texts = [" ".join(words)] * 100  # the task's strings dominate the merges: short prompts, one-token answers
    texts += list(extra_texts)
    try:
        from k3.train.data import load_corpus
        texts += [d[:1000] for d in load_corpus()[0][:20]]
    except Exception:  # pragma: no cover - the built-in corpus ships with k3
        pass
    directory = directory or tempfile.mkdtemp(prefix="k3-synth-tok-")
    return build_toy_tokenizer(directory, num_merges=num_merges, texts=texts)


def build_synth_model(tokenizer, text_preset: str = "tiny", vision_preset: str = "tiny", seed: int = 0,
                      **text_overrides):
    """`K3ForConditionalGeneration` from the text + vision presets, its vocabulary and special ids set to the
    tokenizer's (fp32)."""
    from k3.multimodal import K3ForConditionalGeneration, multimodal_config
    V = tokenizer.vocab_size
    text = K3Config.from_preset(text_preset, vocab_size=V, bos_token_id=tokenizer.bos_id,
                                eos_token_id=tokenizer.token_to_id("<|end_of_msg|>"), pad_token_id=tokenizer.pad_id,
                                dtype="float32", **text_overrides)
    cfg = multimodal_config(text, vision_preset, media_placeholder_token_id=tokenizer.token_to_id("<|media_pad|>"))
    torch.manual_seed(seed)
    return K3ForConditionalGeneration(cfg)


def text_documents(tokenizer, n: int = 200, max_chars: int = 600) -> list:
    """Token lists of the first `n` training documents of the built-in corpus (cut to `max_chars`)."""
    from k3.train.data import load_corpus
    docs = load_corpus()[0][:n]
    return [tokenizer.encode(d[:max_chars], allow_special=False) for d in docs]


def train_step(model, batch: dict, optimizer, scheduler=None, balancer=None, clip: float = 1.0) -> float:
    """One forward/backward/step on a `VisionSynthLoader` batch; returns the loss."""
    dev = model.device
    out = model(batch["input_ids"].to(dev), batch["pixel_values"].to(dev), batch["grid_thw"],
                labels=batch["labels"].to(dev), cu_seqlens=batch["cu_seqlens"].to(dev))
    out.loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    if balancer is not None:
        balancer.step()
    return float(out.loss.detach())


@torch.no_grad()
def val_loss(model, task, n: int = 50, split: str = "val") -> dict:
    """Mean loss (per supervised token) over `n` held-out examples of an image-text task, one forward each."""
    was = model.training
    model.eval()
    tot, cnt = 0.0, 0
    try:
        for i in range(n):
            ex = task.example(i, split)
            enc = task.encode(ex)
            pv, grid = task.pixels([ex.image])
            out = model(torch.tensor([enc["input_ids"]], device=model.device), pv.to(model.device), grid,
                        labels=torch.tensor([enc["labels"]], device=model.device))
            k = sum(t != -100 for t in enc["labels"])
            tot, cnt = tot + float(out.loss) * k, cnt + k
    finally:
        model.train(was)
    return {"val_loss": tot / max(1, cnt), "n": n, "tokens": cnt}


def _fmt_eval(r: dict) -> str:
    if "accuracy" in r:
        return f"accuracy {r['accuracy']:.3f} (chance {r['chance']:.3f}) {r['per_task']}"
    return f"val loss {r['val_loss']:.4f} ({r['n']} examples)"


def train_vision_synth(steps: Optional[int] = None, time_budget_s: Optional[float] = 600.0, *, seq_len: int = 1024,
                       lr: float = 6e-3, warmup: int = 20, seed: int = 0, tasks: Sequence[str] = TASKS,
                       text_every: int = 4, eval_n: int = 120, model=None, tokenizer=None, text_docs=None,
                       eval_before: bool = True, device="cpu", log_every: int = 10,
                       log_fn: Optional[Callable[[str], None]] = None, sizes: Optional[Sequence[int]] = None,
                       task=None, adamw_lr: Optional[float] = None,
                       train_weights: Optional[Sequence[float]] = None, **model_overrides) -> dict:
    """Train `model` (default: `build_synth_model(tokenizer)`, the `tiny` multimodal preset) on the synthetic
    task for `steps` steps or until `time_budget_s` (training time, evaluation excluded) runs out (`steps=None`:
    as many as the budget allows; the LR schedule's length is estimated from the first 3 steps, the LR stays at its
    floor after it); measure held-out
    accuracy (argmax over answer choices, `eval_n` val examples) before and after.

    Returns {"before", "after": choice_accuracy dicts, "chance", "steps", "train_s", "wall_s", "losses",
    "examples_seen", "model", "tokenizer", "task"}."""
    from k3.balance import make_balancer
    from k3.train.optim import build_optimizer
    from k3.train.schedule import cosine_with_warmup
    say = log_fn or log.info
    t_wall = time.time()
    tokenizer = tokenizer or synth_tokenizer()
    if model is None:
        model = build_synth_model(tokenizer, seed=seed, **model_overrides)
    model.to(device)
    if task is None:
        task = VisionSynthTask(tokenizer, tasks=tasks, seed=seed, processor_config=model.processor_config,
                               train_weights=train_weights,
                               **({"sizes": tuple(sizes)} if sizes else {}))
    elif getattr(task, "processor_config", None) is None:
        task.processor_config = model.processor_config
    synth = isinstance(task, VisionSynthTask)
    evaluate = (lambda: choice_accuracy(model, task, eval_n)) if synth else (lambda: val_loss(model, task, eval_n))
    if text_docs is None:
        text_docs = text_documents(tokenizer) if text_every else []
    loader = VisionSynthLoader(task, seq_len=seq_len, text_docs=text_docs, text_every=text_every)
    before = evaluate() if eval_before and eval_n else None
    if before is not None:
        say(f"before: {_fmt_eval(before)}")
    optimizer = build_optimizer(model, lr=lr, weight_decay=0.0, adamw_lr=adamw_lr)
    if steps is None and time_budget_s is None:
        raise ValueError("train_vision_synth: give steps or time_budget_s")
    planned = steps or 10 ** 9
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(warmup, planned))
    balancer = make_balancer("qb").attach(model.language_model) if model.config.num_experts > 0 else None
    model.train()
    losses, seen, t0, step = [], 0, time.time(), 0
    while steps is None or step < steps:
        step += 1
        batch = next(loader)
        losses.append(train_step(model, batch, optimizer, scheduler, balancer))
        if steps is None and step >= 3 and step % 3 == 0:
            # schedule length from the measured step time, re-estimated as the run goes (a busy machine's step
            # time drifts: a plan fixed after 3 steps left the LR at its floor for a third of a run)
            el = time.time() - t0
            new_plan = max(warmup + 10, step + int(max(0.0, time_budget_s - el) / (el / step)))
            if new_plan != planned:
                planned = new_plan
                scheduler.lr_lambdas = [cosine_with_warmup(warmup, planned)] * len(optimizer.param_groups)
            if step == 3:
                say(f"~{el / 3:.2f} s/step: planning {planned} steps in {time_budget_s:.0f} s")
        seen += batch["n_examples"]
        if log_every and (step % log_every == 0 or step == 1):
            say(f"step {step}: loss {losses[-1]:.4f}, {seen} examples, {time.time() - t0:.0f} s")
        if time_budget_s is not None and time.time() - t0 > time_budget_s:
            say(f"time budget {time_budget_s:.0f} s reached at step {step}")
            break
    train_s = time.time() - t0
    after = evaluate() if eval_n else None
    if after is not None:
        say(f"after {step} steps ({train_s:.0f} s): {_fmt_eval(after)}")
    return {"before": before, "after": after, "chance": getattr(task, "chance", None), "steps": step, "train_s": train_s,
            "wall_s": time.time() - t_wall, "losses": losses, "examples_seen": seen, "model": model,
            "tokenizer": tokenizer, "task": task}


CLI_EVAL_N = 60   # held-out examples evaluated before and after by `k3 train --task vision-synth|image-text`


def run_train_cli(args) -> int:
    """`k3 train --task vision-synth` (the synthetic task) or `--task image-text --data pairs.jsonl`
    (k3.vision.pairs): train the `tiny` multimodal model (text preset `--preset`, default tiny) with this module's
    loop; `--steps` or `--time-budget` (seconds, default 540 when neither is given), `--lr`, `--warmup`,
    `--seed`, `--threads`, `--batch-tokens` (expanded positions per row, default 2048). Writes `--out`/final (a
    multimodal checkpoint with its tokenizer) and `--out`/vision_result.json; prints held-out accuracy before and
    after (vision-synth) or held-out loss (image-text)."""
    import json
    from k3.errors import K3ConfigError
    say = lambda s: print(s, flush=True)  # noqa: E731
    task_name = args.task
    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = args.out or "runs/vision"
    if os.path.isdir(os.path.join(out_dir, "final")) and not args.overwrite:
        raise K3ConfigError(f"--out {out_dir} already holds a run (final/); pass --overwrite to replace it")
    os.makedirs(out_dir, exist_ok=True)
    pairs = None
    if task_name == "image-text":
        if not args.data or len(args.data) != 1:
            raise K3ConfigError("--task image-text needs --data PAIRS.jsonl (one JSONL file of image/text records)")
        from k3.vision.pairs import ImageTextPairs
        pairs = ImageTextPairs(args.data[0], None)
    elif args.data:
        raise K3ConfigError("--task vision-synth makes its own data; for your image/text pairs use --task image-text "
                            "--data PAIRS.jsonl")
    tok = synth_tokenizer(os.path.join(out_dir, "tokenizer"), extra_texts=pairs.texts() if pairs else ())
    if pairs is not None:
        pairs.tokenizer = tok
    overrides = dict(MICRO_TEXT) if args.preset in (None, "micro") else {}
    model = build_synth_model(tok, text_preset="tiny" if args.preset in (None, "micro") else args.preset,
                              seed=args.seed or 0, **overrides)
    budget = args.time_budget if args.time_budget is not None else (None if args.steps else 540.0)
    seq = args.batch_tokens or 2048
    lr = args.lr or 2e-2
    # the recipe of benchmarks/vision_synth.md: Muon at lr, AdamW (embeddings, lm_head, norms) at 0.15 lr (at lr
    # itself the lm_head thrashes and the answer stays at its prior), the four-task mix on 84 px images
    res = train_vision_synth(steps=args.steps, time_budget_s=budget, seq_len=seq, model=model, tokenizer=tok,
                             lr=lr, adamw_lr=0.15 * lr, warmup=args.warmup if args.warmup is not None else 5,
                             seed=args.seed or 0, task=pairs, text_every=0,
                             eval_n=CLI_EVAL_N if pairs is None else min(CLI_EVAL_N, len(pairs.splits["val"])),
                             sizes=(84,) if pairs is None else None, log_fn=say, tasks=TASKS)
    final = os.path.join(out_dir, "final")
    res["model"].save_pretrained(final, tokenizer=tok)
    summary = {k: res[k] for k in ("before", "after", "chance", "steps", "train_s", "wall_s", "examples_seen")}
    summary.update(task=task_name, final=final, last_losses=res["losses"][-3:])
    with open(os.path.join(out_dir, "vision_result.json"), "w") as f:
        json.dump(summary, f, indent=1)
    say(json.dumps(summary, indent=1) if getattr(args, "json", False) else
        f"k3 train --task {task_name}: {res['steps']} steps in {res['train_s']:.0f} s; before {_fmt_eval(res['before'])}; "
        f"after {_fmt_eval(res['after'])}; saved {final}")
    return 0
