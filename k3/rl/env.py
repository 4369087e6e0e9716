"""RL environments: the protocol users implement, a safe calculator, and the built-in tool-use tasks.

Protocol (duck-typed; subclass `Env` or `ToolEnv` for the checks and helpers):

    env.name                    -> str, used in every error message
    env.reset(seed)             -> {"messages": [...], "tools": [...]} or a list of messages (tools then come from
                                   `env.tools`); K3 chat-format message dicts (k3/chat.py), OpenAI-style tool schemas
    env.step(tool_call)         -> (observation: str, reward: float, done: bool); tool_call is
                                   {"name": str, "arguments": dict} (normalised by `normalize_tool_call`)
    env.check_answer(text)      -> float: the reward of a final answer (an assistant turn without tool calls)

The episode ends at the final answer (its reward is `check_answer`) or when `step` returns done=True. Rewards are
exact match: 1.0 for the expected answer (whitespace and a trailing '.' stripped), else 0.0; tool steps give 0.
`checked(env)` wraps any object with this protocol and raises `EnvProtocolError` (naming the env and the method) on
bad return types or a step after done. A model's bad call (unknown tool, missing/ill-typed arguments) raises
`ToolCallError`; the rollout turns it into an error observation the model can read, it is not a crash.

Built in, by name (`make_env(name, **options)`; `register_env` adds yours): ``calculator`` (arithmetic through a
calculator tool), ``kv-lookup`` (chained lookups over a long document of key: value lines) and ``multi-tool``
(price x stock through three different tools). Every instance is deterministic from the reset seed.
"""
from __future__ import annotations

import ast
import json
import math
import operator
import random
from typing import Any, Callable, Dict, List, Optional, Tuple

from k3.errors import K3ConfigError, K3Error

__all__ = ["EnvError", "EnvProtocolError", "ToolCallError", "CalculatorError", "Env", "ToolEnv", "Tool",
           "checked", "CheckedEnv", "normalize_tool_call", "safe_eval", "format_number", "CalculatorEnv",
           "KVLookupEnv", "MultiToolEnv", "register_env", "make_env", "list_envs", "answers_match"]


class EnvError(K3Error):
    """Base class of environment errors."""


class EnvProtocolError(EnvError, TypeError):
    """An environment (or its driver) broke the protocol: bad return type, step after done, bad reset."""


class ToolCallError(EnvError, ValueError):
    """The model made a bad tool call (unknown tool, bad arguments). Rollouts show it to the model as the tool
    result instead of crashing."""


class CalculatorError(ToolCallError):
    """An expression the safe calculator refuses (names, calls, attributes, huge powers, division by zero...)."""


# ------------------------------------------------------------------------------------------------ safe calculator
_BINOPS: Dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNOPS: Dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPR_CHARS = 256
MAX_ABS = 10 ** 30
MAX_EXPONENT = 64


