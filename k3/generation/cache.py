"""Hybrid inference cache (architecture.md §7): constant-size KDA state + a growing compressed MLA latent cache.

Per KDA layer (`KDALayerCache`): the fp32 recurrent state S [B, H, K, V] (fp64 for fp64 models) and the short-conv
history, the last K-1 *pre-activation* q/k/v projections [3, B, P, K-1] stored in the activation dtype (lossless:
they are rounded to that dtype before the conv). Both are preallocated once and overwritten in place.

Per MLA layer (`MLALayerCache`): per token the kv_a_layernorm-ed latent c [kv_lora] and the raw k_pe [rope], one
[B, capacity, kv_lora + rope] buffer in the activation dtype, allocated in blocks of `block_size` tokens (grown by
whole blocks, amortised by doubling up to the next block multiple, never per token). Rows may hold different
lengths (ragged batches); `lengths` is kept on the host and on the device.

`K3Cache(config, batch_size, dtype, device)` holds one object per layer in `.layers` (what K3Model.forward threads
to the layers). `cache.rows(i)` (or a slice) gives a view that reads/writes only those batch rows, e.g. to prefill
each prompt of a ragged batch into its own row. `cache.packed([r0, r1, ...])` gives a view for ONE packed forward
(batch 1 + cu_seqlens) whose document n continues cache row r_n: KDA/conv start from and write back each row's own
state (per-document initial/final states), MLA appends each document's latents to its row and attends only to it. `cache_memory(config, dtype)` reports the bytes per sequence.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["K3Cache", "KDALayerCache", "MLALayerCache", "K3PackedView", "cache_memory", "state_dtype_for"]

DEFAULT_BLOCK = 256


def state_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The KDA recurrent state is never low precision: fp32, or fp64 for fp64 models."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def cache_memory(config, dtype: Union[torch.dtype, str] = torch.bfloat16, context: int = 0) -> dict:
    """Bytes of inference state per sequence for `config` with activations in `dtype`.

    Returns kda_layers, mla_layers, kda_state_bytes_per_layer (S, fp32), kda_conv_bytes_per_layer (3 x P x (K-1)
    in dtype), kda_bytes (all KDA layers, constant in context), mla_bytes_per_token_per_layer ((kv_lora + rope) x
    itemsize), mla_bytes_per_token (all MLA layers) and, for `context` tokens, total_bytes = kda_bytes +
    context x mla_bytes_per_token."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    types = config.layer_types
    n_kda, n_mla = types.count("kda"), types.count("mla")
    lac = config.linear_attn_config
    H, K = lac.num_heads, lac.head_dim
    state = H * K * K * _itemsize(state_dtype_for(dtype))
    conv = 3 * H * K * (lac.short_conv_kernel_size - 1) * _itemsize(dtype)
    per_tok = (config.kv_lora_rank + config.qk_rope_head_dim) * _itemsize(dtype)
    out = dict(kda_layers=n_kda, mla_layers=n_mla, kda_state_bytes_per_layer=state, kda_conv_bytes_per_layer=conv,
               kda_state_bytes=n_kda * state, kda_bytes=n_kda * (state + conv),
               mla_bytes_per_token_per_layer=per_tok, mla_bytes_per_token=n_mla * per_tok, context=int(context))
    out["total_bytes"] = out["kda_bytes"] + int(context) * out["mla_bytes_per_token"]
    return out


# ---------------------------------------------------------------------------------------------------- layers
class KDALayerCache:
    """Recurrent state + conv history of one KDA layer for B rows (optionally a view of some rows)."""

    def __init__(self, batch_size: int, num_heads: int, head_dim: int, conv_size: int, dtype, device,
                 _parent: Optional["KDALayerCache"] = None, _rows: Optional[slice] = None):
        if _parent is not None:
            self.conv, self.state, self.rows = _parent.conv, _parent.state, _rows
            self.kda_mode = _parent.kda_mode
            return
        P = num_heads * head_dim
        self.conv = torch.zeros(3, batch_size, P, conv_size - 1, dtype=dtype, device=device)
        self.state = torch.zeros(batch_size, num_heads, head_dim, head_dim, dtype=state_dtype_for(dtype),
                                 device=device)
        self.rows = slice(None)
        self.kda_mode = "auto"

    def view(self, rows: slice) -> "KDALayerCache":
        return KDALayerCache(0, 0, 0, 0, None, None, _parent=self, _rows=rows)

    @property
    def conv_state(self):
        c = self.conv[:, self.rows]
        return c[0], c[1], c[2]

    @conv_state.setter
    def conv_state(self, states) -> None:
        for j, s in enumerate(states):
            self.conv[j, self.rows].copy_(s.detach())

    @property
    def recurrent_state(self) -> torch.Tensor:
        return self.state[self.rows]

    @recurrent_state.setter
    def recurrent_state(self, s: torch.Tensor) -> None:
        self.state[self.rows].copy_(s.detach())

    def reset(self) -> None:
        self.conv[:, self.rows].zero_()
        self.state[self.rows].zero_()

    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.state.numel() * self.state.element_size()


