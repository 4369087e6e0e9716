"""FSDP2 over the multimodal model (k3.parallel.vision) on 2 gloo ranks vs one process on the concatenated batch.

The rank functions live in this file (run_dist loads it in each child by path)."""
import pytest
import torch

from launcher import run_dist  # noqa: E402  (tests/parallel/conftest.py puts this folder on sys.path)

HERE = "tests/parallel/test_vision_fsdp.py"
ROWS, T = 4, 14
# one image per image row; (t, h, w) patch grids of different shapes with the same 4 merged tokens each, so the
# expanded rows have equal lengths (no padding when every row has an image)
GRIDS = [(1, 4, 4), (1, 2, 8), (1, 8, 2), (1, 4, 4)]


def _mm_config():
    from k3.config import K3Config
    from k3.multimodal import multimodal_config
    from cases import MICRO   # tests/parallel/cases.py: the micro text model of the FSDP tests
    return multimodal_config(K3Config.from_preset("tiny", **MICRO), "tiny")


def _data(cfg, image_rows):
    """ids / labels [ROWS, T] (one placeholder at position 3 of each image row) and per-row (pixels, grid)."""
    from k3.multimodal import media_placeholder_id
    g = torch.Generator().manual_seed(7)
    pid = media_placeholder_id(cfg)
    ids = torch.randint(0, 250, (ROWS, T), generator=g)    # ordinary tokens (below the specials and [PAD])
    labels = torch.randint(0, 250, (ROWS, T), generator=g)
    labels[torch.rand(ROWS, T, generator=g) < 0.25] = -100
    p = cfg.container["vision_config"]["patch_size"]
    images = []
    for r in range(ROWS):
        if r in image_rows:
            ids[r, 3] = pid
            t, h, w = GRIDS[r]
            images.append((torch.randn(t * h * w, 3, p, p, generator=g), torch.tensor([[t, h, w]])))
        else:
            images.append(None)
    return ids, labels, images


def _images_of(images, rows):
    got = [images[r] for r in rows if images[r] is not None]
    if not got:
        return None, None
    return torch.cat([pv for pv, _ in got]), torch.cat([gr for _, gr in got])


def vision_fsdp_steps(image_rows_per_step=((0, 1, 2, 3),), always_run_tower=True):
    """Per step: forward + backward of FSDP2 over 2 ranks (rank r takes rows 2r, 2r+1 and their images) and of
    one process on all 4 rows. Returns (rank 0) the global losses, the full gradients of each step, both ways."""
    import torch.distributed as dist
    from k3.multimodal import K3ForConditionalGeneration
    from k3.parallel import ParallelDims, build_mesh
    from k3.parallel.parallelize import full_state_dict, global_mean_loss, load_full_state_dict, materialize
    from k3.parallel.vision import build_meta_multimodal, parallelize_multimodal
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _mm_config()
    torch.manual_seed(0)
    ref = K3ForConditionalGeneration(cfg)
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    pm = build_mesh(ParallelDims(dp_shard=-1, world_size=world, num_experts=cfg.num_experts), "cpu")
    model = build_meta_multimodal(cfg)
    parallelize_multimodal(model, pm)
    materialize(model, "cpu", init=False)
    load_full_state_dict(model, sd)
    assert model.always_run_tower
    model.always_run_tower = always_run_tower   # False: only to show what the dummy prevents
    res = {"loss": [], "ref_loss": [], "grads": [], "ref_grads": [], "local_images": []}
    mine = list(range(rank * ROWS // world, (rank + 1) * ROWS // world))
    for image_rows in image_rows_per_step:
        ids, labels, images = _data(cfg, set(image_rows))
        # one process, all rows (rows of different expanded lengths are right-padded inside the model)
        pv, grid = _images_of(images, range(ROWS))
        out = ref(ids, pv, grid, labels=labels)
        out.loss.backward()
        res["ref_loss"].append(float(out.loss.detach()))
        res["ref_grads"].append({n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None})
        ref.zero_grad(set_to_none=True)
        # this rank's rows
        pv, grid = _images_of(images, mine)
        res["local_images"].append(0 if grid is None else int(grid.shape[0]))
        out = model(ids[mine], pv, grid, labels=labels[mine])
        loss = global_mean_loss(out, pm)
        loss.backward()
        tot = loss.detach().clone()
        dist.all_reduce(tot)
        res["loss"].append(float(tot))
        res["grads"].append({k: v for k, v in full_state_dict(model, grads=True).items() if v is not None})
        model.zero_grad(set_to_none=True)
    return res


def _close(a, b, what):
    assert set(a) == set(b), f"{what}: keys differ {sorted(set(a) ^ set(b))[:6]}"
    bad = []
    for k in a:
        try:
            torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-4)
        except AssertionError:
            bad.append(f"{k}: max abs diff {float((a[k] - b[k]).abs().max()):.3g}")
    assert not bad, f"{what}: {len(bad)} gradients differ:\n" + "\n".join(bad[:10])


def test_vision_fsdp_images_on_every_rank_and_on_one_rank_only():
    """Step 1: every row has an image. Step 2: only rank 0's rows have images (rank 1 runs the tower on a dummy
    image: no deadlock). Step 3: only rank 1's. Each step's global loss and every gradient (tower blocks, patch
    embedding, projector, language model) equal one process on the 4 rows; the dummy adds exactly nothing."""
    steps = ((0, 1, 2, 3), (0, 1), (2, 3))
    r = run_dist(f"{HERE}:vision_fsdp_steps", 2, {"image_rows_per_step": steps}, timeout=240)
    assert [x["local_images"] for x in r] == [[2, 2, 0], [2, 0, 2]]
    r0 = r[0]
    for s in range(len(steps)):
        assert r0["loss"][s] == pytest.approx(r0["ref_loss"][s], rel=1e-5, abs=1e-6), f"step {s}"
        _close(r0["grads"][s], r0["ref_grads"][s], f"step {s}")
        vis = [k for k in r0["grads"][s] if k.startswith(("vision_tower.", "mm_projector."))]
        assert any(k.startswith("vision_tower.encoder.blocks.") for k in vis) and \
            any(k.startswith("mm_projector.") for k in vis)
        assert all(float(r0["grads"][s][k].abs().max()) > 0 for k in vis), f"step {s}: a vision grad is zero"


def test_parallelize_multimodal_refuses_a_text_model():
    from k3.errors import K3ConfigError
    from k3.parallel.vision import parallelize_multimodal
    from cases import micro_config
    from k3.model import K3ForCausalLM
    with pytest.raises(K3ConfigError, match="K3ForConditionalGeneration"):
        parallelize_multimodal(K3ForCausalLM(micro_config()), pmesh=None)
