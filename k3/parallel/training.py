"""`k3 train` under torchrun (issues #30 / #31): the same loop as k3.train.trainer on a device mesh.

    torchrun --nproc-per-node 4 -m k3.cli train --preset tiny --dp-shard 4 --ep 2 --out runs/t4

`make_trainer(cfg, mesh_flags)` is what `k3 train` calls: without torchrun's environment (RANK / WORLD_SIZE, read
through k3.knobs) it returns the single-process `Trainer` unchanged; under torchrun it validates the mesh and the
batch shape BEFORE any work (K3ConfigError naming the flag), initialises the process group (nccl on CUDA, gloo on
CPU) and returns a `DistTrainer`, a `Trainer` whose steps, evaluation, checkpoints and end-of-run files are
distributed:

* model (k3.parallel.setup): built on `meta`, `parallelize_model` (EP -> CP -> AC -> compile -> FSDP2),
  materialised per rank. Up to `EXACT_INIT_MAX_PARAMS` parameters it is initialised as the single-process run does
  (a CPU copy per rank from the same seed, each keeping its shards: the numbers do not depend on the mesh); a larger
  one shard by shard (`init_weights` on the local shards), or loaded per rank from `--init` / a checkpoint. A
  multimodal config builds `K3ForConditionalGeneration` with k3.parallel.vision (no CP with images).
* data (k3.parallel.batching): every rank draws the same global batch (the single-process loader, same order) and
  keeps its data-parallel rows (`ParallelMesh.dp_index()`); rows per micro-batch must divide by dp_replicate x
  dp_shard. Under CP the cp ranks of one data index share those rows and each keeps its contiguous slice
  (`model._k3_cp.shard`). With images, each rank gets the images whose placeholders lie in its rows (None when it
  has none: its tower runs on a blank image). `--task vision-synth | image-text`: k3.parallel.vision_train.
* the step's update and record, the evaluation and the training-state restore are the single-process trainer's
  (Trainer._finish_step, k3.train.probes.evaluate, k3.train.checkpointing.restore_training_state) with the
  reductions as hooks; MTP losses (main_loss, mtp_loss, mtp_losses; val_mtp_loss) are summed over the ranks.
* loss: each rank's CE sum / the step's global target-token count (known on every rank: all hold the global
  batch); FSDP sums the gradients; `clip_grad_norm_` clips by the global norm; `build_sharded_optimizer`;
  `sharded_qk_clip`; the balancers reduce their statistics over the data ranks themselves.
* checkpoints: DCP (`k3.parallel.checkpoint`) in RUN/checkpoints/step-<N>/ with `extra.pt` = scheduler, balancer,
  loader position, RNG, step counters, the mesh it was written on; `--resume` loads it on any mesh / world size.
* rank 0 alone writes metrics.jsonl, TensorBoard, progress, samples, report, plots and final/; eval sums ranks.

`--batch-tokens` stays the global tokens per optimizer step, constant per stage; `--cp` is fixed for the run (a
longer stage gives each cp rank a longer slice of the sequence its group splits, not more tokens per step).
"""
from __future__ import annotations

import logging
import math
import os
import shutil
from typing import Optional

import torch

from k3 import knobs
from k3.errors import CheckpointError, K3ConfigError
from k3.parallel.batching import local_batch, target_count
from k3.parallel.flags import MeshFlags, check_batch_shape, mesh_dims
from k3.parallel.mesh import ParallelDims
from k3.parallel.setup import EXACT_INIT_MAX_PARAMS, refuse_cp_unsupported
from k3.train.report import MTPSums
from k3.train.trainer import Trainer

log = logging.getLogger("k3.train")

__all__ = ["MeshFlags", "torchrun_env", "make_trainer", "DistTrainer", "check_batch_shape", "EXACT_INIT_MAX_PARAMS"]

# final/ (the k3.checkpoint layout) is gathered on every rank; above this, convert the last DCP checkpoint instead
FINAL_MAX_PARAMS = 2_000_000_000


