"""`k3 sweep`: the sweepable keys (K3Config dotted paths and `train.<setting>`), their values and the grid."""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import math
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from k3.errors import K3ConfigError

# training settings a sweep owns (or that belong to one invocation): not sweepable, not accepted after `--`
_SWEEP_OWNED = {"out_dir": "--out", "resume": "--resume", "overwrite": "--overwrite", "seed": "--seeds"}


@dataclass(frozen=True)
class KeySpec:
    """Where a swept key goes and how its text becomes a value."""
    key: str                       # the canonical key: `linear_attn_config.gate_lower_bound`, `train.lr`
    target: str                    # "model" (a K3Config dotted path) or "train" (a TrainConfig field)
    field: str                     # the dotted model path or the TrainConfig field name
    cast: Callable[[str], Any]     # text -> value; raises ValueError(what was expected)


def _is_optional(tp) -> tuple[bool, Any]:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _caster(tp) -> Callable[[str], Any]:
    """The parser of one value's text for a dataclass field annotated `tp`."""
    optional, tp = _is_optional(tp)
    origin = typing.get_origin(tp) or tp

    def cast(text: str):
        t = text.strip()
        if optional and t.lower() in ("none", "null"):
            return None
        if origin is bool:
            low = t.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if origin is int:
            try:
                return int(t)
            except ValueError:
                raise ValueError("expected an integer") from None
        if origin is float:
            try:
                v = float(t)
            except ValueError:
                raise ValueError("expected a number") from None
            if not math.isfinite(v):
                raise ValueError("expected a finite number")
            return v
        if origin in (list, dict):
            try:
                v = json.loads(t)
            except ValueError:
                raise ValueError(f"expected a JSON {origin.__name__}, e.g. {'[4, 8]' if origin is list else '{}'}") from None
            if not isinstance(v, origin):
                raise ValueError(f"expected a JSON {origin.__name__}")
            return v
        if origin is str:
            return t
        raise ValueError(f"expected a value of a type the sweep cannot parse ({tp!r})")
    return cast


def _model_fields(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in ("extra", "container")}


def _train_parser() -> argparse.ArgumentParser:
    """A stand-alone parser holding `k3 train`'s flags (for the flags after `--` and the flag types)."""
    from k3.train import cli as train_cli
    p = argparse.ArgumentParser(prog="k3 sweep ... --")
    sub = p.add_subparsers(dest="cmd", required=True)
    train_cli.add_parser(sub)
    return sub.choices["train"]


def _train_key(name: str) -> KeySpec:
    from k3.train import cli as train_cli
    from k3.train.config import TrainConfig
    fields = _model_fields(TrainConfig)
    dest = name.replace("-", "_")
    fld = train_cli._FIELDS.get(dest, dest)
    if fld in _SWEEP_OWNED or dest in ("stop_at", "json"):
        raise K3ConfigError(f"--set train.{name}: not a sweepable training setting (the sweep sets it: "
                            f"{_SWEEP_OWNED.get(fld, '--' + dest.replace('_', '-'))})")
    if fld == "model_overrides":
        raise K3ConfigError(f"--set train.{name}: give model keys directly, e.g. --set hidden_size=64,128")
    if fld not in fields:
        known = sorted(set(train_cli._FIELDS) | set(fields) - set(_SWEEP_OWNED) - {"model_overrides"})
        raise K3ConfigError(f"--set train.{name}: unknown training setting; known: {', '.join(known)}")
    action = None
    if dest in train_cli._FIELDS or fld in train_cli._FIELDS.values():
        flag_dest = dest if dest in train_cli._FIELDS else next(d for d, f in train_cli._FIELDS.items() if f == fld)
        action = next((a for a in _train_parser()._actions if a.dest == flag_dest), None)
    base = _caster(fields[fld])
    if typing.get_origin(_is_optional(fields[fld])[1]) is list or _is_optional(fields[fld])[1] is list:
        json_list = base

        def base(text, _j=json_list):  # noqa: F811 - a list setting (--data): a JSON list or one plain item
            return _j(text) if text.strip()[:1] == "[" or text.strip().lower() in ("none", "null") else [text.strip()]
    if fld == "stages":
        def base(text):  # noqa: F811 - stages take the --stages syntax
            from k3.train.config import parse_stages
            return [list(s) for s in parse_stages(text)]
    elif action is not None and action.type is not None and dest not in train_cli._NEGATED:
        flag_type = action.type

        def base(text, _t=flag_type):  # noqa: F811 - the flag's own type (its range checks)
            try:
                return _t(text.strip())
            except (argparse.ArgumentTypeError, ValueError) as e:
                raise ValueError(str(e)) from None
    choices = action.choices if action is not None else None
    negated = dest in train_cli._NEGATED

    def cast(text):
        v = base(text)
        if choices is not None and v not in choices:
            raise ValueError(f"expected one of {', '.join(map(str, choices))}")
        return (not v) if negated else v
    return KeySpec(f"train.{fld}", "train", fld, cast)


