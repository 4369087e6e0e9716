"""Image-text pairs from a JSONL file, for `k3 train --task image-text --data pairs.jsonl`.

One record per line:
    {"image": "cat.png" | "data:image/png;base64,...", "text": "A cat on a mat."}
    {"image": ..., "messages": [{"role": "user", "content": "What is this?"}, {"role": "assistant", ...}]}
"image" paths are relative to the JSONL file. With "text" the example is a user turn holding the image and an
assistant turn with the text (captioning); with "messages" the image is put before the first user message's
content. The loss covers the last assistant turn. Every 10th record (when there are at least 10) is held out for
the "val" split. The object duck-types `k3.vision.synth.VisionSynthTask` for `VisionSynthLoader`.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import dataclass
from k3.errors import K3ConfigError

__all__ = ["ImageTextPairs", "PairExample"]


@dataclass
class PairExample:
    image: "PIL.Image.Image"  # noqa: F821  (a decoded Pillow image)
    messages: list


class ImageTextPairs:
    def __init__(self, path: str, tokenizer, processor_config=None):
        if not os.path.isfile(path):
            raise K3ConfigError(f"image-text data {path!r}: no such file")
        self.path, self.tokenizer, self.processor_config = path, tokenizer, processor_config
        self.records = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError as e:
                    raise K3ConfigError(f"{path}:{n}: not JSON ({e.msg})") from None
                if not isinstance(r, dict) or not isinstance(r.get("image"), str):
                    raise K3ConfigError(f"{path}:{n}: expected an object with an \"image\" string (a path or a data "
                                        f"URI)")
                if not isinstance(r.get("text"), str) and not isinstance(r.get("messages"), list):
                    raise K3ConfigError(f"{path}:{n}: expected \"text\" (a string) or \"messages\" (a list)")
                self.records.append((n, r))
        if not self.records:
            raise K3ConfigError(f"image-text data {path}: no records")
        held = [i for i in range(len(self.records)) if len(self.records) >= 10 and i % 10 == 0]
        self.splits = {"val": held or list(range(len(self.records))),
                       "train": [i for i in range(len(self.records)) if i not in set(held)]}
        self.splits["test"] = self.splits["val"]

    def texts(self) -> list:
        """The records' text (for training a tokenizer)."""
        out = []
        for _, r in self.records:
            if "text" in r:
                out.append(r["text"])
            else:
                out += [m.get("content") for m in r["messages"] if isinstance(m, dict) and
                        isinstance(m.get("content"), str)]
        return out

    def _image(self, n: int, src: str):
        from k3.vision.preprocess import load_image
        if src.startswith("data:"):
            meta, _, payload = src[5:].partition(",")
            try:
                data = base64.b64decode("".join(payload.split()), validate=True)
            except (binascii.Error, ValueError):
                raise K3ConfigError(f"{self.path}:{n}: \"image\" data URI is not valid base64") from None
            return load_image(data, self.processor_config)
        p = src if os.path.isabs(src) else os.path.join(os.path.dirname(os.path.abspath(self.path)), src)
        return load_image(p, self.processor_config)

    def example(self, index: int, split: str = "train") -> PairExample:
        rows = self.splits.get(split)
        if rows is None:
            raise K3ConfigError(f"split {split!r}: expected one of {sorted(self.splits)}")
        if not rows:
            raise K3ConfigError(f"image-text data {self.path}: no records in split {split!r}")
        n, r = self.records[rows[int(index) % len(rows)]]
        img = self._image(n, r["image"])
        part = {"type": "image", "width": img.size[0], "height": img.size[1]}
        if "text" in r:
            msgs = [{"role": "user", "content": [part]}, {"role": "assistant", "content": r["text"]}]
        else:
            msgs = [dict(m) for m in r["messages"]]
            for m in msgs:
                if m.get("role") == "user":
                    c = m.get("content")
                    m["content"] = [part] + (c if isinstance(c, list) else [{"type": "text", "text": c or ""}])
                    break
            else:
                raise K3ConfigError(f"{self.path}:{n}: \"messages\" has no user message to hold the image")
            if msgs[-1].get("role") != "assistant":
                raise K3ConfigError(f"{self.path}:{n}: \"messages\" must end with an assistant message")
        return PairExample(img, msgs)

    def encode(self, ex: PairExample) -> dict:
        """ids of the conversation; labels (aligned targets) on the last assistant turn."""
        from k3.chat import render_messages
        prompt = render_messages(ex.messages[:-1], thinking=False, add_generation_prompt=True,
                                 tokenizer=self.tokenizer)
        full = render_messages(ex.messages, thinking=False, add_generation_prompt=False, tokenizer=self.tokenizer)
        if full[:len(prompt)] != prompt:
            raise K3ConfigError("image-text: the chat rendering does not split into prompt + answer")
        labels = [-100] * len(full)
        for t in range(len(prompt) - 1, len(full) - 1):
            labels[t] = full[t + 1]
        return {"input_ids": full, "labels": labels}

    def pixels(self, images) -> tuple:
        from k3.vision.preprocess import preprocess
        return preprocess(list(images), self.processor_config)