def torchrun_env() -> Optional[tuple[int, int, int]]:
    """(rank, world size, local rank) when started by torchrun (RANK and WORLD_SIZE set), else None."""
    world = knobs.get("WORLD_SIZE")
    rank = knobs.get("RANK")
    if world is None and rank is None:
        return None
    if world is None or rank is None:
        raise K3ConfigError("torchrun environment: RANK and WORLD_SIZE must both be set (start with torchrun)")
    if rank >= world:
        raise K3ConfigError(f"torchrun environment: RANK={rank} is not below WORLD_SIZE={world}")
    local = knobs.get("LOCAL_RANK")
    return rank, world, (local if local is not None else 0)


def _model_config(cfg, given=None):
    from k3.config import K3Config
    run_cfg = os.path.join(cfg.out_dir, "config.json")
    if cfg.resume and os.path.isfile(run_cfg):
        return K3Config.from_json(run_cfg)
    mcfg = given if given is not None else (K3Config.load(cfg.config) if cfg.config else
                                            K3Config.from_preset(cfg.preset))
    return mcfg.replace(**cfg.model_overrides) if cfg.model_overrides else mcfg


def make_trainer(cfg, flags: Optional[MeshFlags] = None, **kw) -> Trainer:
    """The trainer `k3 train` runs: `Trainer` without torchrun (mesh flags then refused), `DistTrainer` under it
    (mesh and batch shape validated before the process group starts)."""
    flags = flags or MeshFlags()
    env = torchrun_env()
    if env is None:
        if flags.given():
            raise K3ConfigError(f"{flags.describe()}: mesh flags need several processes; launch with torchrun, "
                                f"e.g. torchrun --nproc-per-node 4 -m k3.cli train ... {flags.describe()} "
                                f"(docs/parallelism.md)")
        _refuse_dcp_resume_without_torchrun(cfg)
        return Trainer(cfg, **kw)
    rank, world, local = env
    cfg.validate()
    mcfg = _model_config(cfg, kw.get("model_config"))
    dims = mesh_dims(flags, world, int(mcfg.num_experts))
    refuse_cp_unsupported(dims, mcfg)
    check_batch_shape(cfg, dims)
    return DistTrainer(cfg, dims, local_rank=local, **kw)


def _refuse_dcp_resume_without_torchrun(cfg) -> None:
    """A run written under torchrun holds DCP checkpoints only: the single-process trainer would not find them and
    would start over. Refuse, saying how to continue it."""
    from k3.parallel.checkpoint import find_checkpoints
    from k3.train.checkpointing import find_checkpoints as find_single
    if not cfg.resume:
        return
    dcp = find_checkpoints(os.path.join(cfg.out_dir, "checkpoints"))
    if dcp and not find_single(cfg.out_dir):
        raise K3ConfigError(f"--resume: {cfg.out_dir} was written by a distributed run (DCP checkpoint "
                            f"{dcp[-1][1]}): continue it under torchrun, on any number of processes, e.g. "
                            f"torchrun --nproc-per-node 1 -m k3.cli train --out {cfg.out_dir} --resume")


def _init_process_group(device: torch.device) -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


# ---------------------------------------------------------------------------------------------------- trainer

