"""SFT data: the embedded, generated SFT set of the built-in tasks, a `chats.jsonl` loader, assistant-only loss
masks and packing into rows with `cu_seqlens`.

Conversations are {"messages": [...], "tools": [...]} (K3 chat format, k3/chat.py). `encode_chat` renders one with
`k3.chat.render_messages_with_mask`: the loss mask is True only on assistant-turn output tokens (think/response
text, the tool calls and the closing `<|end_of_msg|>`); system, user and tool-result tokens (and the assistant
headers) are masked. Labels are aligned targets as in k3/train/data.py: ``labels[t] = ids[t+1]`` when token t+1 is
an assistant token, else -100.

Packing (`SFTLoader`): whole conversations are laid into rows of `seq_len` tokens in a per-epoch shuffled order
(first fit into the current row, a new row when it does not fit); a row's tail is padding (its own segment,
labels -100). Conversations longer than `seq_len` are cut to `seq_len` (counted in `num_truncated`). A batch is
``{"input_ids": [1, B*T], "labels": [1, B*T], "cu_seqlens": [N+1] int32}``: the packed-forward keywords of
`K3ForCausalLM`, with every conversation and every row start in `cu_seqlens`, so nothing attends or predicts
across conversations. The loader state (epoch, position) makes resume exact.
"""
from __future__ import annotations

import json
import os
import random
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from k3.chat import ChatFormatError, render_messages_with_mask
from k3.errors import K3ConfigError
from k3.rl.env import make_env

IGNORE_INDEX = -100
BUILTIN_TASKS = ("calculator", "kv-lookup", "multi-tool")

__all__ = ["SFTDataError", "expert_conversation", "builtin_sft_set", "load_chats", "encode_chat", "EncodedChat",
           "pack_rows", "SFTLoader", "SFTValLoader", "SFTData", "build_sft_data", "BUILTIN_TASKS",
           "VAL_SEED"]

VAL_SEED = 1   # builtin_sft_set(seed=VAL_SEED): the generated validation conversations (disjoint from seed 0)


class SFTDataError(K3ConfigError):
    """Bad SFT data (names the file and line)."""


