"""A synthetic, offline image-question-answer task (Pillow), for training and testing the multimodal path on CPU.

Every example is a deterministic function of (seed, split, index): a small image with coloured shapes and one
question about it, in the K3 chat format:

    user:      <|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>{question}
    assistant: {answer}

Tasks (`TASKS`) and their answer sets (`CHOICES`):
    colour    "What colour is the shape?"              6 colours            chance 1/6
    shape     "What shape is this?"                    circle/square/triangle  1/3
    count     "How many shapes are there?"             one..four            1/4
    position  "Where is the shape?"                    top/bottom left/right  1/4
    text      "What letter is written?" (rendered with Pillow's built-in font)  A..F  1/6 (opt-in)
The loss covers the assistant turn only (the answer and its closing tags). `VisionSynthLoader` packs examples and
text-only documents into rows of a fixed *expanded* length (image tokens counted), with `cu_seqlens` in the
unexpanded coordinates `K3ForConditionalGeneration` takes. `choice_accuracy` scores every answer choice by its
summed log-probability after the prompt and counts the argmax hits (held-out split).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from k3.errors import K3ConfigError

__all__ = ["TASKS", "CHOICES", "COLOURS", "SynthExample", "VisionSynthTask", "VisionSynthLoader", "choice_accuracy",
           "chance_level"]

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (225, 200, 30),
           "purple": (140, 60, 190), "orange": (245, 140, 30)}
SHAPES = ("circle", "square", "triangle")
COUNTS = ("one", "two", "three", "four")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
LETTERS = ("A", "B", "C", "D", "E", "F")
QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is this?",
             "count": "How many shapes are there?", "position": "Where is the shape?",
             "text": "What letter is written?"}
CHOICES = {"colour": tuple(COLOURS), "shape": SHAPES, "count": COUNTS, "position": POSITIONS, "text": LETTERS}
TASKS = ("colour", "shape", "count", "position")
_SPLITS = {"train": 0, "val": 1, "test": 2}


def chance_level(tasks: Sequence[str] = TASKS) -> float:
    """Accuracy of a uniform guess, averaged over tasks drawn uniformly."""
    return sum(1.0 / len(CHOICES[t]) for t in tasks) / len(tasks)


@dataclass
class SynthExample:
    image: "PIL.Image.Image"  # noqa: F821
    task: str
    question: str
    answer: str
    choices: tuple


def _draw_shape(draw, kind: str, cx: float, cy: float, r: float, fill) -> None:
    if kind == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif kind == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=fill)


class VisionSynthTask:
    """Deterministic example factory + tokenisation. `sizes`: image side lengths (px) drawn per axis; multiples of
    28 keep the images unpadded (at 84-112 px: 9-16 image tokens each). `train_weights`: how often each task is
    drawn in the `train` split (default uniform); `val` / `test` stay uniform, so `chance` holds for them."""

    def __init__(self, tokenizer, tasks: Sequence[str] = TASKS, seed: int = 0, sizes: Sequence[int] = (84, 112),
                 processor_config=None, train_weights: Optional[Sequence[float]] = None):
        for t in tasks:
            if t not in CHOICES:
                raise K3ConfigError(f"vision-synth task {t!r}: unknown; known: {sorted(CHOICES)}")
        if not tasks:
            raise K3ConfigError("vision-synth needs at least one task")
        self.tokenizer = tokenizer
        self.tasks = tuple(tasks)
        self.seed = int(seed)
        self.sizes = tuple(int(s) for s in sizes)
        self.processor_config = processor_config
        if train_weights is not None:
            train_weights = tuple(float(w) for w in train_weights)
            if len(train_weights) != len(self.tasks) or any(w < 0 for w in train_weights) or not sum(train_weights):
                raise K3ConfigError(f"vision-synth train_weights {list(train_weights)}: need one weight >= 0 per "
                                    f"task {list(self.tasks)}, not all 0")
        self.train_weights = train_weights
        self._prompt_cache: dict = {}

    @property
    def chance(self) -> float:
        return chance_level(self.tasks)

    # ------------------------------------------------------------------ images
    def example(self, index: int, split: str = "train") -> SynthExample:
        from PIL import Image, ImageDraw
        if split not in _SPLITS:
            raise K3ConfigError(f"split {split!r}: expected one of {sorted(_SPLITS)}")
        rng = random.Random(f"k3-vision-synth/{self.seed}/{split}/{int(index)}")
        if split == "train" and self.train_weights is not None:   # held-out splits stay uniform over tasks
            task = rng.choices(self.tasks, weights=self.train_weights)[0]
        else:
            task = self.tasks[rng.randrange(len(self.tasks))]
        W, H = rng.choice(self.sizes), rng.choice(self.sizes)
        bg = tuple(rng.randint(215, 255) for _ in range(3))
        img = Image.new("RGB", (W, H), bg)
        draw = ImageDraw.Draw(img)
        colour = rng.choice(tuple(COLOURS))
        kind = rng.choice(SHAPES)
        scale = min(1.0, min(W, H) / 84.0)  # images under 84 px get proportionally smaller shapes
        r = rng.uniform(10, 16) * scale
        if task == "count":
            n = rng.randint(1, 4)
            answer = COUNTS[n - 1]
            r = rng.uniform(7, 10) * scale
            centres: list = []
            tries = 0
            while len(centres) < n:  # rejection sampling: no overlaps
                tries += 1
                if tries > 200:  # the shapes placed so far leave no room: start the placement over
                    centres, tries = [], 0
                c = (rng.uniform(r + 1, W - r - 1), rng.uniform(r + 1, H - r - 1))
                if all(math.hypot(c[0] - x, c[1] - y) > 2.3 * r for x, y in centres):
                    centres.append(c)
            for cx, cy in centres:
                _draw_shape(draw, rng.choice(SHAPES), cx, cy, r, COLOURS[rng.choice(tuple(COLOURS))])
        elif task == "position":
            q = rng.randrange(4)
            answer = POSITIONS[q]
            cx = rng.uniform(r + 1, W / 2 - r - 2) + (W / 2 if q % 2 else 0)
            cy = rng.uniform(r + 1, H / 2 - r - 2) + (H / 2 if q >= 2 else 0)
            _draw_shape(draw, kind, cx, cy, r, COLOURS[colour])
        elif task == "text":
            from PIL import ImageFont
            answer = rng.choice(LETTERS)
            font = ImageFont.load_default()
            try:
                font = ImageFont.load_default(size=rng.randint(28, 40))
            except TypeError:  # Pillow < 10.1: fixed-size bitmap font
                pass
            draw.text((rng.uniform(4, W / 3), rng.uniform(4, H / 3)), answer, fill=COLOURS[colour], font=font)
        else:
            cx, cy = rng.uniform(r + 1, W - r - 1), rng.uniform(r + 1, H - r - 1)
            _draw_shape(draw, kind, cx, cy, r, COLOURS[colour])
            answer = colour if task == "colour" else kind
        return SynthExample(img, task, QUESTIONS[task], answer, CHOICES[task])

    # ------------------------------------------------------------------ tokens
    def _messages(self, ex: SynthExample, answer: Optional[str]):
        W, H = ex.image.size
        msgs = [{"role": "user", "content": [{"type": "image", "width": W, "height": H},
                                             {"type": "text", "text": ex.question}]}]
        if answer is not None:
            msgs.append({"role": "assistant", "content": answer})
        return msgs

    def prompt_ids(self, ex: SynthExample) -> list:
        """The user turn + the assistant generation prompt (ends with `<|open|>response<|sep|>`)."""
        from k3.chat import render_messages
        key = (ex.image.size, ex.question)
        if key not in self._prompt_cache:
            self._prompt_cache[key] = render_messages(self._messages(ex, None), thinking=False,
                                                      add_generation_prompt=True, tokenizer=self.tokenizer)
        return list(self._prompt_cache[key])

    def answer_ids(self, answer: str) -> list:
        return self.tokenizer.encode(answer, allow_special=False)

    def encode(self, ex: SynthExample) -> dict:
        """{"input_ids": prompt + answer + closing tags, "labels": aligned targets (-100 outside the assistant
        turn; the last token has none), "answer_span": (start, end) of the answer ids}."""
        from k3.chat import render_messages
        prompt = self.prompt_ids(ex)
        full = render_messages(self._messages(ex, ex.answer), thinking=False, add_generation_prompt=False,
                               tokenizer=self.tokenizer)
        ans = self.answer_ids(ex.answer)
        if full[:len(prompt)] != prompt or full[len(prompt):len(prompt) + len(ans)] != ans:
            raise K3ConfigError("vision-synth: the chat rendering does not split into prompt + answer + tail")
        labels = [-100] * len(full)
        for t in range(len(prompt) - 1, len(full) - 1):
            labels[t] = full[t + 1]
        return {"input_ids": full, "labels": labels, "answer_span": (len(prompt), len(prompt) + len(ans))}

    def pixels(self, images) -> tuple:
        from k3.vision.preprocess import preprocess
        return preprocess(list(images), self.processor_config)


def _image_tokens(img, processor_config) -> int:
    from k3.vision.preprocess import num_image_tokens
    return num_image_tokens(img.size[0], img.size[1], processor_config)


class VisionSynthLoader:
    """Packed training rows: synthetic examples (index order from `start`) plus text-only documents (token lists,
    loss on every next token), one row of at most `seq_len` *expanded* positions per batch (batch size 1, documents
    separated by `cu_seqlens`). `text_every`: one text document after every `text_every` examples (0 = none);
    text documents longer than a quarter row are cut.

    Yields {"input_ids" [1, T], "labels" [1, T], "cu_seqlens" [D+1] int32, "pixel_values", "grid_thw",
    "n_examples", "n_text_docs"}; `state_dict()` / `load_state_dict()` resume it."""

    def __init__(self, task: VisionSynthTask, seq_len: int = 512, text_docs: Sequence[Sequence[int]] = (),
                 text_every: int = 4, split: str = "train", start: int = 0):
        self.task, self.seq_len, self.split = task, int(seq_len), split
        self.text_docs = [list(d) for d in text_docs if len(d) >= 2]
        self.text_every = int(text_every) if self.text_docs else 0
        self.index, self.text_index, self.since_text = int(start), 0, 0

    def state_dict(self) -> dict:
        return {"index": self.index, "text_index": self.text_index, "since_text": self.since_text}

    def load_state_dict(self, s: dict) -> None:
        self.index, self.text_index, self.since_text = int(s["index"]), int(s["text_index"]), int(s["since_text"])

    def _next_doc(self):
        if self.text_every and self.since_text >= self.text_every:
            self.since_text = 0
            d = self.text_docs[self.text_index % len(self.text_docs)]
            self.text_index += 1
            d = d[: max(2, self.seq_len // 4)]
            return d, [-100 if i == len(d) - 1 else d[i + 1] for i in range(len(d))], None
        self.since_text += 1
        ex = self.task.example(self.index, self.split)
        self.index += 1
        enc = self.task.encode(ex)
        return enc["input_ids"], enc["labels"], ex.image

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        ids, labels, cu, images, used, n_ex, n_txt = [], [], [0], [], 0, 0, 0
        while True:
            snap = self.state_dict()
            d_ids, d_lab, img = self._next_doc()
            extra = _image_tokens(img, self.task.processor_config) - 1 if img is not None else 0
            need = len(d_ids) + extra
            if need > self.seq_len:
                raise K3ConfigError(f"vision-synth: one example needs {need} positions > seq_len {self.seq_len}")
            if used + need > self.seq_len:
                self.load_state_dict(snap)  # does not fit: the next row starts with it
                break
            ids += d_ids
            labels += d_lab
            cu.append(len(ids))
            used += need
            if img is not None:
                images.append(img)
                n_ex += 1
            else:
                n_txt += 1
        pv, grid = self.task.pixels(images)
        return {"input_ids": torch.tensor([ids], dtype=torch.long), "labels": torch.tensor([labels], dtype=torch.long),
                "cu_seqlens": torch.tensor(cu, dtype=torch.int32), "pixel_values": pv, "grid_thw": grid,
                "n_examples": n_ex, "n_text_docs": n_txt}


@torch.no_grad()
def choice_accuracy(model, task: VisionSynthTask, n: int = 100, split: str = "val", start: int = 0) -> dict:
    """Held-out accuracy: for each example, every answer choice is scored by its summed log-probability after the
    prompt (one batched forward per example, the image repeated per row); a hit when the true answer scores
    highest. Returns {"accuracy", "chance", "n", "per_task": {task: accuracy}}."""
    was = model.training
    model.eval()
    hits, per = 0, {}
    pad = model.config.pad_token_id
    try:
        for i in range(start, start + n):
            ex = task.example(i, split)
            prompt = task.prompt_ids(ex)
            cand = [task.answer_ids(c) for c in ex.choices]
            T = len(prompt) + max(len(c) for c in cand)
            ids = torch.full((len(cand), T), pad, dtype=torch.long)
            for j, c in enumerate(cand):
                ids[j, :len(prompt) + len(c)] = torch.tensor(prompt + c)
            pv, grid = task.pixels([ex.image] * len(cand))
            out = model(ids.to(model.device), pv.to(model.device), grid)
            logp = torch.log_softmax(out.logits.float(), -1)
            shift = int(out.input_ids.shape[1] - T)  # the image expansion (same in every row)
            scores = []
            for j, c in enumerate(cand):
                s = 0.0
                for k, tok in enumerate(c):
                    pos = shift + len(prompt) + k - 1  # position predicting answer token k
                    s += float(logp[j, pos, tok])
                scores.append(s)
            ok = int(np.argmax(scores)) == ex.choices.index(ex.answer)
            hits += ok
            a, b = per.get(ex.task, (0, 0))
            per[ex.task] = (a + ok, b + 1)
    finally:
        model.train(was)
    return {"accuracy": hits / max(1, n), "chance": task.chance, "n": n,
            "per_task": {t: a / b for t, (a, b) in sorted(per.items())}}