class DistTrainer(Trainer):
    """`Trainer` on a device mesh (module doc). Build it with `make_trainer`; `train()` as usual."""

    def __init__(self, cfg, dims: ParallelDims, local_rank: int = 0, model_config=None, callbacks=(), data=None):
        super().__init__(cfg, model_config=model_config, callbacks=callbacks, data=data)
        import torch.distributed as dist
        self.dims = dims
        from k3.train.config import resolve_device
        dev = resolve_device(cfg.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local_rank)
        self.device = dev
        self._own_pg = not dist.is_initialized()
        _init_process_group(dev)
        if dist.get_world_size() != dims.world_size:
            raise K3ConfigError(f"process group of {dist.get_world_size()} ranks != WORLD_SIZE {dims.world_size}")
        self.rank = dist.get_rank()
        self.is_rank0 = self.rank == 0
        if not self.is_rank0:
            cfg.progress = False
            cfg.tensorboard = False
            logging.getLogger("k3").setLevel(logging.WARNING)   # rank 0 reports

    # ---- collective helpers
    def _barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier()

    def _allreduce(self, values, op="sum") -> list:
        import torch.distributed as dist
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.cpu().tolist()

    def _comm_device(self):
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    # Ctrl-C reaches the ranks at different moments: the stop request is agreed on (max over ranks) where the loop
    # reads it, at the start of a step, which every rank reaches together
    @property
    def _stop_requested(self) -> bool:
        if getattr(self, "_setup_done", False) and getattr(self, "_in_loop", False):
            return bool(self._allreduce([float(self._sigint)], op="max")[0])
        return getattr(self, "_sigint", False)

    @_stop_requested.setter
    def _stop_requested(self, v: bool) -> None:
        self._sigint = bool(v)

    def _on_sigint(self, signum, frame):
        if self._sigint:
            from k3.train.trainer import _Abort
            raise _Abort
        self._sigint = True
        log.warning("Ctrl-C: finishing the current step, saving a checkpoint (Ctrl-C again to abort)")

    # ---- run directory
    @property
    def ckpt_dir(self) -> str:
        return self._path("checkpoints")

    def _dcp_checkpoints(self) -> list:
        from k3.parallel.checkpoint import find_checkpoints
        return find_checkpoints(self.ckpt_dir)

    def holds_run(self) -> bool:
        return bool(self._dcp_checkpoints()) or super().holds_run()

    def setup(self) -> "DistTrainer":
        if self._setup_done:
            return self
        cfg = self.cfg
        cfg.validate()
        if not cfg.resume and not cfg.overwrite and self.holds_run():
            raise K3ConfigError(f"{cfg.out_dir} already holds a training run: continue it with --resume, replace "
                                f"it with --overwrite, or choose another --out")
        self._barrier()   # every rank looked before rank 0 creates anything
        if self.is_rank0:
            from k3.train.checkpointing import RunLock
            os.makedirs(cfg.out_dir, exist_ok=True)
            self._lock = RunLock(cfg.out_dir).acquire()
        self._barrier()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        self._setup_done = True
        return self

    def _setup(self) -> None:
        from k3.parallel import build_mesh
        from k3.parallel.checkpoint import latest_checkpoint
        from k3.parallel.release_load import init_dir
        from k3.parallel.setup import build_parallel_model, build_run_data
        from k3.train import checkpointing as ckpt_io
        from k3.train.config import auto_threads, check_resume_settings, stored_train_config
        cfg = self.cfg
        ckpt = None
        if cfg.resume:
            stored = stored_train_config(cfg.out_dir)
            ckpt = latest_checkpoint(self.ckpt_dir)
            if stored is not None and ckpt is not None:
                check_resume_settings(cfg, stored, self._path("train_config.json"))
            if ckpt is None and ckpt_io.find_checkpoints(cfg.out_dir):
                raise CheckpointError(f"--resume: {cfg.out_dir} holds single-process checkpoints only; continue it "
                                      f"with plain `k3 train --resume` (a distributed run writes DCP checkpoints)")
            if ckpt is None and self.is_rank0:
                log.warning("--resume: no checkpoint in %s; starting a new run", cfg.out_dir)
        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        elif self.device.type == "cpu":
            torch.set_num_threads(max(1, auto_threads() // max(1, self.dims.world_size)))
        self.threads = torch.get_num_threads()
        ckpt_io.seed_everything(cfg.seed)

        init = init_dir(cfg) if ckpt is None else None      # a released / DCP checkpoint to start from
        mcfg = self._run_model_config(ckpt, init)
        self.data, self.data_time = build_run_data(self, mcfg, self._tokenizer_path(ckpt, init))   # rank 0 first
        self.tokenizer = self.data.tokenizer
        self.model_config = mcfg = self._fit_tokenizer(mcfg, self.tokenizer)
        self.dims.check_model(mcfg)

        # ---- model: meta -> parallelise -> materialise (init or load) per rank
        self.pmesh = build_mesh(self.dims, self.device.type)
        self.model = model = build_parallel_model(self, mcfg, self.pmesh, fresh=ckpt is None, init=init)
        self._placeholder_id = getattr(model, "media_placeholder_token_id", None)   # multimodal: images in batches

        # ---- optimizer / schedule / balancer
        from k3.parallel.muon import build_sharded_optimizer
        from k3.train.build import make_balancer
        from k3.train.schedule import ContextSchedule, cosine_with_warmup
        self.optimizer = build_sharded_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                                 adamw_lr=cfg.adamw_lr, master_weights=False)
        self.warmup_steps = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, round(0.05 * cfg.steps))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_with_warmup(self.warmup_steps, cfg.steps, cfg.min_lr_ratio))
        self.schedule = ContextSchedule(cfg.steps, cfg.tokens_per_step, cfg.stages)
        self.balancer = make_balancer(cfg.balancer, model, mcfg)

        # ---- resume / run directory
        if ckpt is not None:
            from k3.parallel.checkpoint import load_checkpoint
            from k3.train import report
            extra = load_checkpoint(ckpt, model, self.optimizer)
            self._restore_extra(ckpt, extra)
            if self.is_rank0:
                report.truncate_metrics(self._path("metrics.jsonl"), self.step)
            self._barrier()
            self.history, self.eval_history = report.read_metrics(self._path("metrics.jsonl"))
        elif self.is_rank0:
            ckpt_io.clear_run_outputs(cfg.out_dir)
            for _, p in self._dcp_checkpoints():
                shutil.rmtree(p, ignore_errors=True)
        if self.is_rank0:
            mcfg.save_json(self._path("config.json"))
            ckpt_io.atomic_json(self.cfg.to_dict(), self._path("train_config.json"))
            ckpt_io.cleanup_tmp(cfg.out_dir)
            log.info("k3 train: %s, %d parameters", self.dims.describe(), self.num_params)
        self._barrier()

    # ---- checkpoints (DCP)
    def state(self) -> dict:
        """The `extra` of a DCP checkpoint: everything a step depends on besides the model and optimizer."""
        from k3.train import checkpointing as ckpt_io
        stage, seq = self.schedule.stage_at(self.step)
        return {
            "step": self.step, "stage": stage, "seq_len": seq, "tokens_seen": self.tokens_seen,
            "train_time": self.train_time, "bad_streak": self.bad_streak, "grad_norm_window": self.grad_norm_window,
            "scheduler": self.scheduler.state_dict(),
            "balancer": self.balancer.state_dict() if self.balancer is not None else None,
            "loader": self.data.train.state_dict(), "rng": ckpt_io.rng_state(),
            "train_config": self.cfg.to_dict(), "tokenizer_fingerprint": self.tokenizer.fingerprint,
            "mesh": self.dims.describe(),
        }

    def save_checkpoint(self) -> str:
        from k3.parallel.checkpoint import save_checkpoint
        path = save_checkpoint(self.ckpt_dir, self.step, self.model, self.optimizer, extra=self.state())
        if self.is_rank0:
            self.tokenizer.save(path)
            for _, old in self._dcp_checkpoints()[:-self.cfg.keep]:
                shutil.rmtree(old, ignore_errors=True)
        self._barrier()
        for cb in self.callbacks:
            cb.on_save(self, path)
        return path

    def load_checkpoint(self, path: str, state: Optional[dict] = None) -> None:
        from k3.parallel.checkpoint import load_checkpoint
        self._restore_extra(path, load_checkpoint(path, self.model, self.optimizer))

    def _restore_extra(self, path: str, st: dict) -> None:
        from k3.train.checkpointing import restore_training_state
        restore_training_state(self, path, st, f"{path}/extra.pt", optimizer=False)   # DCP loaded the optimizer
        if self.is_rank0:
            log.info("resumed from %s (step %d, written on %s; now %s)", path, self.step, st.get("mesh", "?"),
                     self.dims.describe())

    # ---- batches (k3.parallel.batching)
    def _local_batch(self, b: dict, seq: int, allow_uneven: bool = False) -> dict:
        """This rank's part of a global packed batch: its data-parallel rows, under CP its slice of them, with
        images the images of its rows. `allow_uneven` (evaluation): a rank without rows gets a padding row."""
        return local_batch(b, seq, dims=self.dims, dp_index=self.pmesh.dp_index(), device=self.device,
                           pad_id=self.model_config.pad_token_id,
                           cp=self.model._k3_cp if self.dims.cp_enabled else None,
                           placeholder_id=self._placeholder_id, allow_uneven=allow_uneven)

    # ---- one step: the local micro-batches here, the update and the record in Trainer._finish_step (hooks below)
    def train_step(self) -> dict:
        t0, stage, seq, rows, batches = self._begin_step()   # the global micro-batches, as in one process
        n_total = max(sum(target_count(b, self._placeholder_id) for b in batches), 1)
        loss_sum = torch.zeros((), dtype=torch.float64)
        bad_local = 0.0
        aux_total = 0.0
        mtp = MTPSums()
        world = self.dims.world_size
        for b in batches:
            loc = self._local_batch(b, seq)
            with self._autocast():
                out = self.model(**loc)
            loss = out.loss.float()
            for cb in self.callbacks:
                loss = cb.on_loss(self, loss)
            n_loc = out.num_tokens if torch.is_tensor(out.num_tokens) else torch.tensor(out.num_tokens)
            w = n_loc.to(loss.device, torch.float32) / n_total
            obj = loss * w   # local CE sum / global count
            ce = obj.detach()
            if self.balancer is not None:
                aux = self.balancer.aux_loss()
                if isinstance(aux, torch.Tensor) and aux.requires_grad:
                    obj = obj + aux.to(obj.device) * (1.0 / (len(batches) * world))   # FSDP sums over ranks
                    aux_total += float(aux.detach()) / len(batches)
            obj.backward()   # every rank runs every micro-batch (FSDP's collectives), even after a bad one
            if not torch.isfinite(loss.detach()):
                bad_local = 1.0
            loss_sum += ce.double().cpu()
            mtp.add(out, w)
        sums = self._allreduce([float(loss_sum), bad_local] + mtp.values())   # one collective
        mtp.set_values(sums[2:])
        return self._finish_step(t0, stage, seq, rows, sums[0], sums[1] > 0, aux_total, mtp)

    def _clip_grad_norm(self, params: list) -> torch.Tensor:
        from k3.parallel.parallelize import clip_grad_norm_
        return clip_grad_norm_(params, self.cfg.grad_clip)

    def _reduce_max_logit(self, local: list) -> float:
        return self._allreduce([max(local) if local else -math.inf], op="max")[0]

    def _qk_clip(self) -> int:
        from k3.parallel.qk_clip import sharded_qk_clip
        return sharded_qk_clip(self.model, tau=self.cfg.qk_clip_tau, optimizer=self.optimizer)

    # ---- evaluation (k3.train.probes.evaluate on every rank, the sums reduced) / samples
    def _eval_batch(self, b: dict, seq: int) -> dict:
        return self._local_batch(b, seq, allow_uneven=True)

    def _sum_over_ranks(self, values: list) -> list:
        return self._allreduce(values)

    def _recall_enabled(self) -> bool:
        return not self.dims.cp_enabled   # the same probe batch on every rank (FSDP gathers the weights)

    def samples(self) -> list:
        """Greedy continuations, run in lockstep on every rank (identical inputs and weights give identical
        tokens); not under CP (generation feeds whole sequences)."""
        from k3.train.probes import greedy_generate
        if self.dims.cp_enabled:
            return []
        tok, model, cfg = self.tokenizer, self.model, self.cfg
        was_training = model.training
        model.eval()
        out = []
        try:
            for prompt in cfg.sample_prompts:
                ids = tok.encode(prompt, allow_special=False)
                new = greedy_generate(model, ids, cfg.sample_tokens, stop_ids=(tok.eod_id, tok.eos_id))
                out.append((prompt, tok.decode(new, skip_special_tokens=True)))
        finally:
            model.train(was_training)
        return out

    # ---- logging (rank 0)
    def _log(self, rec: dict) -> None:
        if self.is_rank0:
            super()._log(rec)

    def _open_tensorboard(self) -> None:
        if self.is_rank0:
            super()._open_tensorboard()

    # ---- end of run
    def _non_finite(self) -> Optional[str]:
        bad = [n for n, p in self.model.named_parameters()
               if not bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())]
        if self._allreduce([float(len(bad))], op="max")[0] > 0:
            return "weight tensors hold NaN/inf" + (f" (e.g. {bad[0]})" if bad else "")
        from k3.train.probes import non_finite_eval
        return non_finite_eval(self)

    def latest_checkpoint_path(self) -> Optional[str]:
        from k3.parallel.checkpoint import latest_checkpoint
        return latest_checkpoint(self.ckpt_dir)

    def _finish(self, status: str, wall: float) -> dict:
        from k3.train import report
        from k3.train.trainer import TrainingError
        cfg = self.cfg
        summary = report.build_summary(self, status, wall)
        summary["checkpoint"] = self.latest_checkpoint_path()
        summary["mesh"] = self.dims.describe()
        failure = self._non_finite() if status == "completed" else None
        if failure is not None:
            summary["status"] = "failed"
            if self.is_rank0:
                report.write_artifacts(self, summary)
            raise TrainingError(f"the run reached step {self.step} but {failure}; no final model was written "
                                f"(last checkpoint: {summary['checkpoint']})")
        if status == "completed":
            if self.num_params <= FINAL_MAX_PARAMS:
                self._save_final()
                summary["final"] = self._path("final")
            elif self.is_rank0:
                log.warning("final/ not written for %d parameters: the last DCP checkpoint %s holds the model",
                            self.num_params, summary["checkpoint"])
            if cfg.samples:
                try:
                    summary["samples"] = self.samples()
                except Exception as e:  # never lose a finished run over a sample
                    log.warning("sample generation failed: %s", e)
        if self.is_rank0:
            report.write_artifacts(self, summary)
        self._barrier()
        return summary

    def _save_final(self) -> None:
        """final/ in the k3.checkpoint layout (loads with k3.checkpoint.from_pretrained): the full weights are
        gathered (collective), rank 0 writes them."""
        from k3.checkpoint import save_pretrained
        from k3.model import K3ForCausalLM
        from k3.parallel.parallelize import full_state_dict
        sd = {k: v.cpu() for k, v in full_state_dict(self.model).items()}
        if self.is_rank0:
            if self._placeholder_id is not None:
                from k3.multimodal import K3ForConditionalGeneration as cls
            else:
                cls = K3ForCausalLM
            with torch.device("meta"):
                m = cls(self.model_config, init=False)
            m.load_state_dict(sd, assign=True)
            if self._placeholder_id is not None:
                m.save_pretrained(self._path("final"), tokenizer=self.tokenizer)
            else:
                save_pretrained(m, self._path("final"), tokenizer=self.tokenizer)
        del sd
        self._barrier()

    def _train(self) -> dict:
        self._in_loop = True     # from here every rank reads the stop request at the same points
        try:
            return super()._train()
        finally:
            self._in_loop = False

    def train(self) -> dict:
        try:
            return super().train()
        finally:
            self._in_loop = False
            self.close_process_group()

    def close_process_group(self) -> None:
        import torch.distributed as dist
        if self._own_pg and dist.is_initialized():
            try:
                dist.barrier()
            except Exception:  # pragma: no cover - another rank failed
                pass
            dist.destroy_process_group()
