"""Save / load K3 checkpoints in the released layout (architecture.md §4): ``config.json`` + sharded safetensors + index.

* :func:`save_pretrained` writes atomically: everything goes into a hidden temp directory next to the target,
  which then replaces the target by rename, so an interrupted save never leaves a half-written checkpoint at the
  target path (the previous checkpoint, if any, stays loadable).
* Files and directories get the modes of ordinary files under the process umask (0644 / 0755 by default), not
  the owner-only modes of the temp directory they were written in.
* :func:`load_state_dict` returns an in-memory state dict; :func:`from_pretrained` builds ``K3ForCausalLM`` on the
  meta device, materializes it empty on the requested device/dtype and streams the shards straight into its
  parameters (one tensor at a time), so peak memory is about one model plus one tensor.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Iterator, Mapping, Optional

import torch
import safetensors
import safetensors.torch as _st

from k3.errors import CheckpointError, K3ConfigError
from k3.checkpoint.adapter import (PREFIX, ReleasedEntry, default_quantization_config, is_fp32_key,
                                   released_plan, torch_dtype)
from k3.checkpoint.assemble import ReleasedAssembler

__all__ = ["save_pretrained", "load_state_dict", "from_pretrained", "load_config", "iter_checkpoint_tensors",
           "parse_size", "apply_umask_modes", "CONFIG_NAME", "INDEX_NAME", "SINGLE_NAME"]

log = logging.getLogger("k3.checkpoint")

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_SHARD_FMT = "model-{:05d}-of-{:05d}.safetensors"
_SHARD_RE = re.compile(r"^model-\d{5,}-of-\d{5,}\.safetensors$")


# ------------------------------------------------------------------------------------------------ helpers
def parse_size(size) -> int:
    """``"2GB"`` -> 2_000_000_000, ``"500MiB"`` -> 524_288_000, ints pass through (bytes)."""
    if isinstance(size, int):
        if size <= 0:
            raise CheckpointError(f"max_shard_size must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), flags=re.I)
    if not m:
        raise CheckpointError(f"cannot parse max_shard_size {size!r}; use e.g. '2GB', '500MB' or a byte count")
    num, unit = float(m.group(1)), (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    n = int(num * mult)
    if n <= 0:
        raise CheckpointError(f"max_shard_size must be positive, got {size!r}")
    return n


def _fsync_path(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)  # pragma: no cover - not Linux
    os.umask(old)
    return old


def apply_umask_modes(root: str) -> None:
    """Give a tree written through temp directories (mkdtemp: 0700) the modes of ordinary files and directories
    under the current umask (0644 / 0755 by default), like the rest of a run directory. Best effort: a file
    system that refuses chmod keeps its own modes."""
    mask = _umask()

    def chmod(path: str, mode: int) -> None:
        try:
            os.chmod(path, mode & ~mask)
        except OSError:  # pragma: no cover - e.g. file systems without POSIX modes
            pass
    chmod(root, 0o777)
    for d, dirs, files in os.walk(root):
        for n in dirs:
            chmod(os.path.join(d, n), 0o777)
        for n in files:
            p = os.path.join(d, n)
            if not os.path.islink(p):
                chmod(p, 0o666)


def _own_storage(t: torch.Tensor, seen: set) -> torch.Tensor:
    """safetensors refuses tensors that share storage: clone views / aliases."""
    ptr = t.untyped_storage().data_ptr()
    if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
        ptr = t.untyped_storage().data_ptr()
    seen.add(ptr)
    return t


def _write_extra(tmp: str, name: str, content) -> None:
    norm = os.path.normpath(name)
    if os.path.isabs(norm) or norm.startswith(".."):
        raise CheckpointError(f"extra_files name {name!r} must be a relative path inside the checkpoint directory")
    path = os.path.join(tmp, norm)
    os.makedirs(os.path.dirname(path) or tmp, exist_ok=True)
    if isinstance(content, os.PathLike):
        if not os.path.isfile(content):
            raise CheckpointError(f"extra_files[{name!r}]: source file {os.fspath(content)} does not exist")
        shutil.copyfile(content, path)
    elif isinstance(content, bytes):
        with open(path, "wb") as f:
            f.write(content)
    elif isinstance(content, str):
        with open(path, "w") as f:
            f.write(content)
    elif isinstance(content, (dict, list)):
        with open(path, "w") as f:
            json.dump(content, f, indent=2)
            f.write("\n")
    else:
        raise CheckpointError(f"extra_files[{name!r}]: unsupported content type {type(content).__name__} "
                              f"(use str, bytes, dict/list for JSON, or a pathlib.Path to copy)")


def _looks_like_checkpoint(path: str) -> bool:
    names = set(os.listdir(path))
    return not names or CONFIG_NAME in names or INDEX_NAME in names or SINGLE_NAME in names or \
        any(_SHARD_RE.match(n) for n in names)


# ------------------------------------------------------------------------------------------------ save
def save_pretrained(model, save_directory: str, max_shard_size="2GB", quantize_experts: bool = False,
                    tokenizer=None, extra_files: Optional[Mapping] = None, *, config=None, dtype=None,
                    extra_tensors: Optional[Mapping] = None, single_file_if_fits: bool = False,
                    config_dict: Optional[dict] = None, container: Optional[Mapping] = None) -> str:
    """Write ``model`` (a ``K3ForCausalLM``, an in-memory state dict together with ``config=``, or a prebuilt
    list of ``ReleasedEntry`` together with ``config=``) to
    ``save_directory`` in the released layout and return the directory path.

    Files: ``config.json`` (``quantization_config`` set to the MXFP4 one when ``quantize_experts``, removed
    otherwise), ``model-0000i-of-0000N.safetensors`` shards of at most ``max_shard_size`` each (a single tensor
    larger than that gets its own shard) and ``model.safetensors.index.json``. ``tokenizer.save(dir)`` (or
    ``save_pretrained``) is called into the same directory; ``extra_files`` maps relative names to str / bytes /
    JSON-able dict|list / ``pathlib.Path`` (copied). ``dtype`` optionally casts floating tensors (fp32-kept
    tensors stay fp32). ``single_file_if_fits``: one ``model.safetensors`` and no index when everything fits in
    one shard. ``extra_tensors`` (e.g. ``vision_tower.*``) are written under their own names, without the
    ``language_model.`` prefix (floating ones cast to ``dtype`` when given, never quantised). ``container``
    entries (e.g. ``vision_config``) are merged into the config's top-level multimodal wrapper, whose ``dtype``
    then follows ``dtype``; ``config_dict`` replaces the ``config.json`` content (export writes the container it
    builds).

    Atomic: written into ``.<name>.tmp-*`` next to the target, then renamed into place; an existing checkpoint
    at the target is renamed aside first and deleted once the new one is in place. An existing non-empty
    directory that does not look like a checkpoint is refused rather than deleted.
    """
    if config is None:
        config = getattr(model, "config", None)
        if config is None:
            raise CheckpointError("save_pretrained: the model has no `.config`; pass config=")
    prebuilt = None
    if isinstance(model, list):  # a released plan (list of ReleasedEntry), e.g. k3.export's streaming one
        prebuilt, state_dict = model, None
    elif isinstance(model, Mapping):
        state_dict = model
    elif hasattr(model, "state_dict"):
        state_dict = model.state_dict()
    else:
        raise CheckpointError(f"save_pretrained: expected a module or a state dict, got {type(model).__name__}")
    if state_dict is not None and getattr(config, "num_nextn_predict_layers", 0):
        from k3.nn.mtp import mtp_released_state_dict   # MTP blocks: mtp.{i}.* -> model.layers.{L+i}.*
        state_dict = mtp_released_state_dict(state_dict, config)
    limit = parse_size(max_shard_size)

    overrides = {"quantization_config": (config.quantization_config or default_quantization_config())
                 if quantize_experts else None}
    if dtype is not None:
        overrides["dtype"] = str(torch_dtype(dtype)).replace("torch.", "")
    save_cfg = config.replace(**overrides)
    if container is not None:
        save_cfg.container = dict(save_cfg.container or {}, **container)
        if dtype is not None:
            save_cfg.container["dtype"] = overrides["dtype"]

    target = os.path.abspath(os.fspath(save_directory))
    parent, name = os.path.split(target.rstrip(os.sep))
    if os.path.exists(target):
        if not os.path.isdir(target):
            raise CheckpointError(f"save_pretrained: {target} exists and is not a directory")
        if not _looks_like_checkpoint(target):
            raise CheckpointError(f"save_pretrained: {target} is a non-empty directory that is not a checkpoint "
                                  f"(no {CONFIG_NAME} / safetensors); refusing to replace it")
    os.makedirs(parent, exist_ok=True)

    plan = list(prebuilt) if prebuilt is not None else \
        released_plan(state_dict, save_cfg, quantize_experts=quantize_experts, prefix=PREFIX, dtype=dtype)
    extra_dtype = torch_dtype(dtype) if dtype is not None else None
    for k, t in (extra_tensors or {}).items():
        out_dtype = extra_dtype if (extra_dtype is not None and t.is_floating_point()) else t.dtype
        plan.append(ReleasedEntry(k, tuple(t.shape), out_dtype,
                                  lambda t=t, d=out_dtype: t.detach().to("cpu", d).contiguous()))
    shards: list = []
    cur, cur_size = [], 0
    for e in plan:
        if cur and cur_size + e.nbytes > limit:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(e)
        cur_size += e.nbytes
    if cur or not shards:
        shards.append(cur)

    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        if config_dict is not None:
            _write_extra(tmp, CONFIG_NAME, config_dict)
        else:
            save_cfg.save_json(os.path.join(tmp, CONFIG_NAME))
        weight_map, total = {}, 0
        n = len(shards)
        single = single_file_if_fits and n == 1
        for i, entries in enumerate(shards, 1):
            fname = SINGLE_NAME if single else _SHARD_FMT.format(i, n)
            tensors, seen = {}, set()
            for e in entries:
                t = e.make()
                if tuple(t.shape) != tuple(e.shape) or t.dtype != e.dtype:  # pragma: no cover - internal check
                    raise CheckpointError(f"{e.key}: produced {tuple(t.shape)} {t.dtype}, planned {e.shape} {e.dtype}")
                tensors[e.key] = _own_storage(t, seen)
                weight_map[e.key] = fname
                total += e.nbytes
            path = os.path.join(tmp, fname)
            _st.save_file(tensors, path, metadata={"format": "pt"})
            del tensors
            _fsync_path(path)
        if not single:
            with open(os.path.join(tmp, INDEX_NAME), "w") as f:
                json.dump({"metadata": {"total_size": total, "format": "k3-released"},
                           "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
                f.write("\n")
        if tokenizer is not None:
            if hasattr(tokenizer, "save") and callable(tokenizer.save):
                tokenizer.save(tmp)
            elif hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(tmp)
            else:
                raise CheckpointError(f"tokenizer of type {type(tokenizer).__name__} has no save(dir) method")
        for fname, content in (extra_files or {}).items():
            _write_extra(tmp, fname, content)
        for f in (CONFIG_NAME, INDEX_NAME, SINGLE_NAME):
            if os.path.exists(os.path.join(tmp, f)):
                _fsync_path(os.path.join(tmp, f))
        apply_umask_modes(tmp)  # mkdtemp made it 0700; the checkpoint gets ordinary modes (0755 / 0644 by umask)
        _fsync_path(tmp)
        _swap_into_place(tmp, target, parent, name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _swap_into_place(tmp: str, target: str, parent: str, name: str) -> None:
    if not os.path.exists(target):
        os.rename(tmp, target)
        _fsync_path(parent)
        return
    aside = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
    os.rmdir(aside)  # we only want a unique name
    os.rename(target, aside)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(aside, target)  # put the previous checkpoint back
        raise
    _fsync_path(parent)
    shutil.rmtree(aside, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ load
def load_config(directory: str):
    """``K3Config`` from ``directory/config.json`` (errors become CheckpointError naming the path)."""
    from k3.config import K3Config
    _check_dir(directory)
    path = os.path.join(directory, CONFIG_NAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {directory}: {CONFIG_NAME} is missing")
    try:
        return K3Config.from_json(path)
    except K3ConfigError as e:
        raise CheckpointError(f"checkpoint {directory}: invalid {CONFIG_NAME}: {e}") from e


def _check_dir(directory) -> None:
    if not os.path.exists(directory):
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint path {directory} is not a directory")


def _shard_layout(directory: str) -> dict:
    """``{file_path: [keys] or None (= all keys)}`` from the index, or the single ``model.safetensors``."""
    _check_dir(directory)
    idx = os.path.join(directory, INDEX_NAME)
    if os.path.isfile(idx):
        try:
            with open(idx) as f:
                index = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"checkpoint index {idx} is not valid JSON: {e}") from None
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"checkpoint index {idx} has no (or an empty) `weight_map` object")
        layout: dict = {}
        for key, fname in wm.items():
            if not isinstance(fname, str) or os.path.isabs(fname) or os.path.normpath(fname).startswith(".."):
                raise CheckpointError(f"checkpoint index {idx}: key {key!r} maps to an invalid file name {fname!r}")
            layout.setdefault(os.path.join(directory, fname), []).append(key)
        for path, keys in layout.items():
            if not os.path.isfile(path):
                raise CheckpointError(f"checkpoint index {idx} references shard {os.path.basename(path)} "
                                      f"({len(keys)} tensors, e.g. {keys[0]}), which does not exist in {directory}")
        return layout
    single = os.path.join(directory, SINGLE_NAME)
    if os.path.isfile(single):
        return {single: None}
    present = sorted(os.listdir(directory))
    shards = [n for n in present if n.endswith(".safetensors")]
    hint = f"; found shards {shards[:5]} but no {INDEX_NAME}" if shards else ""
    raise CheckpointError(f"checkpoint {directory}: neither {INDEX_NAME} nor {SINGLE_NAME} found{hint} "
                          f"(contents: {present[:20]})")


def _mtp_renamer(config):
    """Released key -> the key the assembler takes: MTP blocks' `model.layers.{L+i}.*` -> `mtp.{i}.*` (None for
    their copies of the shared lm_head / embedding, which k3 does not store); identity without MTP blocks."""
    if not getattr(config, "num_nextn_predict_layers", 0):
        return lambda k: k
    from k3.nn.mtp import released_key_to_model
    L = config.num_hidden_layers
    return lambda k: released_key_to_model(k, L, PREFIX)


def _key_filter(keys):
    """None -> None; a callable passes through; a collection -> membership test."""
    if keys is None or callable(keys):
        return keys
    wanted = frozenset(keys)
    return wanted.__contains__


def iter_checkpoint_tensors(directory: str, keys=None) -> Iterator[tuple]:
    """Yield ``(released_key, tensor, file_path)`` shard by shard, one tensor in memory at a time: shards are
    opened with ``safetensors.safe_open`` (memory-mapped) and only the tensors passing ``keys`` (a predicate on
    the *released* key, or a collection of released keys) are read at all; shards holding none are not opened."""
    want = _key_filter(keys)
    for path, keys in _shard_layout(directory).items():
        if want is not None and keys is not None:
            keys = [k for k in keys if want(k)]
            if not keys:
                continue
        try:
            with safetensors.safe_open(path, framework="pt", device="cpu") as f:
                present = set(f.keys())
                if keys is None:
                    keys = [k for k in f.keys() if want is None or want(k)]
                for k in keys:
                    if k not in present:
                        raise CheckpointError(f"checkpoint index maps {k} to {path}, but that file does not "
                                              f"contain it")
                    yield k, f.get_tensor(k), path
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises SafetensorError / OSError on corrupt or truncated files
            raise CheckpointError(f"cannot read safetensors file {path} (corrupt or truncated?): "
                                  f"{type(e).__name__}: {e}") from e


def load_state_dict(directory: str, config=None, dtype=None, strict: bool = False,
                    return_extras: bool = False, keys=None, experts=None):
    """In-memory state dict (docs/CONTRACTS.md names) from a checkpoint directory. ``config`` defaults to the
    directory's ``config.json``. See :func:`k3.checkpoint.assemble.from_released` for the mapping rules.

    Partial loads (a distributed rank's share): ``keys`` is a predicate on (or a collection of) *in-memory* names
    (per-expert tensors count under their stacked name ``...experts.gate_up_proj`` / ``down_proj``); only the
    matching tensors are read from the memory-mapped shards. ``experts=(start, stop)`` keeps routed experts
    ``start..stop-1`` (stacked tensors then have ``stop - start`` rows). ``strict`` checks the selected subset."""
    from k3.checkpoint.adapter import model_key_of, model_key_shapes
    if config is None:
        config = load_config(directory)
    want = _key_filter(keys)
    if experts is not None:
        e0, e1 = (int(x) for x in experts)
        if not (0 <= e0 < e1 <= config.num_experts):
            raise CheckpointError(f"experts={experts!r}: need 0 <= start < stop <= num_experts ({config.num_experts})")
        experts = (e0, e1)
    expected = None
    if strict:
        expected = {}
        for k, (shape, dt) in model_key_shapes(config).items():
            if want is not None and not want(k):
                continue
            if experts is not None and k.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                shape = (experts[1] - experts[0],) + tuple(shape[1:])
            expected[k] = (shape, dt)
        if config.num_nextn_predict_layers:
            from k3.nn.mtp import mtp_key_shapes
            expected.update({k: v for k, v in mtp_key_shapes(config).items() if want is None or want(k)})
    asm = ReleasedAssembler(config, targets=None, dtype=dtype, strict=strict, expected=expected, experts=experts)
    rename = _mtp_renamer(config)
    rfilter = None if want is None else (lambda rk: rename(rk) is not None and want(model_key_of(rename(rk))))
    for k, t, path in iter_checkpoint_tensors(directory, keys=rfilter):
        k = rename(k)
        if k is not None:
            asm.add(k, t, source=os.path.basename(path))
    sd = asm.finish(f"checkpoint {directory}")
    return (sd, dict(asm.ignored)) if return_extras else sd


def _materialize(model: torch.nn.Module, device, dtype: torch.dtype) -> None:
    """Replace meta parameters/buffers by empty tensors on ``device`` (fp32 for the fp32-kept names, ``dtype``
    for other floating ones), keeping tied parameters tied."""
    memo: dict = {}
    for mod_name, mod in model.named_modules():
        for kind in ("_parameters", "_buffers"):
            store = getattr(mod, kind)
            for n, p in list(store.items()):
                if p is None:
                    continue
                full = f"{mod_name}.{n}" if mod_name else n
                if id(p) in memo:
                    store[n] = memo[id(p)]
                    continue
                td = torch.float32 if is_fp32_key(full) else (dtype if p.is_floating_point() else p.dtype)
                new = torch.empty(p.shape, dtype=td, device=device)
                if kind == "_parameters":
                    new = torch.nn.Parameter(new, requires_grad=p.requires_grad)
                memo[id(p)] = new
                store[n] = new


def cast_to_storage_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Floating parameters and buffers to `dtype`, except the names the release keeps in fp32 (architecture.md §2: A_log,
    dt_bias, q/k/v_conv1d.weight, KDA o_norm.weight, e_score_correction_bias), in place. Returns the model."""
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.is_floating_point():
            td = torch.float32 if is_fp32_key(name) else dtype
            if p.dtype != td:
                p.data = p.data.to(td)
    return model


def _cast_model(model: torch.nn.Module, dtype: torch.dtype, device) -> None:
    model.to(device)
    cast_to_storage_dtype(model, dtype)


_INIT_FNS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_", "zeros_", "ones_", "constant_", "orthogonal_", "eye_")


@contextlib.contextmanager
def _skip_init():
    """Make ``torch.nn.init`` fills no-ops while building on the meta device (the values are overwritten by the
    checkpoint anyway; meta fills also drag in heavy torch._refs machinery)."""
    saved = {n: getattr(torch.nn.init, n) for n in _INIT_FNS if hasattr(torch.nn.init, n)}
    try:
        for n in saved:
            setattr(torch.nn.init, n, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def _build_on_meta(cls, config):
    kw = {"init": False} if "init" in inspect.signature(cls.__init__).parameters else {}
    with _skip_init(), torch.device("meta"):
        return cls(config, **kw)


def _has_non_persistent_buffers(model: torch.nn.Module) -> bool:
    return any(m._non_persistent_buffers_set for m in model.modules())


def _swap_packed_experts(model) -> None:
    from k3.nn.moe import LatentMoE, PackedMXFP4Experts
    for m in model.modules():
        if isinstance(m, LatentMoE):
            E, l, M2 = m.experts.gate_up_proj.shape
            dev = m.experts.gate_up_proj.device
            try:
                with torch.device(dev):
                    m.experts = PackedMXFP4Experts(E, l, M2 // 2)
            except ValueError as e:
                raise CheckpointError(f"packed_experts=True: {e}") from None


def from_pretrained(directory: str, device="cpu", dtype=None, strict: bool = True, config=None,
                    packed_experts: bool = False):
    """Build ``K3ForCausalLM`` from a checkpoint directory (released layout, dense or MXFP4 experts).

    ``dtype`` (default: ``config.dtype``) applies to floating parameters other than the fp32-kept ones. With
    ``strict=True`` the model is built on the meta device and filled in place (no random init, no second copy);
    any missing / unexpected / mis-shaped key raises CheckpointError listing them. With ``strict=False`` the model
    is built normally so missing tensors keep their initial values (a warning lists them). Returns the model in
    eval mode.

    ``packed_experts=True`` (inference): routed experts stay MXFP4-packed in memory (``PackedMXFP4Experts``,
    4.25 bits per weight, dequantised inside the expert matmul); an MXFP4 checkpoint's bytes are copied in without
    decoding, a dense one is encoded on load."""
    from k3.model import K3ForCausalLM  # lazy: the model module is heavy

    if config is None:
        config = load_config(directory)
    _shard_layout(directory)  # fail fast on a broken layout before building anything
    td = torch_dtype(dtype) if dtype is not None else torch_dtype(config.dtype)
    device = torch.device(device)

    model = None
    if strict:
        try:
            model = _build_on_meta(K3ForCausalLM, config)
        except Exception as e:  # a constructor that cannot run on meta: build for real instead
            log.debug("meta-device construction failed (%s); building on %s", e, device)
            model = None
        if model is not None and _has_non_persistent_buffers(model):
            log.debug("model has non-persistent buffers; building on %s instead of meta", device)
            model = None
        if model is not None:
            if packed_experts:
                _swap_packed_experts(model)
            _materialize(model, device, td)
    if model is None:
        with torch.device(device):
            model = K3ForCausalLM(config)
        _cast_model(model, td, device)
        if packed_experts:
            _swap_packed_experts(model)

    targets = model.state_dict(keep_vars=False)
    asm = ReleasedAssembler(config, targets=targets, strict=strict)
    a_log_sizes = set()
    rename = _mtp_renamer(config)
    skip_copies = (lambda rk: rename(rk) is not None) if config.num_nextn_predict_layers else None
    for k, t, path in iter_checkpoint_tensors(directory, keys=skip_copies):
        if k.endswith(".A_log") and t.dim() == 1:
            a_log_sizes.add(int(t.shape[0]))
        k = rename(k)
        if k is not None:
            asm.add(k, t, source=os.path.basename(path))
    asm.finish(f"checkpoint {directory}")
    if len(a_log_sizes) == 1:  # keep the file's A_log storage padding, so a re-save reproduces the layout
        config.a_log_storage_size = a_log_sizes.pop()
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        raise CheckpointError(f"checkpoint {directory}: some model tensors were left on the meta device")  # pragma: no cover
    model.eval()
    return model
