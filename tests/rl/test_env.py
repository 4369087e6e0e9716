"""Environment protocol, errors, the safe calculator and the built-in tasks."""
import pytest

from k3.errors import K3ConfigError
from k3.rl.env import (CalculatorError, EnvProtocolError, ToolCallError, checked, list_envs, make_env,
                       normalize_tool_call, register_env, safe_eval)


@pytest.mark.parametrize("expr,val", [("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("-4 ** 2", -16), ("7 // 2", 3),
                                      ("7 % 4", 3), ("1 / 4", 0.25), ("+3 - -2", 5), ("2 ** 10", 1024)])
def test_safe_eval_arithmetic(expr, val):
    assert safe_eval(expr) == val


@pytest.mark.parametrize("expr", ["__import__('os').system('echo hi')", "open('x')", "x + 1", "(1).real",
                                  "[1, 2]", "'a' * 3", "1 if 1 else 2", "lambda: 1", "2 ** 1000", "10 ** 10 ** 10",
                                  "1 / 0", "True + 1", "().__class__", "1; 2", "a[0]"])
def test_safe_eval_rejects(expr):
    with pytest.raises(CalculatorError):
        safe_eval(expr)


def test_safe_eval_never_calls_eval(monkeypatch):
    import builtins
    def boom(*a, **k):
        raise AssertionError("eval/exec must not be used")
    monkeypatch.setattr(builtins, "eval", boom)
    monkeypatch.setattr(builtins, "exec", boom)
    assert safe_eval("6 * 7") == 42


def test_registry_and_determinism():
    assert {"calculator", "kv-lookup", "multi-tool"} <= set(list_envs())
    for name in ("calculator", "kv-lookup", "multi-tool"):
        a, b = make_env(name), make_env(name)
        pa, pb = a.reset(5), b.reset(5)
        assert pa == pb and pa["tools"] and pa["messages"][-1]["role"] == "user"
        assert a.reset(6) != pb
        a.reset(5)
        calls, answer = a.env.demonstration()
        for c in calls:
            obs, r, done = a.step(c)
            assert isinstance(obs, str) and r == 0.0 and not done
        assert a.check_answer(" " + answer + ".") == 1.0
        b.reset(5)
        assert b.check_answer(answer + "0") == 0.0
    with pytest.raises(K3ConfigError, match="unknown env 'nope'.*calculator"):
        make_env("nope")
    with pytest.raises(K3ConfigError, match="already registered"):
        register_env("calculator", object)


def test_kv_lookup_needs_chained_lookups():
    env = make_env("kv-lookup", num_lines=40, hops=3)
    env.reset(1)
    calls, answer = env.env.demonstration()
    assert len(calls) == 4 and all(c["name"] == "lookup" for c in calls)
    obs = [env.step(c)[0] for c in calls]
    assert obs[-1] == answer
    for c, o in zip(calls[1:], obs[:-1]):  # each value is the next key
        assert c["arguments"]["key"] == o
    doc = env.env.table
    assert len(doc) == 40 and calls[0]["arguments"]["key"] in env.reset(1)["messages"][-1]["content"]


def test_multi_tool_uses_different_tools():
    env = make_env("multi-tool")
    env.reset(3)
    calls, answer = env.env.demonstration()
    assert len({c["name"] for c in calls}) == 3
    outs = [env.step(c)[0] for c in calls]
    assert outs[-1] == answer == str(int(outs[0]) * int(outs[1]))


def test_protocol_errors_name_env_and_method():
    env = make_env("calculator")
    with pytest.raises(EnvProtocolError, match=r"env 'calculator' \(CalculatorEnv\)\.step: called before reset"):
        env.step({"name": "calculator", "arguments": {"expression": "1"}})
    env.reset(0)
    with pytest.raises(ToolCallError, match=r"env 'calculator'\.step: unknown tool 'search'"):
        env.step({"name": "search", "arguments": {}})
    with pytest.raises(ToolCallError, match="needs argument 'expression'"):
        env.step({"name": "calculator", "arguments": {}})
    with pytest.raises(ToolCallError, match="not valid JSON"):
        env.step({"function": {"name": "calculator", "arguments": "{bad"}})
    env.check_answer("0")
    with pytest.raises(EnvProtocolError, match=r"\.step: called after the episode ended"):
        env.step({"name": "calculator", "arguments": {"expression": "1"}})
    with pytest.raises(EnvProtocolError, match="check_answer: called after the episode ended"):
        env.check_answer("1")

    class Bad:
        name = "bad"
        def reset(self, seed):
            return "hello"
        def step(self, call):
            return "obs", 1.0
        def check_answer(self, a):
            return "yes"
    b = checked(Bad())
    with pytest.raises(EnvProtocolError, match=r"env 'bad' \(Bad\)\.reset: must return"):
        b.reset(0)
    Bad.reset = lambda self, seed: [{"role": "user", "content": "hi"}]
    assert b.reset(0)["messages"][0]["content"] == "hi"
    with pytest.raises(EnvProtocolError, match=r"env 'bad' \(Bad\)\.step: must return \(observation"):
        b.step({"name": "x", "arguments": {}})
    Bad.step = lambda self, call: (3, 1.0, False)
    with pytest.raises(EnvProtocolError, match="observation must be a str"):
        b.step({"name": "x", "arguments": {}})
    Bad.step = lambda self, call: ("o", float("nan"), False)
    with pytest.raises(EnvProtocolError, match="reward must be a finite float"):
        b.step({"name": "x", "arguments": {}})
    with pytest.raises(EnvProtocolError, match="check_answer: must return a finite float"):
        b.check_answer("a")
    with pytest.raises(EnvProtocolError, match="missing method step"):
        checked(type("NoStep", (), {"reset": lambda s, x: [], "check_answer": lambda s, a: 0.0})())


def test_normalize_tool_call_forms():
    a = normalize_tool_call({"id": "c1", "type": "function",
                             "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}})
    b = normalize_tool_call({"name": "calculator", "arguments": {"expression": "1+1"}})
    assert a == b == {"name": "calculator", "arguments": {"expression": "1+1"}}
    with pytest.raises(ToolCallError, match="must be a JSON object"):
        normalize_tool_call({"name": "x", "arguments": "[1]"})


def test_calculator_given_call_curriculum():
    """given_call=True: the prompt holds the correct call and its result, the expert only answers, and the expert
    conversation is the same as the full task's (an SFT model of one serves the other)."""
    from k3.rl.sft_data import expert_conversation
    full, easy = make_env("calculator", terms=2, digits=1), make_env("calculator", terms=2, digits=1, given_call=True)
    p = easy.reset(7)
    assert [m["role"] for m in p["messages"]] == ["system", "user", "assistant", "tool"]
    calls, answer = easy.demonstration()
    assert calls == [] and p["messages"][-1]["content"] == answer and easy.check_answer(answer) == 1.0
    assert expert_conversation(make_env("calculator", terms=2, digits=1, given_call=True), 7) == \
        expert_conversation(full, 7)
    with pytest.raises(K3ConfigError, match="given_call"):
        make_env("calculator", given_call="yes")