def safe_eval(expr: str) -> float:
    """Evaluate an arithmetic expression by walking its AST (never `eval`): numbers, + - * / // % **, unary +/-,
    parentheses. Anything else (names, calls, attributes, subscripts, strings ...) raises CalculatorError, as do
    division by zero, exponents above 64 and magnitudes above 1e30."""
    if not isinstance(expr, str):
        raise CalculatorError(f"calculator: expression must be a string, got {type(expr).__name__}")
    if len(expr) > MAX_EXPR_CHARS:
        raise CalculatorError(f"calculator: expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"calculator: not an arithmetic expression: {expr!r} ({e.msg})") from None

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise CalculatorError(f"calculator: only numbers are allowed, got {node.value!r}")
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and (abs(b) > MAX_EXPONENT or (abs(a) > 1 and abs(b) * math.log10(
                    abs(a)) > 30)):
                raise CalculatorError(f"calculator: power too large in {expr!r}")
            try:
                v = _BINOPS[type(node.op)](a, b)
            except ZeroDivisionError:
                raise CalculatorError(f"calculator: division by zero in {expr!r}") from None
            if isinstance(v, complex):
                raise CalculatorError(f"calculator: complex result in {expr!r}")
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            v = _UNOPS[type(node.op)](walk(node.operand))
        else:
            raise CalculatorError(f"calculator: {type(node).__name__} is not allowed (numbers and + - * / // % ** "
                                  f"only) in {expr!r}")
        if isinstance(v, float) and not math.isfinite(v) or abs(v) > MAX_ABS:
            raise CalculatorError(f"calculator: result out of range in {expr!r}")
        return v

    return walk(tree)


def format_number(v: float) -> str:
    """Canonical text of a number: integers without a decimal point, others to at most 6 decimals."""
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return str(int(v))
    return f"{v:.6f}".rstrip("0").rstrip(".")


def answers_match(answer: Any, expected: str) -> bool:
    """Exact match after stripping whitespace and one trailing period."""
    if not isinstance(answer, str):
        return False
    a = answer.strip()
    if a.endswith("."):
        a = a[:-1].rstrip()
    return a == expected.strip()


# ------------------------------------------------------------------------------------------------ protocol
def normalize_tool_call(call: Any, where: str = "tool call") -> Dict[str, Any]:
    """{"name", "arguments": dict} from a chat-format call ({"function": {"name", "arguments": JSON str}}) or an
    already normalised one. Raises ToolCallError on malformed calls (the model's mistake)."""
    if not isinstance(call, dict):
        raise ToolCallError(f"{where}: must be an object, got {type(call).__name__}")
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallError(f"{where}: needs a tool name")
    args = fn.get("arguments", {})
    if args is None or (isinstance(args, str) and not args.strip()):
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise ToolCallError(f"{where}: arguments of {name!r} are not valid JSON: {args[:80]!r}") from None
    if not isinstance(args, dict):
        raise ToolCallError(f"{where}: arguments of {name!r} must be a JSON object, got {type(args).__name__}")
    return {"name": name, "arguments": args}


class Env:
    """Base class: subclasses implement `reset`, `step` and `check_answer` (see the module docstring)."""

    name = "env"
    tools: List[Dict[str, Any]] = []

    def reset(self, seed: int):  # pragma: no cover - abstract
        raise NotImplementedError

    def step(self, tool_call: Dict[str, Any]) -> Tuple[str, float, bool]:  # pragma: no cover - abstract
        raise NotImplementedError

    def check_answer(self, answer: str) -> float:  # pragma: no cover - abstract
        raise NotImplementedError


def _env_name(env) -> str:
    return f"env {getattr(env, 'name', '?')!r} ({type(env).__name__})"


class CheckedEnv:
    """Wraps an env and enforces the protocol: reset before step, no step after done or after the final answer,
    and the return types. Errors are EnvProtocolError naming the env and the method."""

    def __init__(self, env):
        for m in ("reset", "step", "check_answer"):
            if not callable(getattr(env, m, None)):
                raise EnvProtocolError(f"{_env_name(env)}: missing method {m}()")
        self.env = env
        self.name = getattr(env, "name", type(env).__name__)
        self.done = True
        self._reset = False

    @property
    def tools(self):
        return getattr(self.env, "tools", [])

    def reset(self, seed: int) -> Dict[str, Any]:
        out = self.env.reset(seed)
        if isinstance(out, list):
            out = {"messages": out, "tools": list(getattr(self.env, "tools", []) or [])}
        if not isinstance(out, dict) or not isinstance(out.get("messages"), list):
            raise EnvProtocolError(f"{_env_name(self.env)}.reset: must return a list of messages or "
                                   f"{{'messages': [...], 'tools': [...]}}, got {type(out).__name__}")
        msgs, tools = out["messages"], out.get("tools") or []
        if not msgs:
            raise EnvProtocolError(f"{_env_name(self.env)}.reset: returned no messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
                raise EnvProtocolError(f"{_env_name(self.env)}.reset: messages[{i}] must be a message dict with "
                                       f"a role system/user/assistant/tool, got {m!r:.80}")
        if not isinstance(tools, list):
            raise EnvProtocolError(f"{_env_name(self.env)}.reset: tools must be a list, got {type(tools).__name__}")
        self.done, self._reset = False, True
        return {"messages": msgs, "tools": tools}

    def step(self, tool_call: Any) -> Tuple[str, float, bool]:
        if not self._reset:
            raise EnvProtocolError(f"{_env_name(self.env)}.step: called before reset()")
        if self.done:
            raise EnvProtocolError(f"{_env_name(self.env)}.step: called after the episode ended (done=True); "
                                   f"call reset() first")
        call = normalize_tool_call(tool_call, f"{_env_name(self.env)}.step")
        out = self.env.step(call)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise EnvProtocolError(f"{_env_name(self.env)}.step: must return (observation: str, reward: float, "
                                   f"done: bool), got {type(out).__name__} {out!r:.80}")
        obs, reward, done = out
        if not isinstance(obs, str):
            raise EnvProtocolError(f"{_env_name(self.env)}.step: observation must be a str, got "
                                   f"{type(obs).__name__}")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise EnvProtocolError(f"{_env_name(self.env)}.step: reward must be a finite float, got {reward!r}")
        if not isinstance(done, bool):
            raise EnvProtocolError(f"{_env_name(self.env)}.step: done must be a bool, got {type(done).__name__}")
        self.done = done
        return obs, float(reward), done

    def check_answer(self, answer: str) -> float:
        if not self._reset:
            raise EnvProtocolError(f"{_env_name(self.env)}.check_answer: called before reset()")
        if self.done:
            raise EnvProtocolError(f"{_env_name(self.env)}.check_answer: called after the episode ended")
        r = self.env.check_answer(answer)
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise EnvProtocolError(f"{_env_name(self.env)}.check_answer: must return a finite float, got {r!r}")
        self.done = True
        return float(r)

    def demonstration(self):
        return self.env.demonstration()


def checked(env) -> CheckedEnv:
    return env if isinstance(env, CheckedEnv) else CheckedEnv(env)


# ------------------------------------------------------------------------------------------------ tool envs
class Tool:
    """A named tool: JSON-schema parameters ({"arg": "string"|"number"}) and a function(**arguments) -> str."""

    def __init__(self, name: str, description: str, params: Dict[str, str], fn: Callable[..., str]):
        self.name, self.description, self.params, self.fn = name, description, dict(params), fn

    def schema(self) -> Dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in self.params.items()},
                           "required": list(self.params)}}}

    def __call__(self, env_name: str, args: Dict[str, Any]) -> str:
        for k, t in self.params.items():
            if k not in args:
                raise ToolCallError(f"env {env_name!r}.step: tool {self.name!r} needs argument {k!r}")
            v = args[k]
            ok = isinstance(v, str) if t == "string" else (isinstance(v, (int, float)) and not isinstance(v, bool))
            if not ok:
                raise ToolCallError(f"env {env_name!r}.step: tool {self.name!r} argument {k!r} must be a {t}, "
                                    f"got {type(v).__name__}")
        extra = sorted(set(args) - set(self.params))
        if extra:
            raise ToolCallError(f"env {env_name!r}.step: tool {self.name!r} got unknown arguments {extra}")
        return str(self.fn(**args))