# ------------------------------------------------------------------------------------------------ generated set
def expert_conversation(env, seed: int, reasoning: bool = False) -> Dict[str, Any]:
    """Run the env's expert demonstration (env.demonstration(): the tool calls and the final answer) through the
    env itself, so every tool result is the env's own output: one tool call per assistant turn, then the answer.
    Checks that the expert earns reward 1."""
    prompt = env.reset(seed)
    if isinstance(prompt, list):
        prompt = {"messages": prompt, "tools": list(getattr(env, "tools", []))}
    messages = [dict(m) for m in prompt["messages"]]
    calls, answer = env.demonstration()
    for i, call in enumerate(calls):
        obs, _, done = env.step(call)
        cid = f"call_{i + 1}"
        turn = {"role": "assistant", "content": "",
                "tool_calls": [{"id": cid, "type": "function",
                                "function": {"name": call["name"],
                                             "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}]}
        if reasoning:
            turn["reasoning_content"] = f"I need {call['name']}."
        messages.append(turn)
        messages.append({"role": "tool", "tool_call_id": cid, "content": obs})
        if done:
            raise SFTDataError(f"env {getattr(env, 'name', '?')!r}: episode ended before the expert finished")
    final = {"role": "assistant", "content": answer}
    if reasoning:
        final["reasoning_content"] = "I have the result."
    messages.append(final)
    r = env.check_answer(answer)
    if r != 1.0:
        raise SFTDataError(f"env {getattr(env, 'name', '?')!r}: expert answer {answer!r} got reward {r} (seed {seed})")
    return {"messages": messages, "tools": prompt.get("tools") or []}


def builtin_sft_set(n_per_task: int = 200, tasks: Sequence[str] = BUILTIN_TASKS, seed: int = 0,
                    env_options: Optional[Dict[str, Dict[str, Any]]] = None) -> List[Dict[str, Any]]:
    """The generated SFT set: `n_per_task` expert conversations of each built-in task (offline, deterministic).
    Seeds are `seed * 1_000_003 + i`; RL should reset its envs from a disjoint seed range (e.g. >= 10**9)."""
    out = []
    for name in tasks:
        env = make_env(name, **((env_options or {}).get(name, {})))
        for i in range(int(n_per_task)):
            out.append(expert_conversation(env, seed * 1_000_003 + i))
    return out


# ------------------------------------------------------------------------------------------------ chats.jsonl
def _check_chat(obj: Any, where: str) -> Dict[str, Any]:
    if not isinstance(obj, dict):
        raise SFTDataError(f"{where}: must be a JSON object {{\"messages\": [...], \"tools\": [...]}}, got "
                           f"{type(obj).__name__}")
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise SFTDataError(f"{where}: needs a non-empty 'messages' list")
    tools = obj.get("tools") or []
    if not isinstance(tools, list):
        raise SFTDataError(f"{where}: 'tools' must be a list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise SFTDataError(f"{where}: messages[{i}] needs a role system/user/assistant/tool")
    if not any(m.get("role") == "assistant" for m in msgs):
        raise SFTDataError(f"{where}: no assistant message (nothing to train on)")
    return {"messages": msgs, "tools": tools}


def load_chats(path: str) -> List[Dict[str, Any]]:
    """Read `chats.jsonl`: one {"messages": [...], "tools": [...]} per line (blank lines skipped). Errors name the
    file and the line."""
    if not os.path.isfile(path):
        raise SFTDataError(f"SFT data file not found: {path}")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise SFTDataError(f"{where}: invalid JSON ({e})") from None
            out.append(_check_chat(obj, where))
    if not out:
        raise SFTDataError(f"{path}: no conversations")
    return out


# ------------------------------------------------------------------------------------------------ encoding
class EncodedChat:
    __slots__ = ("ids", "labels", "mask")

    def __init__(self, ids: List[int], mask: List[bool]):
        self.ids, self.mask = ids, mask
        lab = [IGNORE_INDEX] * len(ids)
        for t in range(len(ids) - 1):
            if mask[t + 1]:
                lab[t] = ids[t + 1]
        self.labels = lab

    def __len__(self):
        return len(self.ids)


def encode_chat(chat: Dict[str, Any], tokenizer, thinking: bool = False, where: str = "conversation") -> EncodedChat:
    """Token ids + assistant-only mask of one conversation (module doc)."""
    try:
        ids, mask = render_messages_with_mask(chat["messages"], chat.get("tools") or None, thinking=thinking,
                                              add_generation_prompt=False, tokenizer=tokenizer)
    except ChatFormatError as e:
        raise SFTDataError(f"{where}: {e}") from None
    if not any(mask):
        raise SFTDataError(f"{where}: no assistant tokens to train on")
    return EncodedChat(ids, mask)


def pack_rows(chats: Sequence[EncodedChat], seq_len: int, pad_id: int) -> Tuple[List[np.ndarray], List[np.ndarray],
                                                                                List[List[int]], int]:
    """First-fit packing in the given order: (rows ids, rows labels, per-row segment starts, number truncated)."""
    if seq_len < 2:
        raise K3ConfigError(f"seq_len must be >= 2, got {seq_len}")
    rows_i, rows_l, starts = [], [], []
    cur_i: List[int] = []
    cur_l: List[int] = []
    cur_s: List[int] = []
    trunc = 0

    def flush():
        if cur_i:
            n = seq_len - len(cur_i)
            if n:
                cur_s.append(len(cur_i))
            rows_i.append(np.array(cur_i + [pad_id] * n, dtype=np.int64))
            rows_l.append(np.array(cur_l + [IGNORE_INDEX] * n, dtype=np.int64))
            starts.append(list(cur_s))

    for c in chats:
        ids, lab = c.ids, list(c.labels)
        if len(ids) > seq_len:
            ids, lab = ids[:seq_len], lab[:seq_len]
            lab[-1] = IGNORE_INDEX
            trunc += 1
        if len(cur_i) + len(ids) > seq_len:
            flush()
            cur_i, cur_l, cur_s = [], [], []
        cur_s.append(len(cur_i))
        cur_i += ids
        cur_l += lab
    flush()
    return rows_i, rows_l, starts, trunc


def truncation_loss(chats: Sequence[EncodedChat], seq_len: int) -> Dict[str, int]:
    """What cutting conversations to `seq_len` tokens (pack_rows) loses: conversations cut, their longest length,
    the supervised (assistant) targets beyond the cut, and all supervised targets."""
    cut = [c for c in chats if len(c.ids) > seq_len]
    return {"cut": len(cut), "total": len(chats), "longest": max((len(c.ids) for c in chats), default=0),
            "lost_targets": sum(sum(1 for t in c.labels[seq_len - 1:] if t != IGNORE_INDEX) for c in cut),
            "targets": sum(sum(1 for t in c.labels if t != IGNORE_INDEX) for c in chats)}


def warn_truncation(chats: Sequence[EncodedChat], seq_len: int, what: str) -> Dict[str, int]:
    """Log a warning when conversations are longer than `seq_len`: their assistant tokens past the cut are never
    trained on (a chat whose answer comes last loses exactly what SFT is for). Returns truncation_loss()."""
    t = truncation_loss(chats, seq_len)
    if t["cut"]:
        import logging
        logging.getLogger("k3.train").warning(
            "SFT %s data: %d of %d conversations are longer than the row length %d (longest %d tokens) and are cut; "
            "%d of their %d assistant tokens (%.1f%% of all) are never trained on: raise --seq-len to at least %d",
            what, t["cut"], t["total"], seq_len, t["longest"], t["lost_targets"], t["targets"],
            100.0 * t["lost_targets"] / max(t["targets"], 1), t["longest"])
    return t


def _batch(rows_i, rows_l, starts, seq_len) -> Dict[str, torch.Tensor]:
    ids = np.concatenate(rows_i)
    lab = np.concatenate(rows_l)
    cu = sorted({r * seq_len + s for r, ss in enumerate(starts) for s in [0] + ss})
    cu = np.array(cu + [ids.shape[0]], dtype=np.int32)
    n = ids.shape[0]
    return {"input_ids": torch.from_numpy(ids).view(1, n), "labels": torch.from_numpy(lab).view(1, n),
            "cu_seqlens": torch.from_numpy(cu)}


class SFTLoader:
    """Packed SFT batches of `batch_size` rows x `seq_len` over encoded conversations, reshuffled every epoch
    (seeded); `state_dict()`/`load_state_dict()` resume at the exact next batch."""

    def __init__(self, chats: Sequence[Dict[str, Any]], tokenizer, seq_len: int, batch_size: int, seed: int = 0,
                 thinking: bool = False):
        if batch_size < 1:
            raise K3ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.encoded = [encode_chat(c, tokenizer, thinking, where=f"conversation {i}") for i, c in enumerate(chats)]
        self.seq_len, self.batch_size, self.seed = int(seq_len), int(batch_size), int(seed)
        self.pad_id = tokenizer.pad_id
        self.epoch, self.pos = 0, 0
        self._rows = None
        self.num_truncated = 0
        warn_truncation(self.encoded, self.seq_len, "training")

    def _epoch_rows(self):
        if self._rows is None or self._rows[0] != self.epoch:
            order = list(range(len(self.encoded)))
            random.Random(self.seed * 7919 + self.epoch).shuffle(order)
            ri, rl, st, tr = pack_rows([self.encoded[i] for i in order], self.seq_len, self.pad_id)
            self.num_truncated = tr
            self._rows = (self.epoch, ri, rl, st)
        return self._rows[1:]

    @property
    def rows_per_epoch(self) -> int:
        return len(self._epoch_rows()[0])

    @property
    def assistant_tokens(self) -> int:
        return sum(sum(c.mask) for c in self.encoded)

    @property
    def epoch_progress(self) -> float:
        """Epochs completed, fractional (the trainer's metrics column)."""
        n = self.rows_per_epoch
        return self.epoch + (self.pos / n if n else 0.0)

    def next_batch(self, seq_len: Optional[int] = None, batch_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
        """The next `batch_size` rows (default: the loader's). `seq_len`, when given (the trainer passes its stage
        length), must be the loader's: SFT rows are packed per epoch at one length (one context stage)."""
        if seq_len is not None and int(seq_len) != self.seq_len:
            raise K3ConfigError(f"SFT rows are packed at seq_len {self.seq_len}, the trainer asked for {seq_len}: "
                                f"SFT runs use one context stage (--stages {self.seq_len}:1)")
        want = self.batch_size if batch_size is None else int(batch_size)
        ri, rl, st, out_i, out_l, out_s = None, None, None, [], [], []
        while len(out_i) < want:
            ri, rl, st = self._epoch_rows()
            if self.pos >= len(ri):
                self.epoch, self.pos = self.epoch + 1, 0
                continue
            out_i.append(ri[self.pos])
            out_l.append(rl[self.pos])
            out_s.append(st[self.pos])
            self.pos += 1
        return _batch(out_i, out_l, out_s, self.seq_len)

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "num_chats": len(self.encoded)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if int(state.get("num_chats", len(self.encoded))) != len(self.encoded):
            raise SFTDataError(f"SFT loader state is for {state.get('num_chats')} conversations, this data has "
                               f"{len(self.encoded)}")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


class SFTValLoader:
    """Fixed validation batches over encoded conversations: packed in their given order (first fit), the same
    batches every time (the `batches()` interface of k3.train.data.ValLoader)."""

    def __init__(self, encoded: Sequence[EncodedChat], seq_len: int, batch_size: int, pad_id: int):
        self.encoded, self.seq_len, self.batch_size, self.pad_id = list(encoded), int(seq_len), int(batch_size), pad_id

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for c in self.encoded)

    def batches(self, seq_len: Optional[int] = None, batch_size: Optional[int] = None,
                max_batches: Optional[int] = None) -> Iterator[Dict[str, torch.Tensor]]:
        T, B = int(seq_len or self.seq_len), int(batch_size or self.batch_size)
        ri, rl, st, _ = pack_rows(self.encoded, T, self.pad_id)
        done = 0
        for s in range(0, len(ri), B):
            if max_batches is not None and done >= max_batches:
                return
            yield _batch(ri[s:s + B], rl[s:s + B], st[s:s + B], T)
            done += 1


class SFTData:
    """What the trainer reads (the fields of k3.train.data.K3Data): tokenizer, train (SFTLoader), val."""

    def __init__(self, tokenizer, train: SFTLoader, val: SFTValLoader, num_train_docs: int, num_val_docs: int):
        self.tokenizer, self.train, self.val = tokenizer, train, val
        self.num_train_docs, self.num_val_docs = num_train_docs, num_val_docs


def build_sft_data(tokenizer, seq_len: int, batch_size: int, seed: int = 0, data: Optional[str] = None,
                   n_per_task: int = 200, tasks: Sequence[str] = BUILTIN_TASKS, thinking: bool = False,
                   val_fraction: float = 0.05) -> SFTData:
    """SFT data for `k3 sft`: `data` (a chats.jsonl) or, without it, the generated set of the built-in `tasks`
    (`n_per_task` each; validation: a generated set of seed VAL_SEED, disjoint). A chats.jsonl holds out every
    round(1 / val_fraction)-th conversation for validation when it has at least 20, else validates on the
    training conversations (said in the log)."""
    if data is None:
        train = builtin_sft_set(n_per_task, tasks, seed=0)
        val = builtin_sft_set(max(1, int(n_per_task * val_fraction)) if n_per_task >= 20 else n_per_task, tasks,
                              seed=VAL_SEED)
    else:
        chats = load_chats(data)
        every = max(2, round(1 / val_fraction)) if val_fraction > 0 else 0
        if every and len(chats) >= 20:
            val = [c for i, c in enumerate(chats) if i % every == every - 1]
            train = [c for i, c in enumerate(chats) if i % every != every - 1]
        else:
            import logging
            logging.getLogger("k3.train").warning("%s: %d conversations: validating on the training set", data,
                                                  len(chats))
            train, val = chats, chats
    loader = SFTLoader(train, tokenizer, seq_len, batch_size, seed=seed, thinking=thinking)
    venc = [encode_chat(c, tokenizer, thinking, where=f"validation conversation {i}") for i, c in enumerate(val)]
    return SFTData(tokenizer, loader, SFTValLoader(venc, seq_len, batch_size, tokenizer.pad_id), len(train), len(val))
