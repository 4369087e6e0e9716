"""`k3 convert`: a DCP training checkpoint <-> the released safetensors layout, streaming (issue #30 §6).

    k3 convert RUN/checkpoints/step-1000 out/release            # DCP -> released (what `k3 export` writes)
    k3 convert out/release out/dcp --to dcp                     # released -> a model-only DCP checkpoint

DCP -> released (`dcp_to_release`): the DCP checkpoint's metadata gives every model tensor's name, global shape and
dtype (routed experts are stored with their global [E, ...] shape, k3.parallel.checkpoint), so the released plan is
made on `meta` tensors with the one name mapping of k3.checkpoint.adapter (`released_plan`: the `language_model.`
prefix, per-expert w1/w2/w3, A_log padding, fp32-kept tensors, optional MXFP4). Each released entry is produced
lazily: the first entry of a group (one decoder layer, or one top-level tensor) reads that group from the DCP
files (`torch.distributed.checkpoint.load` of those keys only, no process group) and drops the previous group;
`save_pretrained` writes shard by shard. Peak memory: one layer of the source plus one output shard
(`--max-shard-size`), never the model. The config comes from the run directory (`RUN/config.json`, two levels above
`checkpoints/step-N`) or `--config`; the tokenizer from the checkpoint (`tokenizer.json`, written by the trainer).

released -> DCP (`release_to_dcp`): the inverse, one tensor at a time. A `SavePlanner` plans the DCP checkpoint on
`meta` tensors (the in-memory names and shapes of `model_key_shapes`), and its `resolve_data` reads each tensor
only when DCP writes it (memory-mapped safetensors through `ReleasedAssembler`: per-expert tensors stacked, MXFP4
decoded, A_log unpadded). The result holds `model.<name>` entries in fp32 (like a training checkpoint) plus the
k3 `config.json`: `k3.parallel.checkpoint.load_checkpoint(path, model)` loads it on any mesh, and the distributed
trainer starts from it with `init_from`. It has no optimizer / scheduler / data state: it is a starting point,
not a run to `--resume`.

`STATS` records what was resident at once (instrumentation for the tests): the largest group of source tensors
read together and the peak bytes of converted tensors alive.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import weakref
from typing import Optional

import torch

from k3.errors import CheckpointError

__all__ = ["convert", "dcp_to_release", "release_to_dcp", "resolve_dcp_checkpoint", "STATS", "add_parser"]

log = logging.getLogger("k3.convert")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
MODEL_PREFIX = "model."          # the DCP key prefix of model tensors (k3.parallel.checkpoint saves {"model": ...})


class _Stats:
    """Residency counters of the last conversion (reset at its start)."""

    def reset(self) -> None:
        self.groups_loaded = 0           # DCP reads (one per group)
        self.max_group_bytes = 0         # the largest set of source tensors held at once
        self.live_bytes = 0              # converted tensors alive now
        self.peak_live_bytes = 0
        self.tensors_read = 0            # released -> DCP: tensors read from the safetensors files

    def track(self, t: torch.Tensor) -> torch.Tensor:
        """Count `t` as alive until it is garbage collected."""
        n = t.numel() * t.element_size()
        self.live_bytes += n
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        weakref.finalize(t, self._free, n)
        return t

    def _free(self, n: int) -> None:
        self.live_bytes -= n


STATS = _Stats()
STATS.reset()


def _group_of(fqn: str) -> str:
    m = _LAYER.match(fqn)
    return f"model.layers.{m.group(1)}" if m else fqn


# ------------------------------------------------------------------------------------------- DCP -> released

def resolve_dcp_checkpoint(path: str) -> str:
    """The DCP checkpoint directory `path` names: itself (it holds `.metadata`), or a run directory's latest."""
    from k3.parallel.checkpoint import latest_checkpoint
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    for d in (os.path.join(path, "checkpoints"), path):
        last = latest_checkpoint(d)
        if last is not None:
            return last
    raise CheckpointError(f"{path}: not a DCP checkpoint (no .metadata) and no checkpoints/step-N/ in it")


def _dcp_config(ckpt: str, config: Optional[str]):
    from k3.config import K3Config
    if config is not None:
        return K3Config.load(config)
    for p in (os.path.join(ckpt, "config.json"), os.path.join(ckpt, os.pardir, os.pardir, "config.json")):
        if os.path.isfile(p):
            return K3Config.from_json(os.path.normpath(p))
    raise CheckpointError(f"{ckpt}: no config.json in the checkpoint or its run directory; pass --config")


