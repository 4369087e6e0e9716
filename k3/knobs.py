"""Every environment variable k3 reads, in one table, and the one place that reads them.

Each knob has a name, the values it takes, a default and what it trades (`docs/knobs.md` is generated from this
table by `table_markdown()`; a test keeps the two equal). Reading a knob:

    from k3 import knobs
    knobs.get("K3_SITU_TANH")           # -> "auto" | "approx" | "exact", parsed and validated

Precedence, highest first:

1. an explicit argument of the call that takes one (`backend=`, `build_optimizer(fused=)`, `cache_dir(override)`,
   `StaticDecoder(mla_kernel=)`, ...): it is about that call only;
2. the environment variable, when set to a non-empty string: the environment only overrides;
3. the Python setting, `knobs.set(K3_BACKEND="kda:torch")` or, for a block, `with knobs.override(...):`;
4. the default of the table.

So a program (or a test) chooses in Python, and an operator can still override any choice from the shell. An
environment value replaces the Python value as a whole (for K3_BACKEND: the whole spec, not per op family).
Values are read at call time (a changed variable or setting applies to the next call), except where the table says
"read at import"; code that torch.compile traces reads a knob once, while tracing (as it read os.environ before), so
set knobs before compiling. A bad value raises `K3ConfigError` (a ValueError) naming the variable, where it came from
and the allowed values. Python settings are process-wide (not per thread).

Kinds: "user" knobs trade speed, memory or accuracy for users; "debug" knobs print, check, or select the
reference path a fast one is checked against; "external" variables belong to another tool and
are only read here (they cannot be set from Python).

Only this module reads `os.environ` (tests/test_knobs.py checks it). It imports nothing from k3 but the errors,
so any layer (ops, nn, train, generation, serve) can use it.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from k3.errors import K3ConfigError

__all__ = ["Knob", "KNOBS", "get", "set", "reset", "override", "source", "python_value", "table_markdown"]


@dataclass(frozen=True)
class Knob:
    name: str
    values: str                 # the allowed values, as the table shows them
    default: Any                # when neither the environment nor Python sets it (None: decided by the reader)
    default_text: str           # the default, as the table shows it
    doc: str                    # what it does and what it trades
    parse: Callable[[str], Any]  # environment string (stripped, non-empty) -> value; raises ValueError(allowed)
    check: Callable[[Any], Any]  # Python value -> value; raises ValueError(allowed)
    readers: tuple              # the modules that read it
    python: str                 # how to choose the same from Python besides knobs.set (call arguments, attributes)
    kind: str = "user"          # user | debug | external
    settable: bool = True       # False: only the environment (a variable of another tool)
    strip: bool = True          # the environment value is stripped of surrounding whitespace (not for free text)


# ----------------------------------------------------------------------------------------------- value parsers

def _allowed_text(names) -> str:
    names = list(names)
    return " or ".join(names) if len(names) <= 2 else "one of " + ", ".join(names)


def _str_check(parse, allowed: str):
    """The Python-side check of a string knob: `parse` of the stripped string; anything else is refused."""
    def check(v):
        if not isinstance(v, str):
            raise ValueError(allowed)
        return parse(v.strip())
    return check


def _choice(*names: str, lower: bool = True):
    allowed = _allowed_text(names)

    def parse(raw: str) -> str:
        v = raw.lower() if lower else raw
        if v not in names:
            raise ValueError(allowed)
        return v
    return parse, _str_check(parse, allowed)


def _flag():
    """0 / 1 in the environment; a bool (or 0 / 1) from Python."""
    def parse(raw: str) -> bool:
        if raw not in ("0", "1"):
            raise ValueError("0 or 1")
        return raw == "1"

    def check(v):
        if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
            return bool(v)
        if isinstance(v, str):
            return parse(v.strip())
        raise ValueError("0 or 1")
    return parse, check


def _on_unless_zero():
    """Any value but 0 is on (Triton's own rule for TRITON_INTERPRET)."""
    return (lambda raw: raw != "0"), (lambda v: bool(v))


def _text():
    def check(v):
        if not isinstance(v, str):
            raise ValueError("a string")
        return v
    return (lambda raw: raw), check


def _int_at_least(lo: int):
    """A decimal integer >= lo (torchrun's RANK / WORLD_SIZE / LOCAL_RANK)."""
    allowed = f"an integer >= {lo}"

    def parse(raw: str) -> int:
        try:
            v = int(raw)
        except ValueError:
            raise ValueError(allowed) from None
        if v < lo:
            raise ValueError(allowed)
        return v

    def check(v):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(allowed)
        return v
    return parse, check


def _backend_spec():
    allowed = "a backend name, or op:name pairs separated by commas (e.g. kda:torch,moe:padded_bmm)"

    def parse(raw: str) -> str:
        for part in raw.split(","):
            if ":" in part:
                op, name = part.split(":", 1)
                if not op.strip() or not name.strip() or ":" in name:
                    raise ValueError(allowed)
        return raw
    return parse, _str_check(parse, allowed)


def _json_object(what: str, nested: bool = False):
    allowed = f"a JSON object of {what}"

    def check(v):
        if not isinstance(v, dict) or (nested and not all(isinstance(x, dict) for x in v.values())):
            raise ValueError(allowed)
        return v

    def parse(raw: str) -> dict:
        try:
            v = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{allowed} (not JSON: {e})") from None
        return check(v)
    return parse, lambda v: check(json.loads(v)) if isinstance(v, str) else check(v)


# ----------------------------------------------------------------------------------------------------- the table

def _knob(name, values, default, default_text, doc, parser, readers, python, kind="user", settable=True,
          strip=True) -> Knob:
    parse, check = parser
    return Knob(name, values, default, default_text, doc, parse, check, tuple(readers), python, kind, settable, strip)


KNOBS: dict[str, Knob] = {k.name: k for k in (
    # -- backends and kernels
    _knob("K3_BACKEND", "`name` (all op families that know it) or `op:name,...` (op families: kda, "
          "attention, attnres, moe, moe_combine, moe_packed, conv, router; `auto` = automatic)", None,
          "automatic per op family and device",
          "Which implementation each op family runs (k3/ops/dispatch.py): speed and memory against the pure-PyTorch "
          "reference; an unknown or unavailable name fails with the known ones.",
          _backend_spec(), ["k3/ops/dispatch.py"], "the `backend=` argument of each op"),
    _knob("K3_FUSED_CE", "`0`, `1`", True, "`1`",
          "Training loss with the gradient of the logits formed in the forward pass (`1`) or checkpointed chunks "
          "that recompute each chunk's logits in backward (`0`): `1` saves one lm_head matmul per chunk.",
          _flag(), ["k3/model.py"], "`K3ForCausalLM.fused_ce` (read when the model is built)"),
    _knob("K3_MUON_FUSED", "`0`, `1`", None, "on when the parameters are on CUDA and Triton runs",
          "Muon's momentum and update as Triton kernels (`1`) or torch foreach ops (`0`): speed of the optimizer "
          "step; `1` needs Triton with CUDA (or TRITON_INTERPRET=1).",
          _flag(), ["k3/train/optim.py"], "`build_optimizer(fused=)`"),
    _knob("K3_SITU_TANH", "`auto`, `approx`, `exact`", "auto", "`auto`",
          "SiTU-GLU Triton kernels on 16-bit CUDA inputs: the hardware tanh.approx (max relative error 2^-11, "
          "outputs within 0.51 bf16 ulp of fp64 on the model's activations; faster) or the exp-based exact tanh. "
          "`auto`: approx for training launches, exact for inference. fp32 and the interpreter are always exact.",
          _choice("auto", "approx", "exact"), ["k3/ops/activations_triton.py"],
          "`k3.ops.activations_triton.APPROX_TANH` (a pin for tests and benchmarks)"),
    _knob("K3_MLA_DECODE", "`torch`, `triton`", None, "`triton` on CUDA, else `torch`",
          "Kernel of the static (CUDA-graph) decoder's MLA step: the Triton decode kernel or the torch path.",
          _choice("torch", "triton", lower=False), ["k3/generation/static.py"], "`StaticDecoder(mla_kernel=)`"),
    _knob("K3_KDA_TRITON_BWD", "`triton`, `torch`", None, "`triton`",
          "Backward of the Triton KDA backend: its Triton kernels, or a recompute through the torch path and "
          "autograd (slower, more memory): the reference to check the kernels against, and a fallback.",
          _choice("triton", "torch"), ["k3/ops/kda/triton/chunk.py"], "`TritonKDAConfig(bwd=)` / `triton_config(bwd=)`",
          kind="debug"),
    _knob("K3_KDA_STATE_CFG", "JSON object of `state_cfg` keys", None, "none (the measured defaults)",
          "Launch configuration of the Triton KDA forward's sequential pass for every call (a call's own "
          "`state_cfg` wins): tuning for GPUs other than the H200 the defaults were measured on.",
          _json_object("state_cfg keys"), ["k3/ops/kda/triton/fwd.py"], "`TritonKDAConfig(state_cfg=)`"),
    _knob("K3_KDA_BWD_LAUNCH", "JSON `{kernel: {param: value}}`", None, "none (the measured defaults)",
          "Launch overrides of the Triton KDA backward kernels (under a call's own `launch`): tuning for GPUs other "
          "than the H200 the defaults were measured on, and memory (`{\"scratch\": {\"FWD\": false}}`).",
          _json_object("{kernel: {param: value}}", nested=True), ["k3/ops/kda/triton/bwd_config.py"],
          "`TritonKDAConfig(bwd_launch=)`"),
    _knob("K3_SITU_TRITON", "`0`, `1`", True, "`1`",
          "SiTU-GLU on CUDA through its Triton kernels (`1`) or the eager torch formula (`0`, slower: the reference "
          "to check the kernels against).",
          _flag(), ["k3/ops/activations.py"], "none besides knobs.set", kind="debug"),
    _knob("K3_SITU_NODE", "`0`, `1`", False, "`0` (CUDA always uses the node)",
          "SiTU-GLU on CPU as the memory-saving autograd node that recomputes in backward (`1`) or the plain "
          "formula under autograd (`0`, 1.6x faster on CPU, more memory).",
          _flag(), ["k3/ops/activations.py"], "none besides knobs.set"),
    # -- paths and serving
    _knob("K3_CACHE", "a directory", None, "`~/.cache/k3`",
          "Where tokenized corpora and other derived data are cached.",
          _text(), ["k3/train/data.py"], "`cache_dir(override)`", strip=False),
    _knob("K3_API_KEY", "a string", None, "none (no key)",
          "Bearer key `k3 serve` requires from clients (`--api-key` wins).",
          _text(), ["k3/serve/cli.py"], "`ServeConfig(api_key=)`, `--api-key`", strip=False),
    # -- debugging and other tools' variables
    _knob("TRITON_INTERPRET", "`0`, `1` (any value but 0 is on)", False, "`0`",
          "Triton's own variable: kernels run on CPU through its interpreter (the CPU tests). It must be set "
          "before triton is imported, so it cannot be set from Python here.",
          _on_unless_zero(), ["k3/ops/dispatch.py"],
          "none", kind="external", settable=False),
    # -- torchrun's variables (torch.distributed.run sets them in every process it starts)
    _knob("RANK", "an integer >= 0", None, "unset (not under torchrun)",
          "torchrun's global rank of this process. With WORLD_SIZE set, `k3 train` runs distributed "
          "(docs/parallelism.md); the process group itself is initialised from torchrun's environment.",
          _int_at_least(0), ["k3/parallel/training.py"], "none", kind="external", settable=False),
    _knob("WORLD_SIZE", "an integer >= 1", None, "unset (one process)",
          "torchrun's number of processes; `k3 train` checks --dp-replicate x --dp-shard x --cp against it before "
          "any work.", _int_at_least(1), ["k3/parallel/training.py"], "none", kind="external", settable=False),
    _knob("TORCHELASTIC_ERROR_FILE", "a file path", None, "unset (not under torchrun)",
          "torchrun's file for a failed rank's error: `k3` writes the error that ends a command there, so torchrun's "
          "failure summary shows it.", _text(), ["k3/parallel/launch.py"], "none", kind="external", settable=False,
          strip=False),
    _knob("LOCAL_RANK", "an integer >= 0", None, "unset (0)",
          "torchrun's rank of this process on its node: the CUDA device `k3 train` uses under torchrun.",
          _int_at_least(0), ["k3/parallel/training.py"], "none", kind="external", settable=False),
)}

_PY: dict[str, Any] = {}   # the Python settings (knobs.set / override)


def _knob_of(name: str) -> Knob:
    try:
        return KNOBS[name]
    except KeyError:
        raise K3ConfigError(f"unknown knob {name!r}; known: {', '.join(sorted(KNOBS))}") from None


def _env(k: Knob) -> Optional[str]:
    raw = os.environ.get(k.name)
    if raw is not None and k.strip:
        raw = raw.strip()
    return raw or None   # an empty variable counts as unset


def get(name: str) -> Any:
    """The value of knob `name`: the environment if set, else the Python setting, else the default."""
    k = _knob_of(name)
    raw = _env(k)
    if raw is not None:
        try:
            return k.parse(raw)
        except ValueError as e:
            raise K3ConfigError(f"{name} must be {e}, got {raw!r} (from the environment)") from None
    if name in _PY:
        return _PY[name]
    return k.default


def source(name: str) -> str:
    """Where get(name) comes from: "environment", "python" or "default"."""
    return "environment" if _env(_knob_of(name)) is not None else "python" if name in _PY else "default"


def python_value(name: str) -> Any:
    """The Python setting of `name` (None: not set), whatever the environment says."""
    _knob_of(name)
    return _PY.get(name)


def _checked(name: str, value: Any) -> Any:
    k = _knob_of(name)
    if not k.settable:
        raise K3ConfigError(f"{name} is read from the environment only (an {k.kind} variable); set it there")
    try:
        return k.check(value)
    except ValueError as e:
        raise K3ConfigError(f"{name} must be {e}, got {value!r} (from knobs.set)") from None


def set(**values: Any) -> None:  # noqa: A001 - knobs.set reads as what it does
    """Set knobs from Python (validated); None removes a setting. The environment still overrides."""
    checked = {n: (None if v is None else _checked(n, v)) for n, v in values.items()}
    for n, v in checked.items():
        if v is None:
            _PY.pop(n, None)
        else:
            _PY[n] = v


def reset(*names: str) -> None:
    """Remove the Python settings of `names` (all when none given)."""
    for n in names:
        _knob_of(n)
    for n in (names or list(_PY)):
        _PY.pop(n, None)


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """`with knobs.override(K3_BACKEND="kda:torch"):` sets knobs from Python for the block, then restores them."""
    old = {n: _PY.get(n) for n in values}
    set(**values)
    try:
        yield
    finally:
        for n, v in old.items():
            if v is None:
                _PY.pop(n, None)
            else:
                _PY[n] = v


def child_env(**extra: str) -> dict:
    """A copy of this process's environment for a child process, with `extra` set (e.g. TRITON_INTERPRET, which
    must be set before the child imports triton, or CUDA_VISIBLE_DEVICES). Python-side knob settings do not cross
    into the child: set them as environment variables in `extra`."""
    env = dict(os.environ)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def table_markdown() -> str:
    """docs/knobs.md: the table above as a Markdown page."""
    esc = lambda s: str(s).replace("|", "\\|")
    lines = [
        "# Knobs",
        "",
        "Every environment variable k3 reads. Generated from `k3/knobs.py` by `k3.knobs.table_markdown()` "
        "(tests/test_knobs.py checks that this page matches it); edit the table there, not here.",
        "",
        "Precedence, highest first: an explicit argument of the call (`backend=`, `fused=`, ...) > the "
        "environment variable (non-empty) > the Python setting (`k3.knobs.set(NAME=value)` or "
        "`with k3.knobs.override(NAME=value):`) > the default. Values are read at call time unless the table says "
        "otherwise (code that torch.compile traces reads them once, while tracing: set them before compiling); a bad "
        "value raises `K3ConfigError` naming the variable and the allowed values.",
        "",
        "```python",
        "from k3 import knobs",
        'knobs.set(K3_BACKEND="kda:torch,moe:padded_bmm")   # the base choice; the environment still overrides',
        'with knobs.override(K3_FUSED_CE=False):             # for a block',
        "    ...",
        'knobs.get("K3_BACKEND"), knobs.source("K3_BACKEND")  # value, and "environment" | "python" | "default"',
        "```",
        "",
        "Kinds: **user** knobs trade speed, memory or accuracy; **debug** knobs check, print or select the reference "
        "path a fast one is checked against; **external** variables belong to another tool. Alternatives that exist "
        "only to be measured are flags of the benchmark scripts, not knobs.",
        "",
        "| name | kind | values | default | what it trades | also from Python | read in |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in KNOBS.values():
        lines.append(f"| `{k.name}` | {k.kind} | {esc(k.values)} | {esc(k.default_text)} | {esc(k.doc)} | "
                     f"{esc(k.python)} | {', '.join(f'`{r}`' for r in k.readers)} |")
    return "\n".join(lines) + "\n"