def resolve_key(key: str) -> KeySpec:
    """`--set` key -> KeySpec; an unknown key raises K3ConfigError naming it and the known keys at that level."""
    from k3.config import K3Config
    key = key.strip()
    if not key:
        raise K3ConfigError("--set: empty key (expected KEY=V1,V2,...)")
    if key.startswith("train."):
        return _train_key(key[len("train."):])
    path = key[len("model."):] if key.startswith("model.") else key
    cls, parts = K3Config, path.split(".")
    for i, part in enumerate(parts):
        fields = _model_fields(cls)
        if part not in fields:
            where = ".".join(parts[:i]) or "K3Config"
            hint = " (training settings take the prefix `train.`, e.g. train.lr)" if i == 0 else ""
            raise K3ConfigError(f"--set {key}: unknown config key `{part}` in {where}{hint}; known: "
                                f"{', '.join(sorted(fields))}")
        tp = fields[part]
        if dataclasses.is_dataclass(tp):
            if i == len(parts) - 1:
                raise K3ConfigError(f"--set {key}: `{path}` is a group of keys; sweep one of them: "
                                    f"{', '.join(f'{path}.{k}' for k in sorted(_model_fields(tp)))}")
            cls = tp
            continue
        if i != len(parts) - 1:
            raise K3ConfigError(f"--set {key}: `{'.'.join(parts[:i + 1])}` is not a group of keys")
        if len(parts) > 2:  # pragma: no cover - K3Config nests one level
            raise K3ConfigError(f"--set {key}: only one level of nesting is supported")
        return KeySpec(path, "model", path, _caster(tp))
    raise K3ConfigError(f"--set {key}: unknown key")  # pragma: no cover


@dataclass
class Axis:
    key: str                 # canonical key
    spec: KeySpec
    values: list
    texts: list              # the values as given (labels, directory names)


def _split_values(text: str) -> list[str]:
    sep = ";" if ";" in text else ","
    if sep == "," and text.strip()[:1] in "[{" and text.strip():
        # a single JSON list/dict with commas: one value
        try:
            json.loads(text)
            return [text]
        except ValueError:
            pass
    return [v for v in (p.strip() for p in text.split(sep)) if v != ""]


def parse_set(text: str) -> Axis:
    """`KEY=V1,V2,...` -> Axis with typed values (K3ConfigError naming the key on a bad key or value)."""
    key, eq, vals = text.partition("=")
    if not eq:
        raise K3ConfigError(f"--set {text!r}: expected KEY=V1,V2,... (e.g. linear_attn_config.gate_lower_bound=-5,-4)")
    spec = resolve_key(key)
    texts = _split_values(vals)
    if not texts:
        raise K3ConfigError(f"--set {spec.key}: no value given")
    values = []
    for t in texts:
        try:
            values.append(spec.cast(t))
        except ValueError as e:
            raise K3ConfigError(f"--set {spec.key}: bad value {t!r}: {e}") from None
    if len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
        raise K3ConfigError(f"--set {spec.key}: a value is given twice ({', '.join(texts)})")
    return Axis(spec.key, spec, values, texts)


@dataclass
class Point:
    """One grid point: {key: value} over the axes, and its label / directory name."""
    values: dict
    texts: dict

    @property
    def id(self) -> str:
        return json.dumps(self.values, sort_keys=True)

    @property
    def label(self) -> str:
        return ", ".join(f"{k.split('.')[-1]}={t}" for k, t in self.texts.items()) or "base"

    @property
    def dirname(self) -> str:
        if not self.values:
            return "base"
        slug = "__".join(f"{k.split('.')[-1]}={t}" for k, t in self.texts.items())
        slug = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", slug)[:80]
        return f"{slug}-{hashlib.sha1(self.id.encode()).hexdigest()[:6]}"


def expand_grid(axes: Sequence[Axis]) -> list[Point]:
    """The cartesian product of the axes (the first axis varies slowest); a duplicate key is refused."""
    seen = set()
    for a in axes:
        if a.key in seen:
            raise K3ConfigError(f"--set {a.key}: the key is given twice (put all its values in one --set)")
        seen.add(a.key)
    pts = []
    for combo in itertools.product(*[list(zip(a.values, a.texts)) for a in axes]):
        pts.append(Point({a.key: v for a, (v, _) in zip(axes, combo)}, {a.key: t for a, (_, t) in zip(axes, combo)}))
    return pts