class _DCPGroups:
    """Model tensors of a DCP checkpoint, read one group (a decoder layer, or one top-level tensor) at a time."""

    def __init__(self, ckpt: str, meta: dict):
        self.ckpt, self.meta = ckpt, meta          # fqn -> (shape, dtype)
        self.name: Optional[str] = None
        self.tensors: dict = {}

    def get(self, fqn: str) -> torch.Tensor:
        g = _group_of(fqn)
        if g != self.name:
            self.tensors = {}                      # drop the previous group before reading the next
            self.name = g
            self.tensors = self._read(g)
        return self.tensors[fqn]

    def _read(self, group: str) -> dict:
        import warnings
        import torch.distributed.checkpoint as dcp
        want = {k: torch.empty(s, dtype=d) for k, (s, d) in self.meta.items() if _group_of(k) == group}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)      # "assuming the intent is to load in a single process"
            try:
                dcp.load({"model": want}, checkpoint_id=self.ckpt, no_dist=True)
            except Exception as e:
                raise CheckpointError(f"{self.ckpt}: cannot read {group}: {type(e).__name__}: {e}") from e
        STATS.groups_loaded += 1
        STATS.max_group_bytes = max(STATS.max_group_bytes, sum(t.numel() * t.element_size() for t in want.values()))
        return want


def _dcp_model_meta(ckpt: str) -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = FileSystemReader(ckpt).read_metadata()
    out = {}
    for k, v in md.state_dict_metadata.items():
        if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata):
            out[k[len(MODEL_PREFIX):]] = (tuple(v.size), v.properties.dtype)
    if not out:
        raise CheckpointError(f"{ckpt}: the DCP checkpoint holds no model tensors ('{MODEL_PREFIX}*' keys)")
    return out


def _lazy_release_plan(groups: _DCPGroups, cfg, quantize: bool, tdt) -> list:
    """The released entries of the whole model, each made from its group's real tensors on demand (the released
    names, shapes and order come from `released_plan` on meta tensors; the values from `released_plan` on the
    group once it is read)."""
    from k3.checkpoint.adapter import ReleasedEntry, model_key_of, released_plan
    from k3.checkpoint.adapter import model_key_shapes
    canon = {k: i for i, k in enumerate(model_key_shapes(cfg))}    # the model's order; groups kept contiguous
    first: dict = {}
    for k in sorted(groups.meta, key=lambda k: canon.get(k, len(canon))):
        first.setdefault(_group_of(k), len(first))
    order = sorted(groups.meta, key=lambda k: (first[_group_of(k)], canon.get(k, len(canon)), k))
    metas = {k: torch.empty(groups.meta[k][0], dtype=groups.meta[k][1], device="meta") for k in order}
    real: dict = {}                                  # group -> {released key: entry on real tensors}

    def make(rkey: str, fqn: str):
        g = _group_of(fqn)
        groups.get(fqn)
        if g not in real:
            real.clear()
            sd = {k: groups.tensors[k] for k in groups.tensors}
            real[g] = {e.key: e for e in released_plan(sd, cfg, quantize_experts=quantize, dtype=tdt)}
        return STATS.track(real[g].pop(rkey).make())

    out = []
    for e in released_plan(metas, cfg, quantize_experts=quantize, dtype=tdt):
        out.append(ReleasedEntry(e.key, e.shape, e.dtype, lambda k=e.key: make(k, model_key_of(k))))
    return out