class ToolEnv(Env):
    """An env whose steps dispatch to `Tool`s; subclasses implement `_make(rng) -> (messages, expected, demo)`
    where demo is the expert's list of tool calls (in order) used for the SFT set."""

    system_prompt = "You are a precise assistant. Use the tools, then reply with only the final answer."

    def __init__(self, max_tool_calls: int = 16):
        self.max_tool_calls = int(max_tool_calls)
        self._tools: Dict[str, Tool] = {}
        self.expected: Optional[str] = None
        self._demo: List[Dict[str, Any]] = []
        self.num_calls = 0

    def add_tool(self, tool: Tool) -> None:
        self._tools[tool.name] = tool

    @property
    def tools(self) -> List[Dict[str, Any]]:
        return [t.schema() for t in self._tools.values()]

    def _make(self, rng: random.Random):  # pragma: no cover - abstract
        raise NotImplementedError

    def reset(self, seed: int) -> Dict[str, Any]:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise EnvProtocolError(f"{_env_name(self)}.reset: seed must be an int, got {type(seed).__name__}")
        user, self.expected, self._demo = self._make(random.Random(f"{self.name}:{seed}"))
        self.num_calls = 0
        msgs = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]
        return {"messages": msgs, "tools": self.tools}

    def step(self, tool_call: Dict[str, Any]) -> Tuple[str, float, bool]:
        if self.expected is None:
            raise EnvProtocolError(f"{_env_name(self)}.step: called before reset()")
        call = normalize_tool_call(tool_call, f"env {self.name!r}.step")
        tool = self._tools.get(call["name"])
        if tool is None:
            raise ToolCallError(f"env {self.name!r}.step: unknown tool {call['name']!r} (tools: "
                                f"{', '.join(self._tools)})")
        self.num_calls += 1
        obs = tool(self.name, call["arguments"])
        return obs, 0.0, self.num_calls >= self.max_tool_calls

    def check_answer(self, answer: str) -> float:
        if self.expected is None:
            raise EnvProtocolError(f"{_env_name(self)}.check_answer: called before reset()")
        return 1.0 if answers_match(answer, self.expected) else 0.0

    def demonstration(self) -> Tuple[List[Dict[str, Any]], str]:
        """The expert solution of the current episode: (tool calls in order, final answer)."""
        if self.expected is None:
            raise EnvProtocolError(f"{_env_name(self)}.demonstration: called before reset()")
        return [dict(c) for c in self._demo], self.expected


