"""Context parallelism without processes: slicing, the KDA transition operator, state composition across simulated
ranks (fp64) against the sequential recurrence on the whole sequence, and the conv halo indices."""
import pytest
import torch

from k3.errors import K3ConfigError
from k3.ops.kda import chunk_kda, recurrent_kda
from k3.parallel.context import (kda_correct, kda_incoming_state, kda_local_pass, plan_slices, shard_sequence)
from k3.parallel.mesh import ParallelDims


def test_plan_slices_documents_across_slices():
    # T=37, cp=3: L=13, padded to 39 (the pad is a document of its own); doc [5, 35) spans all three slices
    sl = plan_slices(37, [0, 5, 35, 37], 3)
    assert sl.slice_len == 13 and sl.total_len == 39 and sl.bounds == [0, 5, 35, 37, 39]
    assert sl.cont == [False, True, True]
    assert sl.doc_start == [0, 5, 5]
    assert sl.first_len == [5, 13, 9]
    assert sl.local_cu == [[0, 5, 13], [0, 13], [0, 9, 11, 13]]
    assert sl.for_rank(2).doc_rank == 0
    # a slice starting exactly at a document start does not continue
    sl = plan_slices(12, [0, 4, 12], 3)
    assert sl.cont == [False, False, True] and sl.local_cu == [[0, 4], [0, 4], [0, 4]]
    # no cu_seqlens: one document over every slice
    assert plan_slices(10, None, 2).cont == [False, True]


def test_shard_sequence_pads_and_masks():
    ids = torch.arange(7)[None]
    labels = torch.arange(100, 107)[None]
    b = shard_sequence(ids, labels, torch.tensor([0, 3, 7], dtype=torch.int32), rank=1, size=2, pad_id=-1)
    assert b.input_ids.tolist() == [[4, 5, 6, -1]] and b.labels.tolist() == [[104, 105, 106, -100]]
    assert b.cu_seqlens.tolist() == [0, 3, 4] and b.cu_seqlens.dtype == torch.int32
    with pytest.raises(K3ConfigError, match="one packed sequence"):
        shard_sequence(torch.zeros(2, 8, dtype=torch.long), rank=0, size=2)
    with pytest.raises(K3ConfigError, match="cu_seqlens must rise"):
        shard_sequence(ids, None, torch.tensor([0, 5, 3, 7]), rank=0, size=2)
    with pytest.raises(K3ConfigError, match="rank 2 outside"):
        plan_slices(8, None, 2, rank=2)


def test_cp_mesh_dims_and_errors():
    d = ParallelDims(dp_shard=-1, cp=2, ep=4, world_size=8, num_experts=8)
    assert d.dp_shard == 4 and d.dp_shard_cp == 8 and d.cp_enabled and "cp=2" in d.describe()
    with pytest.raises(K3ConfigError, match="parallel dims: dp_shard: -1 .*dp_replicate \\* cp = 3"):
        ParallelDims(cp=3, world_size=4)
    with pytest.raises(K3ConfigError, match="parallel dims: world_size: .* 1 \\* 2 \\* 3 = 6 != world size 4"):
        ParallelDims(dp_shard=2, cp=3, world_size=4)
    with pytest.raises(K3ConfigError, match="parallel dims: ep: .*must divide dp_shard \\* cp = 1 \\* 2 = 2"):
        ParallelDims(cp=2, ep=4, world_size=2)
    with pytest.raises(K3ConfigError, match="parallel dims: cp: cp=4 needs sequences of at least cp tokens"):
        ParallelDims(cp=4, world_size=4).check_seq_len(3)
    ParallelDims(cp=4, world_size=4).check_seq_len(5)


def _inputs(T, H=2, K=8, V=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=g, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, H, V, generator=g, dtype=torch.float64)
    gl = -torch.rand(1, T, H, K, generator=g, dtype=torch.float64) * 0.5      # log-decay <= 0
    beta = torch.rand(1, T, H, generator=g, dtype=torch.float64)
    return q, k, v, gl, beta