def dcp_to_release(src: str, out: str, *, config: Optional[str] = None, dtype: str = "bfloat16",
                   quantize: Optional[str] = None, max_shard_size="5GB", tokenizer=None,
                   hf_shims: bool = True) -> str:
    """DCP checkpoint (or run directory) `src` -> the released layout in `out` (module doc). Returns `out`."""
    from k3.checkpoint.adapter import torch_dtype
    from k3.checkpoint.io import save_pretrained
    from k3.export import ReleaseTokenizerWriter, check_release_plan, release_config_dict
    from k3.tokenizer import check_tokenizer_matches, load_tokenizer
    if quantize not in (None, "mxfp4"):
        raise CheckpointError(f"--quantize: unknown format {quantize!r} (supported: mxfp4)")
    STATS.reset()
    ckpt = resolve_dcp_checkpoint(src)
    cfg = _dcp_config(ckpt, config)
    release_config_dict(cfg)                         # refuse a config the release cannot express, before reading
    tdt = torch_dtype(dtype)
    dtype_name = str(tdt).replace("torch.", "")
    tok_src = tokenizer or ckpt
    try:
        tok = load_tokenizer(tok_src)
    except Exception as e:
        raise CheckpointError(f"convert: no usable tokenizer in {tok_src} ({e}); pass --tokenizer PATH") from e
    check_tokenizer_matches(tok, cfg)
    meta = _dcp_model_meta(ckpt)
    files: dict = {"generation_config.json": {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
                                              "pad_token_id": cfg.pad_token_id}}
    tok_extra = {"tokenizer_class": "TikTokenTokenizer", "model_max_length": cfg.max_position_embeddings}
    auto_map = None
    if hf_shims:
        from k3.hf.shims import AUTO_MAP, TOKENIZER_AUTO_MAP, shim_files
        auto_map = dict(AUTO_MAP)
        tok_extra["auto_map"] = dict(TOKENIZER_AUTO_MAP)
        files.update(shim_files())
    cdict = release_config_dict(cfg, quantize=quantize, dtype=dtype_name,
                                media_placeholder_token_id=tok.special_tokens.get("<|media_pad|>"), auto_map=auto_map)
    save_cfg = cfg.replace(quantization_config=cdict["text_config"].get("quantization_config"), dtype=dtype_name)
    plan = _lazy_release_plan(_DCPGroups(ckpt, meta), save_cfg, quantize == "mxfp4", tdt)
    check_release_plan(plan, save_cfg, quantize == "mxfp4", ckpt)
    path = save_pretrained(plan, out, max_shard_size=max_shard_size, quantize_experts=(quantize == "mxfp4"),
                           tokenizer=ReleaseTokenizerWriter(tok, tok_extra), extra_files=files, config=save_cfg,
                           dtype=tdt, single_file_if_fits=True, config_dict=cdict)
    log.info("converted %s -> %s (released layout, %s)", ckpt, path, dtype_name)
    return path


# ------------------------------------------------------------------------------------------- released -> DCP

def _released_reader(src: str, cfg, dtype):
    """fqn -> tensor, read from the released files when asked (only that tensor's released keys; the files are
    opened once, memory-mapped)."""
    from k3.checkpoint.adapter import model_key_of
    from k3.checkpoint.assemble import ReleasedAssembler
    from k3.export import SourceShards
    shards = SourceShards(src)
    by_model: dict = {}
    for k in shards.meta:
        by_model.setdefault(model_key_of(k), []).append(k)

    def read(fqn: str) -> torch.Tensor:
        asm = ReleasedAssembler(cfg, targets=None, dtype=dtype, strict=False)
        for k in by_model.get(fqn, ()):
            STATS.tensors_read += 1
            asm.add(k, shards.get(k), source=os.path.basename(shards.where[k]))
        sd = asm.finish(f"checkpoint {src}")
        if fqn not in sd:
            raise CheckpointError(f"{src}: no released tensor for {fqn}")
        return sd[fqn]
    return read


def _lazy_planner(read):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class _LazySavePlanner(DefaultSavePlanner):
        """Plans on meta tensors; each tensor is read from the released files when DCP writes it."""

        def resolve_data(self, write_item):
            fqn = write_item.index.fqn
            if not fqn.startswith(MODEL_PREFIX):
                return super().resolve_data(write_item)
            want = write_item.tensor_data.properties.dtype           # fp32-kept tensors stay fp32
            return STATS.track(read(fqn[len(MODEL_PREFIX):]).to(want).contiguous())
    return _LazySavePlanner()