def _calc_tool() -> Tool:
    return Tool("calculator", "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
                {"expression": "string"}, lambda expression: format_number(safe_eval(expression)))


class CalculatorEnv(ToolEnv):
    """Arithmetic: 'What is 37 * 12 - 85?' The expert calls calculator(expression) once and answers the result.
    terms: operands per expression (2..terms), digits: at most this many digits per operand."""

    name = "calculator"

    def __init__(self, terms: int = 3, digits: int = 2, given_call: bool = False, **kw):
        super().__init__(**kw)
        if terms < 2 or digits < 1:
            raise K3ConfigError(f"calculator env: terms >= 2 and digits >= 1, got terms={terms} digits={digits}")
        if not isinstance(given_call, bool):
            raise K3ConfigError(f"calculator env: given_call must be true or false, got {given_call!r}")
        self.terms, self.digits, self.given_call = int(terms), int(digits), given_call
        self.add_tool(_calc_tool())

    def reset(self, seed: int) -> Dict[str, Any]:
        """given_call=True (the first curriculum level): the prompt already holds the assistant's calculator call
        and the tool's result, so the policy only has to answer with the result (the expert makes no call)."""
        out = super().reset(seed)
        if self.given_call:
            call = self._demo[0]
            obs = self._tools["calculator"](self.name, call["arguments"])
            out["messages"] += [
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {
                        "name": "calculator", "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": obs}]
            self._demo = []
        return out

    def _make(self, rng):
        n = rng.randint(2, self.terms)
        hi = 10 ** self.digits - 1
        expr = str(rng.randint(1, hi))
        for _ in range(n - 1):
            expr += f" {rng.choice('+-*')} {rng.randint(1, hi)}"
        user = f"What is {expr}? Use the calculator tool, then reply with only the number."
        return user, format_number(safe_eval(expr)), [{"name": "calculator", "arguments": {"expression": expr}}]


_KEY_CHARS = "abcdefghjkmnpqrstuvwxyz23456789"


class KVLookupEnv(ToolEnv):
    """Chained lookup over a long document of 'key: value' lines: the value of the start key is another key, and
    so on for `hops` lookups; the answer is the final (numeric) value. The document is in the prompt (long
    context) and a lookup(key) tool reads it; the expert looks up each hop."""

    name = "kv-lookup"

    def __init__(self, num_lines: int = 64, hops: int = 3, **kw):
        super().__init__(**kw)
        if hops < 1 or num_lines < hops + 1:
            raise K3ConfigError(f"kv-lookup env: hops >= 1 and num_lines >= hops + 1, got num_lines={num_lines} "
                                f"hops={hops}")
        self.num_lines, self.hops = int(num_lines), int(hops)
        self.table: Dict[str, str] = {}
        self.add_tool(Tool("lookup", "Return the value of a key in the document.", {"key": "string"},
                           self._lookup))

    def _lookup(self, key: str) -> str:
        v = self.table.get(key.strip())
        return v if v is not None else f"no such key: {key}"

    def _make(self, rng):
        keys: List[str] = []
        seen = set()
        while len(keys) < self.num_lines:
            k = "".join(rng.choice(_KEY_CHARS) for _ in range(4))
            if k not in seen:
                seen.add(k)
                keys.append(k)
        chain = keys[:self.hops + 1]
        table = {}
        for a, b in zip(chain[:-1], chain[1:]):
            table[a] = b
        answer = str(rng.randint(1000, 9999))
        table[chain[-1]] = answer
        for k in keys[self.hops + 1:]:  # distractors: numbers or keys
            table[k] = rng.choice(keys) if rng.random() < 0.5 else str(rng.randint(1000, 9999))
        # the last chain value is a number; its key may appear anywhere
        order = list(table)
        rng.shuffle(order)
        self.table = table
        doc = "\n".join(f"{k}: {table[k]}" for k in order)
        user = (f"Document:\n{doc}\n\nStart at key {chain[0]}. Its value is another key; follow the chain "
                f"{self.hops} times and reply with only the final number.")
        demo = [{"name": "lookup", "arguments": {"key": k}} for k in chain]
        return user, answer, demo


