"""Output filter, audit log (strict JSON), human-review gate."""
import json
import math

import pytest

from k3.errors import K3ConfigError
from k3.rl.rollout import Trajectory
from k3.rl.safety import AuditLog, OutputFilter, ReviewHook, ReviewTimeout, apply_filter, strict_json


def _traj(outputs, calls, reward=1.0, **kw):
    t = Trajectory("calculator", 1, 0, 0, {"messages": [{"role": "user", "content": "2+2?"}], "tools": []},
                   [1, 2, 3], [False, True, True], 1, outputs=list(outputs), tool_calls=list(calls), **kw)
    t.reward, t.rewards = reward, [reward]
    return t


def test_filter_rules_from_json(tmp_path):
    p = tmp_path / "rules.json"
    p.write_text(json.dumps({"rules": [
        {"name": "shell", "type": "substring", "pattern": "RM -RF", "ignore_case": True, "target": "calls"},
        {"name": "key", "type": "regex", "pattern": r"api[_-]?key\s*=", "target": "outputs"}]}))
    f = OutputFilter.from_json(str(p))
    assert f.check(["fine"], [{"name": "calculator", "arguments": {"expression": "1"}}]).blocked is False
    d = f.check(["x"], [{"name": "sh", "arguments": {"cmd": "rm -rf /"}}])
    assert d.blocked and d.rules == ["shell"]
    assert f.check(["my api_key = 3"], []).rules == ["key"]
    assert not f.check(["rm -rf"], []).blocked            # "shell" only looks at calls
    trajs = [_traj(["ok"], []), _traj(["api-key=1"], [], reward=1.0)]
    assert apply_filter(trajs, f) == 1
    assert trajs[0].reward == 1.0 and not trajs[0].filtered
    assert trajs[1].reward == 0.0 and trajs[1].filtered and trajs[1].filter_rules == ["key"]


@pytest.mark.parametrize("raw,msg", [({"rules": [{"type": "regex", "pattern": "("}]}, r"rules\[0\].*bad regex"),
                                     ([{"pattern": "x", "type": "glob"}], r"rules\[0\].*type must be"),
                                     ([{"name": "a"}], r"rules\[0\] needs a 'pattern'"),
                                     ([{"pattern": "x", "colour": 1}], r"unknown keys \['colour'\]"),
                                     ("nope", "must be a list")])
def test_filter_rule_errors(tmp_path, raw, msg):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(raw))
    with pytest.raises(K3ConfigError, match=msg):
        OutputFilter.from_json(str(p))


def test_filter_file_errors(tmp_path):
    with pytest.raises(K3ConfigError, match="not found"):
        OutputFilter.from_json(str(tmp_path / "none.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(K3ConfigError, match=r"bad\.json: invalid JSON"):
        OutputFilter.from_json(str(tmp_path / "bad.json"))


def test_audit_log_lines_are_strict_json(tmp_path):
    log = AuditLog(str(tmp_path / "run" / "audit.jsonl"))
    t1 = _traj(["<|open|>response 4", "\u00e9\n\"q\""], [{"name": "calculator", "arguments": {"expression": "2+2"}}])
    t1.observations = ["4"]
    t2 = _traj(["bad"], [], reward=float("nan"))
    t2.filtered, t2.filter_rules = True, ["r1"]
    assert log.write(3, [t1, t2]) == 2
    log.write(4, [t1])
    lines = (tmp_path / "run" / "audit.jsonl").read_text().splitlines()
    assert len(lines) == 3

    def no_const(c):
        raise ValueError(f"non-strict JSON constant {c}")
    recs = [json.loads(ln, parse_constant=no_const) for ln in lines]
    assert recs[0]["step"] == 3 and recs[2]["step"] == 4
    assert recs[0]["prompt"]["messages"][0]["content"] == "2+2?"
    assert recs[0]["tool_calls"][0]["name"] == "calculator" and recs[0]["observations"] == ["4"]
    assert recs[0]["outputs"][1] == "\u00e9\n\"q\"" and recs[0]["rewards"] == [1.0]
    assert recs[1]["reward"] is None and recs[1]["filter"] == {"blocked": True, "rules": ["r1"]}
    assert strict_json({"a": math.inf, "b": (1, 2)}) == '{"a":null,"b":[1,2]}'


def test_review_hook(tmp_path):
    h = ReviewHook(str(tmp_path), review_every=2, timeout_s=10, poll_s=1)
    assert h.review(1, []) == "skipped"
    p = h.paths(2)
    clock = {"t": 0.0}
    polls = []

    def sleep(s):                 # a reviewer approves after the second poll
        polls.append(s)
        clock["t"] += s
        if len(polls) == 2:
            open(p["approved"], "w").close()
    rec = [_traj(["a"], []), {"x": 1}]
    assert h.review(2, rec, sleep=sleep, clock=lambda: clock["t"]) == "approved"
    lines = open(p["batch"]).read().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["outputs"] == ["a"] and json.loads(lines[1]) == {"x": 1}
    open(h.paths(4)["rejected"], "w").close()
    assert h.review(4, rec) == "rejected"
    clock["t"] = 0.0
    assert h.review(6, rec, sleep=lambda s: clock.__setitem__("t", clock["t"] + s),
                    clock=lambda: clock["t"]) == "rejected"          # timeout -> on_timeout="reject"
    h2 = ReviewHook(str(tmp_path), review_every=1, timeout_s=0, poll_s=1, on_timeout="raise")
    with pytest.raises(ReviewTimeout, match="step-7.approved"):
        h2.review(7, rec)
    with pytest.raises(K3ConfigError):
        ReviewHook(str(tmp_path), on_timeout="maybe")