def release_to_dcp(src: str, out: str, *, dtype: str = "float32") -> str:
    """Released safetensors `src` -> a model-only DCP checkpoint in `out` (module doc), written atomically
    (`out.tmp`, then renamed). Returns `out`."""
    import warnings
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from k3.checkpoint.adapter import model_key_shapes, torch_dtype
    from k3.checkpoint.io import _shard_layout, load_config
    STATS.reset()
    cfg = load_config(src)
    _shard_layout(src)                                # a broken layout fails before anything is written
    tdt = torch_dtype(dtype)
    shapes = model_key_shapes(cfg.replace(dtype=str(tdt).replace("torch.", "")))
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    meta = {k: torch.empty(s, dtype=torch.float32 if d == torch.float32 else tdt, device="meta")
            for k, (s, d) in shapes.items()}
    out = os.path.abspath(out)
    tmp = out.rstrip(os.sep) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    read = _released_reader(src, cfg, tdt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)          # "assuming the intent is to save in a single process"
        dcp.save({"model": meta}, storage_writer=FileSystemWriter(tmp, thread_count=1),
                 planner=_lazy_planner(read), no_dist=True)
    cfg.replace(quantization_config=None).save_json(os.path.join(tmp, "config.json"))
    with open(os.path.join(tmp, "converted_from.json"), "w") as f:
        json.dump({"source": os.path.abspath(src), "format": "k3-dcp-model-only", "dtype": str(tdt)}, f)
    for name in ("tokenizer.json", "tiktoken.model", "tokenizer_config.json"):
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(tmp, name))
    if os.path.exists(out):
        if not os.path.isfile(os.path.join(out, ".metadata")) and os.listdir(out):
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"{out} exists and is not a DCP checkpoint; refusing to replace it")
        shutil.rmtree(out)
    os.rename(tmp, out)
    log.info("converted %s -> %s (DCP, model only, %s)", src, out, tdt)
    return out


# ------------------------------------------------------------------------------------------- both / CLI

def _is_released(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")) and any(
        n.endswith(".safetensors") for n in os.listdir(path))


def convert(src: str, out: str, to: Optional[str] = None, **kw) -> str:
    """`to`: "release" or "dcp"; None picks the other format than `src`'s."""
    if not os.path.isdir(src):
        raise CheckpointError(f"convert: {src} is not a directory")
    if to is None:
        to = "dcp" if _is_released(src) else "release"
    if to == "release":
        return dcp_to_release(src, out, **kw)
    if to == "dcp":
        if not _is_released(src):
            raise CheckpointError(f"convert --to dcp: {src} is not a released checkpoint (config.json + "
                                  f"*.safetensors)")
        return release_to_dcp(src, out, **{k: v for k, v in kw.items() if k == "dtype" and v is not None})
    raise CheckpointError(f"convert: --to must be 'release' or 'dcp', got {to!r}")


def _cmd_convert(a) -> int:
    kw = {}
    if a.to != "dcp" and not (a.to is None and _is_released(a.src)):
        kw = dict(config=a.config, dtype=a.dtype or "bfloat16", quantize=a.quantize, max_shard_size=a.max_shard_size,
                  tokenizer=a.tokenizer, hf_shims=not a.no_hf_shims)
    else:
        extra = [f for f, v in (("--quantize", a.quantize), ("--config", a.config), ("--tokenizer", a.tokenizer),
                                ("--no-hf-shims", a.no_hf_shims)) if v]
        if extra:
            raise CheckpointError(f"{', '.join(extra)}: only for DCP -> released; released -> DCP takes --dtype")
        kw = dict(dtype=a.dtype) if a.dtype else {}
    path = convert(a.src, a.out, to=a.to, **kw)
    print(f"converted {a.src} -> {path}")
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("convert", help="a DCP training checkpoint <-> the released safetensors layout (streaming)",
                       description="DCP checkpoint (RUN/checkpoints/step-N, or RUN: its latest) -> the released "
                                   "layout that `k3 export` writes; or released safetensors -> a model-only DCP "
                                   "checkpoint any mesh loads. Layer by layer, never the whole model in memory.")
    s.add_argument("src", help="DCP checkpoint / run directory, or a released checkpoint directory")
    s.add_argument("out", help="output directory (written atomically)")
    s.add_argument("--to", choices=("release", "dcp"), default=None, help="target format [the other one]")
    s.add_argument("--config", default=None, help="model config (DCP -> release) [RUN/config.json]")
    s.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                   help="tensor dtype of the output [release: bfloat16; dcp: float32] (fp32-kept ones stay fp32)")
    s.add_argument("--quantize", choices=("mxfp4",), default=None, help="routed experts as MXFP4 (release)")
    s.add_argument("--max-shard-size", default="5GB", help="released shard size [5GB]")
    s.add_argument("--tokenizer", default=None, help="tokenizer file/dir [the checkpoint's]")
    s.add_argument("--no-hf-shims", action="store_true", help="no transformers trust_remote_code shims")
    s.set_defaults(fn=_cmd_convert)