class MultiToolEnv(ToolEnv):
    """'How much do all <item>s in stock cost?': get_price(item), get_stock(item) and calculator(expression) --
    three different tools; the answer is price * stock."""

    name = "multi-tool"
    ITEMS = ("apple", "pear", "plum", "fig", "kiwi", "lemon", "mango", "peach", "grape", "melon", "lime", "date")

    def __init__(self, num_items: int = 6, **kw):
        super().__init__(**kw)
        if not 1 <= num_items <= len(self.ITEMS):
            raise K3ConfigError(f"multi-tool env: num_items must be in [1, {len(self.ITEMS)}], got {num_items}")
        self.num_items = int(num_items)
        self.prices: Dict[str, int] = {}
        self.stock: Dict[str, int] = {}
        self.add_tool(Tool("get_price", "Unit price of an item.", {"item": "string"},
                           lambda item: self._get(self.prices, item)))
        self.add_tool(Tool("get_stock", "Units of an item in stock.", {"item": "string"},
                           lambda item: self._get(self.stock, item)))
        self.add_tool(_calc_tool())

    @staticmethod
    def _get(table, item: str) -> str:
        v = table.get(item.strip().lower())
        return str(v) if v is not None else f"unknown item: {item}"

    def _make(self, rng):
        items = rng.sample(self.ITEMS, self.num_items)
        self.prices = {it: rng.randint(2, 40) for it in items}
        self.stock = {it: rng.randint(1, 30) for it in items}
        it = rng.choice(items)
        p, s = self.prices[it], self.stock[it]
        user = f"How much do all the {it}s in stock cost together? Reply with only the number."
        demo = [{"name": "get_price", "arguments": {"item": it}}, {"name": "get_stock", "arguments": {"item": it}},
                {"name": "calculator", "arguments": {"expression": f"{p} * {s}"}}]
        return user, str(p * s), demo


# ------------------------------------------------------------------------------------------------ registry
_REGISTRY: Dict[str, Callable[..., Any]] = {}


def register_env(name: str, factory: Callable[..., Any], overwrite: bool = False) -> None:
    """Register an env factory (a class or a function returning an env) under `name` (for `k3 rl --env`)."""
    if not isinstance(name, str) or not name:
        raise K3ConfigError(f"register_env: name must be a non-empty string, got {name!r}")
    if name in _REGISTRY and not overwrite:
        raise K3ConfigError(f"register_env: {name!r} is already registered (pass overwrite=True)")
    _REGISTRY[name] = factory


def list_envs() -> List[str]:
    return sorted(_REGISTRY)


def make_env(name: str, **options) -> CheckedEnv:
    """A protocol-checked instance of the env registered as `name`."""
    if name not in _REGISTRY:
        raise K3ConfigError(f"unknown env {name!r} (registered: {', '.join(list_envs())})")
    try:
        env = _REGISTRY[name](**options)
    except TypeError as e:
        raise K3ConfigError(f"env {name!r}: bad options {sorted(options)}: {e}") from None
    return checked(env)


for _cls in (CalculatorEnv, KVLookupEnv, MultiToolEnv):
    register_env(_cls.name, _cls)
