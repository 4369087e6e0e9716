"""Safety hooks for agentic RL: an output filter, a reward audit log and a human-review gate.

Output filter rules (JSON file: a list, or {"rules": [...]}):

    [{"name": "no-shell", "type": "substring", "pattern": "rm -rf", "ignore_case": true, "target": "calls"},
     {"name": "no-secrets", "type": "regex", "pattern": "(?i)api[_-]?key\\s*="}]

`type` is "substring" or "regex", `target` is "outputs" (the decoded assistant turns), "calls" (tool-call names
and arguments as JSON) or "all" (default). A trajectory that any rule matches is *filtered*: its reward becomes 0,
`filtered`/`filter_rules` are set, and the audit log records the decision.

`AuditLog(path)` appends one strict-JSON line per trajectory (non-finite numbers become null): step, prompt,
calls, tool outputs, assistant outputs, rewards, the filter decision.

`ReviewHook(run_dir, review_every=N)`: every N steps `review(step, records)` writes RUN/review/step-N.jsonl and
polls for RUN/review/step-N.approved or step-N.rejected (touch one to decide) every `poll_s` seconds up to
`timeout_s`; on timeout it applies `on_timeout` ("reject", "approve" or "raise").
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence

from k3.errors import K3ConfigError, K3Error

__all__ = ["FilterRule", "OutputFilter", "FilterDecision", "AuditLog", "ReviewHook", "ReviewTimeout",
           "strict_json", "apply_filter"]

TARGETS = ("outputs", "calls", "all")


class ReviewTimeout(K3Error, TimeoutError):
    """No approve/reject file appeared within the review timeout."""


@dataclass
class FilterRule:
    name: str
    type: str
    pattern: str
    ignore_case: bool = False
    target: str = "all"

    def __post_init__(self):
        if self.type not in ("substring", "regex"):
            raise K3ConfigError(f"filter rule {self.name!r}: type must be 'substring' or 'regex', got {self.type!r}")
        if self.target not in TARGETS:
            raise K3ConfigError(f"filter rule {self.name!r}: target must be one of {TARGETS}, got {self.target!r}")
        if not isinstance(self.pattern, str) or not self.pattern:
            raise K3ConfigError(f"filter rule {self.name!r}: pattern must be a non-empty string")
        if self.type == "regex":
            try:
                self._re = re.compile(self.pattern, re.IGNORECASE if self.ignore_case else 0)
            except re.error as e:
                raise K3ConfigError(f"filter rule {self.name!r}: bad regex {self.pattern!r}: {e}") from None
        else:
            self._needle = self.pattern.lower() if self.ignore_case else self.pattern

    def matches(self, text: str) -> bool:
        if self.type == "regex":
            return self._re.search(text) is not None
        return self._needle in (text.lower() if self.ignore_case else text)


@dataclass
class FilterDecision:
    blocked: bool
    rules: List[str]


class OutputFilter:
    def __init__(self, rules: Sequence[FilterRule] = ()):
        self.rules = list(rules)

    @classmethod
    def from_rules(cls, raw: Any, where: str = "filter rules") -> "OutputFilter":
        if isinstance(raw, dict):
            raw = raw.get("rules")
        if not isinstance(raw, list):
            raise K3ConfigError(f"{where}: must be a list of rules or {{\"rules\": [...]}}")
        rules = []
        for i, r in enumerate(raw):
            if not isinstance(r, dict):
                raise K3ConfigError(f"{where}: rules[{i}] must be an object")
            unknown = sorted(set(r) - {"name", "type", "pattern", "ignore_case", "target"})
            if unknown:
                raise K3ConfigError(f"{where}: rules[{i}] has unknown keys {unknown}")
            if "pattern" not in r:
                raise K3ConfigError(f"{where}: rules[{i}] needs a 'pattern'")
            try:
                rules.append(FilterRule(name=str(r.get("name", f"rule{i}")), type=r.get("type", "substring"),
                                        pattern=r["pattern"], ignore_case=bool(r.get("ignore_case", False)),
                                        target=r.get("target", "all")))
            except K3ConfigError as e:
                raise K3ConfigError(f"{where}: rules[{i}]: {e}") from None
        return cls(rules)

    @classmethod
    def from_json(cls, path: str) -> "OutputFilter":
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise K3ConfigError(f"filter rules file not found: {path}") from None
        except ValueError as e:
            raise K3ConfigError(f"filter rules file {path}: invalid JSON ({e})") from None
        return cls.from_rules(raw, where=f"filter rules file {path}")

    def check(self, outputs: Iterable[str], calls: Iterable[Any] = ()) -> FilterDecision:
        out_text = "\n".join(o for o in outputs if isinstance(o, str))
        call_text = "\n".join(json.dumps(c, ensure_ascii=False, sort_keys=True, default=str) for c in calls)
        hits = []
        for r in self.rules:
            texts = {"outputs": [out_text], "calls": [call_text], "all": [out_text, call_text]}[r.target]
            if any(r.matches(t) for t in texts):
                hits.append(r.name)
        return FilterDecision(bool(hits), hits)


def apply_filter(trajs, flt: Optional[OutputFilter]) -> int:
    """Check every trajectory; filtered ones get reward 0 (and `filtered`, `filter_rules`). Returns how many."""
    if flt is None or not flt.rules:
        return 0
    n = 0
    for t in trajs:
        d = flt.check(t.outputs, t.tool_calls)
        t.filtered, t.filter_rules = d.blocked, d.rules
        if d.blocked:
            t.reward = 0.0
            n += 1
    return n


def _sanitize(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _sanitize(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_sanitize(v) for v in x]
    if x is None or isinstance(x, (str, int, bool)):
        return x
    if hasattr(x, "tolist"):
        return _sanitize(x.tolist())
    return str(x)


def strict_json(obj: Any) -> str:
    """One line of strict JSON (no NaN/Infinity: they become null; unknown objects become strings)."""
    return json.dumps(_sanitize(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class AuditLog:
    """Append-only JSONL reward audit log (one line per trajectory, flushed per batch)."""

    def __init__(self, path: str):
        self.path = path
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)

    def write(self, step: int, trajs) -> int:
        lines = []
        for t in trajs:
            rec = t.to_record() if hasattr(t, "to_record") else dict(t)
            rec = {"step": int(step), **rec,
                   "filter": {"blocked": bool(rec.get("filtered", False)), "rules": rec.get("filter_rules", [])}}
            lines.append(strict_json(rec))
        with open(self.path, "a", encoding="utf-8") as f:
            for ln in lines:
                f.write(ln + "\n")
            f.flush()
        return len(lines)


class ReviewHook:
    """Human review gate (module doc). review() returns "approved", "rejected" or "skipped" (not a review step)."""

    def __init__(self, run_dir: str, review_every: int = 0, timeout_s: float = 3600.0, poll_s: float = 5.0,
                 on_timeout: str = "reject"):
        if review_every < 0:
            raise K3ConfigError(f"review_every must be >= 0, got {review_every}")
        if on_timeout not in ("reject", "approve", "raise"):
            raise K3ConfigError(f"review on_timeout must be reject/approve/raise, got {on_timeout!r}")
        if not poll_s > 0 or timeout_s < 0:
            raise K3ConfigError(f"review poll_s must be > 0 and timeout_s >= 0, got {poll_s}, {timeout_s}")
        self.dir = os.path.join(run_dir, "review")
        self.every, self.timeout_s, self.poll_s, self.on_timeout = int(review_every), timeout_s, poll_s, on_timeout

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def paths(self, step: int) -> Dict[str, str]:
        base = os.path.join(self.dir, f"step-{step}")
        return {"batch": base + ".jsonl", "approved": base + ".approved", "rejected": base + ".rejected"}

    def review(self, step: int, records: Sequence[Any], sleep=time.sleep, clock=time.monotonic) -> str:
        if not self.due(step):
            return "skipped"
        p = self.paths(step)
        os.makedirs(self.dir, exist_ok=True)
        tmp = p["batch"] + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write(strict_json(r.to_record() if hasattr(r, "to_record") else r) + "\n")
        os.replace(tmp, p["batch"])
        t0 = clock()
        while True:
            if os.path.exists(p["rejected"]):
                return "rejected"
            if os.path.exists(p["approved"]):
                return "approved"
            if clock() - t0 >= self.timeout_s:
                break
            sleep(min(self.poll_s, max(0.0, self.timeout_s - (clock() - t0))) or self.poll_s)
        if self.on_timeout == "raise":
            raise ReviewTimeout(f"review of step {step}: neither {p['approved']} nor {p['rejected']} appeared "
                                f"within {self.timeout_s}s")
        return "approved" if self.on_timeout == "approve" else "rejected"