def test_transition_operator_is_the_ordered_product():
    """M from the extended-width pass = A_n ... A_1, A_t = (I - beta_t k_t k_t^T) diag(exp g_t) (reference.py:
    decay, then the delta update), and S_out = M S_in + S_local, o_t = o_t^0 + S_in^T w_t."""
    T, H, K, V = 11, 2, 8, 6
    q, k, v, gl, beta = _inputs(T, H, K, V)
    o, w, pack = kda_local_pass(q, k, v, gl, beta, [0, T], True, scale=0.5)
    M = pack[..., V:]
    eye = torch.eye(K, dtype=torch.float64)
    for h in range(H):
        P = eye.clone()
        for t in range(T):
            kt = k[0, t, h]
            A = (eye - beta[0, t, h] * torch.outer(kt, kt)) @ torch.diag(gl[0, t, h].exp())
            P = A @ P
        torch.testing.assert_close(M[h], P, atol=1e-12, rtol=1e-10)
    S_in = torch.randn(1, H, K, V, dtype=torch.float64)
    o_ref, S_ref = recurrent_kda(q, k, v, gl, beta, scale=0.5, initial_state=S_in, output_final_state=True)
    torch.testing.assert_close(M @ S_in[0] + pack[..., :V], S_ref[0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(kda_correct(o, w, S_in[0]), o_ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("size, cu", [(3, [0, 5, 35, 37]), (2, [0, 37]), (3, [0, 12, 13, 30, 37]), (4, [0, 37])])
def test_composition_over_simulated_ranks_equals_the_recurrence(size, cu):
    """Each simulated rank: its slice from zero (chunk_kda with the gate in kernel), [S_last | M] packs stacked
    as the all-gather would, the incoming state composed from the earlier ranks of the same document, outputs
    corrected = the sequential recurrence over the whole packed sequence (fp64)."""
    T, H, K, V = 37, 2, 8, 6
    q, k, v, f, beta = _inputs(T, H, K, V, seed=1)
    kw = dict(scale=K ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              A_log=torch.zeros(H, dtype=torch.float64), dt_bias=torch.randn(H * K, dtype=torch.float64),
              lower_bound=-5.0)
    cu_t = torch.tensor(cu)
    o_ref, _ = recurrent_kda(q, k, v, f, beta, cu_seqlens=cu_t, **kw)
    sl = plan_slices(T, cu, size)
    L, pad = sl.slice_len, sl.total_len - T

    def padded(x):
        return torch.cat([x, x.new_zeros((1, pad) + x.shape[2:])], 1) if pad else x
    xs = [padded(x) for x in (q, k, v, f, beta)]
    runs = []
    for r in range(size):
        part = [x[:, r * L:(r + 1) * L] for x in xs]
        runs.append(kda_local_pass(*part, sl.local_cu[r], sl.cont[r], **kw))
    packs = torch.stack([p for _, _, p in runs])
    outs = []
    for r, (o, w, _) in enumerate(runs):
        if sl.cont[r]:
            o = kda_correct(o, w, kda_incoming_state(packs, V, sl.for_rank(r).doc_rank, r))
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1)[:, :T], o_ref, atol=1e-10, rtol=1e-8)
    # without the correction a continued slice is wrong (the test can fail)
    if any(sl.cont):
        bad = torch.cat([o for o, _, _ in runs], 1)[:, :T]
        assert (bad - o_ref).abs().max() > 1e-3


def _micro():
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from cases import micro_config, reference_model
    return micro_config(), reference_model


def test_single_rank_cp_path_equals_the_model_and_misuse_errors():
    """cp = 1 (no process group) through the CP forwards = the plain model; misuse is a K3ConfigError."""
    from k3.parallel.context import ContextParallel, apply_context_parallel
    cfg, reference_model = _micro()
    ref, model = reference_model(cfg), reference_model(cfg)
    cp = ContextParallel()
    assert (cp.rank, cp.size) == (0, 1)
    changed = apply_context_parallel(model, cp)
    assert len(changed) == cfg.num_hidden_layers
    ids = torch.randint(0, cfg.vocab_size, (1, 20))
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    with pytest.raises(K3ConfigError, match="no current slice"):
        model(ids, cu_seqlens=cu)
    b = cp.shard(ids, None, cu)
    with torch.no_grad():
        h = model(b.input_ids, cu_seqlens=b.cu_seqlens).hidden_states
        h_ref = ref(ids, cu_seqlens=cu).hidden_states
    torch.testing.assert_close(h, h_ref, atol=1e-6, rtol=1e-5)
    with pytest.raises(K3ConfigError, match=r"is not this rank's slice \[1, 20\]"):
        model(ids[:, :10])
    with pytest.raises(K3ConfigError, match="cu_seqlens has 2 entries, the current slice has 3"):
        model(ids)
    with pytest.raises(K3ConfigError, match="already applied"):
        apply_context_parallel(model, cp)
    with pytest.raises(K3ConfigError, match="generation with a cache"):
        model.model.layers[0].self_attn(torch.zeros(1, 20, cfg.hidden_size), cu_seqlens=cu, cache=object())