class MLALayerCache:
    """Compressed MLA cache of one layer: [B, capacity, kv_lora + rope] latents, per-row lengths."""

    def __init__(self, batch_size: int, kv_lora_rank: int, rope_dim: int, dtype, device,
                 block_size: int = DEFAULT_BLOCK, capacity: int = 0):
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.block_size = int(block_size)
        self.dtype, self.device = dtype, torch.device(device)
        self.batch_size = batch_size
        self.buf = torch.zeros(batch_size, self._round(capacity), kv_lora_rank + rope_dim, dtype=dtype,
                               device=device)
        self.lengths = [0] * batch_size                                     # host copy
        self.lengths_t = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.mla_mode = "auto"

    def _round(self, n: int) -> int:
        b = self.block_size
        return -(-max(int(n), 0) // b) * b

    @property
    def capacity(self) -> int:
        return self.buf.shape[1]

    def reserve(self, n: int) -> None:
        """Make room for n tokens per row (whole blocks; grows geometrically so appends are amortised O(1))."""
        if n <= self.capacity:
            return
        new_cap = self._round(max(n, min(2 * self.capacity, n + 64 * self.block_size)))
        buf = torch.zeros(self.batch_size, new_cap, self.buf.shape[2], dtype=self.dtype, device=self.device)
        used = max(self.lengths)
        buf[:, :used] = self.buf[:, :used]
        self.buf = buf

    def view(self, rows: slice) -> "_MLARowView":
        return _MLARowView(self, rows)

    # --- interface used by MLAAttention (whole batch)
    def uniform_length(self, rows: slice = slice(None)) -> Optional[int]:
        ls = self.lengths[rows]
        return ls[0] if ls and all(x == ls[0] for x in ls) else None

    @property
    def length(self) -> int:
        L = self.uniform_length()
        if L is None:
            raise ValueError("MLA cache rows hold different lengths; use lengths / lengths_tensor()")
        return L

    def lengths_tensor(self, rows: slice = slice(None)) -> torch.Tensor:
        return self.lengths_t[rows]

    def update(self, c_BTC: torch.Tensor, kpe_BTR: torch.Tensor, rows: slice = slice(None)):
        """Append T tokens to each selected row (at that row's own length); return views of all cached
        (c, k_pe) of these rows up to the longest row: ([b, S, kv_lora], [b, S, rope])."""
        idx = range(self.batch_size)[rows]
        T = c_BTC.shape[1]
        if c_BTC.shape[0] != len(idx):
            raise ValueError(f"MLA cache: got a batch of {c_BTC.shape[0]} for {len(idx)} cache rows")
        ends = [self.lengths[i] + T for i in idx]
        self.reserve(max(ends))
        new = torch.cat([c_BTC, kpe_BTR], -1).detach().to(self.dtype)
        starts = [self.lengths[i] for i in idx]
        if all(s == starts[0] for s in starts):
            self.buf[rows, starts[0]:starts[0] + T] = new
        else:
            pos = self.lengths_t[rows].unsqueeze(1) + torch.arange(T, device=self.device)
            b = torch.arange(self.batch_size, device=self.device)[rows].unsqueeze(1).expand_as(pos)
            self.buf.index_put_((b, pos), new)
        for i in idx:
            self.lengths[i] += T
        self.lengths_t[rows] += T
        S = max(ends)
        lat = self.buf[rows, :S]
        return lat[..., :self.kv_lora_rank], lat[..., self.kv_lora_rank:]

    def reset(self, rows: slice = slice(None)) -> None:
        for i in range(self.batch_size)[rows]:
            self.lengths[i] = 0
        self.lengths_t[rows] = 0

    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size() + self.lengths_t.numel() * self.lengths_t.element_size()

    def latent_nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


class _MLARowView:
    """The MLALayerCache interface restricted to some batch rows."""

    def __init__(self, parent: MLALayerCache, rows: slice):
        self.parent, self.rows = parent, rows
        self.mla_mode = parent.mla_mode

    def uniform_length(self):
        return self.parent.uniform_length(self.rows)

    @property
    def length(self) -> int:
        L = self.uniform_length()
        if L is None:
            raise ValueError("MLA cache rows hold different lengths")
        return L

    def lengths_tensor(self):
        return self.parent.lengths_tensor(self.rows)

    def update(self, c, k_pe):
        return self.parent.update(c, k_pe, self.rows)

    def reset(self):
        self.parent.reset(self.rows)


# ---------------------------------------------------------------------------------------------------- model
def _as_rows(rows) -> slice:
    if isinstance(rows, int):
        return slice(rows, rows + 1)
    if isinstance(rows, slice) and rows.step in (None, 1):
        return rows
    raise TypeError(f"rows must be an int or a contiguous slice, got {rows!r}")


class K3Cache:
    """All per-layer inference state of a K3 model for `batch_size` sequences.

    dtype: the activation dtype (the model's); MLA latents and conv history are stored in it, the KDA recurrent
    state in fp32 (fp64 for fp64). max_length: tokens per row to preallocate in the MLA cache (rounded up to
    block_size; it grows by blocks beyond that). mla_mode / kda_mode: "auto" or a forced path (tests).
    """

    def __init__(self, config, batch_size: int = 1, dtype: torch.dtype = torch.bfloat16, device="cpu",
                 max_length: int = 0, block_size: int = DEFAULT_BLOCK, mla_mode: str = "auto",
                 kda_mode: str = "auto"):
        if mla_mode not in ("auto", "absorbed", "expanded"):
            raise ValueError(f"mla_mode must be auto/absorbed/expanded, got {mla_mode!r}")
        if kda_mode not in ("auto", "recurrent", "chunk"):
            raise ValueError(f"kda_mode must be auto/recurrent/chunk, got {kda_mode!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.config, self.batch_size, self.dtype = config, int(batch_size), dtype
        self.device = torch.device(device)
        lac = config.linear_attn_config
        self.layers: list = []
        for t in config.layer_types:
            if t == "kda":
                lc = KDALayerCache(batch_size, lac.num_heads, lac.head_dim, lac.short_conv_kernel_size, dtype,
                                   self.device)
                lc.kda_mode = kda_mode
            else:
                lc = MLALayerCache(batch_size, config.kv_lora_rank, config.qk_rope_head_dim, dtype, self.device,
                                   block_size, max_length)
                lc.mla_mode = mla_mode
            self.layers.append(lc)
        self._mla = [lc for lc in self.layers if isinstance(lc, MLALayerCache)]
        self._seen = [0] * batch_size  # tokens consumed per row (also for all-KDA models)

    @classmethod
    def for_model(cls, model, batch_size: int = 1, **kw) -> "K3Cache":
        return cls(model.config, batch_size, dtype=model.dtype, device=model.device, **kw)

    # -------------------------------------------------------------- views / bookkeeping
    def rows(self, rows) -> "K3CacheView":
        """A cache view of some batch rows (int or contiguous slice) to pass as model(..., cache=view)."""
        return K3CacheView(self, _as_rows(rows))

    @property
    def lengths(self) -> list:
        """Tokens cached per row."""
        return list(self._seen)

    def advance(self, n: int, rows: slice = slice(None)) -> None:
        for i in range(self.batch_size)[rows]:
            self._seen[i] += n

    def reserve(self, n: int) -> None:
        for lc in self._mla:
            lc.reserve(n)

    def reset(self) -> None:
        for lc in self.layers:
            lc.reset()
        self._seen = [0] * self.batch_size

    def packed(self, rows) -> "K3PackedView":
        """A view for one packed forward (input [1, T] + cu_seqlens with len(rows) documents): document n reads
        and writes cache row rows[n] (distinct rows)."""
        return K3PackedView(self, rows)

    # -------------------------------------------------------------- memory
    def memory(self) -> dict:
        """Actual bytes held: kda_bytes (state + conv), mla_bytes_allocated (latent buffers at capacity),
        mla_bytes_used (cached tokens only), mla_capacity (tokens per row)."""
        kda = sum(lc.nbytes() for lc in self.layers if isinstance(lc, KDALayerCache))
        mla_alloc = sum(lc.latent_nbytes() for lc in self._mla)
        used = sum(sum(lc.lengths) * lc.buf.shape[2] * lc.buf.element_size() for lc in self._mla)
        return dict(kda_bytes=kda, mla_bytes_allocated=mla_alloc, mla_bytes_used=used,
                    mla_capacity=self._mla[0].capacity if self._mla else 0, total_bytes=kda + mla_alloc)


class K3CacheView:
    """K3Cache restricted to some rows; `.layers` is what the model threads to its layers."""

    def __init__(self, cache: K3Cache, rows: slice):
        self.cache, self.rows = cache, rows
        self.layers = [lc.view(rows) for lc in cache.layers]

    def advance(self, n: int) -> None:
        self.cache.advance(n, self.rows)

    def reset(self) -> None:
        """Empty these rows only (KDA state/conv zeroed, MLA lengths and token counts set to 0), so a row can be
        reused for a new sequence while the other rows keep their state (continuous batching)."""
        for lc in self.layers:
            lc.reset()
        for i in range(self.cache.batch_size)[self.rows]:
            self.cache._seen[i] = 0


# ---------------------------------------------------------------------------------------------------- packed
class _KDAPackedView:
    """KDALayerCache interface for a packed forward: document n <-> row idx[n]. The states are [N, ...] (one per
    document), what causal_conv1d / chunk_kda take and return with cu_seqlens."""

    def __init__(self, parent: KDALayerCache, idx: torch.Tensor):
        self.parent, self.idx = parent, idx
        self.kda_mode = parent.kda_mode

    @property
    def conv_state(self):
        c = self.parent.conv.index_select(1, self.idx)                    # [3, N, P, K-1] (a copy)
        return c[0], c[1], c[2]

    @conv_state.setter
    def conv_state(self, states) -> None:
        for j, s in enumerate(states):
            self.parent.conv[j].index_copy_(0, self.idx, s.detach().to(self.parent.conv.dtype))

    @property
    def recurrent_state(self) -> torch.Tensor:
        return self.parent.state.index_select(0, self.idx)

    @recurrent_state.setter
    def recurrent_state(self, s: torch.Tensor) -> None:
        self.parent.state.index_copy_(0, self.idx, s.detach().to(self.parent.state.dtype))


class _MLAPackedView:
    """MLALayerCache interface for a packed forward: MLAAttention appends document n's latents to row rows[n]
    (`update_doc`) and attends over that row only."""

    packed = True

    def __init__(self, parent: MLALayerCache, rows: list):
        self.parent, self.rows = parent, rows
        self.mla_mode = parent.mla_mode

    def doc_length(self, n: int) -> int:
        return self.parent.lengths[self.rows[n]]

    def update_doc(self, n: int, c_1TC: torch.Tensor, kpe_1TR: torch.Tensor):
        r = self.rows[n]
        return self.parent.update(c_1TC, kpe_1TR, slice(r, r + 1))


class K3PackedView:
    """K3Cache seen by one packed forward (batch 1, cu_seqlens): document n continues cache row rows[n]."""

    def __init__(self, cache: K3Cache, rows):
        rows = [int(r) for r in rows]
        if not rows or len(set(rows)) != len(rows) or not all(0 <= r < cache.batch_size for r in rows):
            raise ValueError(f"packed cache view: need distinct rows in [0, {cache.batch_size}), got {rows}")
        self.cache, self.rows = cache, rows
        idx = torch.tensor(rows, dtype=torch.long, device=cache.device)
        self.layers = [_KDAPackedView(lc, idx) if isinstance(lc, KDALayerCache) else _MLAPackedView(lc, rows)
                       for lc in cache.layers]

    def advance(self, ns) -> None:
        """Count ns[n] more tokens in row rows[n]."""
        for r, n in zip(self.rows, ns):
            self.cache._seen[r] += int(n)
