"""The LightningModule every draft family trains on: target placement, target features, AdamW + warmup-cosine,
RNG in checkpoints, train / validation logging. A family's objective (dspark.models.registry `Family.objective`)
is a subclass that computes its losses (dspark.training.block_module: DSpark / DFlash blocks;
dspark.training.mtp_module: the MTP chain); dspark.training.modules maps objective names to them."""
from __future__ import annotations

import random
from dataclasses import dataclass

import lightning as L
import numpy as np
import torch
import torch.distributed as dist

from dspark.models.contract import optional
from dspark.targets.health import distribution_health
from dspark.targets.hf_target import FrozenTarget, TargetFeatures
from dspark.training.resume import rewrite_optimizer_state
from dspark.training.schedule import CHECKPOINT_KEY as LR_SCHEDULE_KEY
from dspark.training.schedule import LrSchedule, resumed_schedule
from dspark.training.schedule import warmup_cosine  # noqa: F401 (re-exported: its callers import it from here)
from dspark.training.sharding import shard_draft


@dataclass
class OptimConfig:
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    max_steps: int = 100
    schedule: LrSchedule | None = None  # set by a resume (dspark.training.schedule); None: the plain schedule

    def lr_schedule(self) -> LrSchedule:
        return self.schedule or LrSchedule(self.max_steps, self.warmup_ratio, self.min_lr_ratio)

    @classmethod
    def from_keys(cls, train, max_steps: int) -> "OptimConfig":
        """From the train section (dspark.schema.TrainKeys) and trainer.max_steps."""
        return cls(lr=float(train.lr), weight_decay=float(train.weight_decay), betas=tuple(train.betas),
                   warmup_ratio=float(train.warmup_ratio), min_lr_ratio=float(train.min_lr_ratio),
                   max_steps=int(max_steps))


def _numpy_state_to_plain(state) -> dict:
    """numpy's RNG state with tensors instead of arrays, so checkpoints load with weights_only=True."""
    name, keys, pos, has_gauss, cached = state
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _numpy_state_from_plain(d: dict):
    return (d["name"], d["keys"].numpy().astype(np.uint32), d["pos"], d["has_gauss"], d["cached_gaussian"])


def is_distributed() -> bool:
    """Whether this process is one of several ranks (DDP)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class GradientCoverage:
    """Which trainable parameters received a gradient during one backward (post-accumulate-grad hooks).

    Under DDP every rank must reduce the same gradient buckets in every synchronised backward. A parameter that
    one rank leaves out of its autograd graph (a data-dependent branch: an expert no token chose, a step with no
    labelled row) keeps that rank from launching the bucket holding it while the others wait for it: the ranks
    deadlock, one in backward and one at the next collective. DraftLightningModule arms this under DDP and turns
    such a step into an error naming the parameters, raised on the rank that left them out."""

    def __init__(self, named_parameters):
        self.names = [n for n, p in named_parameters if p.requires_grad]
        self.seen: set[str] = set()
        self._handles = []
        for name, p in named_parameters:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(lambda _p, n=name: self.seen.add(n)))

    def reset(self) -> None:
        self.seen.clear()

    def missing(self) -> list[str]:
        return [n for n in self.names if n not in self.seen]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def uncovered_gradients_error(missing: list[str], rank: int) -> RuntimeError:
    shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
    return RuntimeError(
        f"rank {rank}: {len(missing)} trainable parameter(s) got no gradient in this step's backward ({shown}); "
        "the other ranks would wait for their gradient bucket forever (DDP deadlock). A forward that depends on "
        "the data must still use every trainable parameter (an empty piece gives a zero gradient)")


class DraftLightningModule(L.LightningModule):
    """Shared by every objective. A subclass implements

        losses(batch) -> {"loss", parts and metrics}     one training / validation forward
        validation_sums(batch) -> {name: tensor}          sums accumulated over the held-out batches (and ranks)
        validation_metrics(sums) -> {"val/...": tensor}   the logged held-out metrics
        TRAIN_LOGGED                                     the loss parts logged as train/<name>
    """

    TRAIN_LOGGED: tuple[str, ...] = ()

    def __init__(self, draft: torch.nn.Module, target: FrozenTarget, optim: OptimConfig = OptimConfig()):
        super().__init__()
        self.draft = draft
        self.__dict__["target"] = target  # not a submodule: never optimised, never checkpointed
        self.optim = optim
        self._val: dict[str, torch.Tensor] = {}

    # ---- target placement -------------------------------------------------------------------------
    def _attach_target(self) -> None:
        if self.target.device != self.device:
            self.target.to(self.device)
        self.draft.share_target_weights(self.target.embed_weight, self.target.lm_head_weight)

    def on_fit_start(self) -> None:
        self._attach_target()
        self._coverage = None
        from lightning.pytorch.strategies import DDPStrategy

        trainer = self._trainer
        if trainer is None:  # driven without a Trainer (benchmarks/bench_step.py): one process, nothing to guard
            return
        strategy = trainer.strategy
        if (isinstance(strategy, DDPStrategy) and trainer.world_size > 1
                and not getattr(strategy, "_ddp_kwargs", {}).get("find_unused_parameters")):  # (that DDP copes)
            self._coverage = GradientCoverage(list(self.draft.named_parameters()))

    def on_fit_end(self) -> None:
        if getattr(self, "_coverage", None) is not None:
            self._coverage.remove()
            self._coverage = None

    # ---- every rank's backward covers the same parameters (GradientCoverage) ----------------------
    def on_before_backward(self, loss: torch.Tensor) -> None:
        if getattr(self, "_coverage", None) is not None:
            self._coverage.reset()

    def on_after_backward(self) -> None:
        coverage = getattr(self, "_coverage", None)
        if coverage is None or self.trainer.fit_loop.epoch_loop._should_accumulate():
            return  # (a no_sync micro-batch reduces nothing)
        missing = coverage.missing()
        if missing:
            raise uncovered_gradients_error(missing, self.global_rank)

    def on_validation_start(self) -> None:
        self._attach_target()

    # ---- sharded training (trainer=fsdp2, dspark.training.sharding) --------------------------------
    def configure_model(self) -> None:
        """Under ModelParallelStrategy (FSDP2): fully_shard the draft over the data-parallel mesh, once. The
        target is not a submodule, so it stays whole and out of the optimizer."""
        mesh = self.device_mesh
        if mesh is None or self.__dict__.get("_runner") is not None:
            return
        self.__dict__["_runner"] = shard_draft(self.draft, mesh["data_parallel"])  # not a submodule either

    def _run(self, fn):
        """fn() inside the FSDP unit when sharded (parameters gathered, gradients reduce-scattered), else fn()."""
        runner = self.__dict__.get("_runner")
        return fn() if runner is None else runner(fn)

    # ---- target features: one reader for every objective --------------------------------------------
    def features(self, batch: dict[str, torch.Tensor]) -> TargetFeatures:
        """The target's features of the batch: from the batch when the offline cache supplied them (aux [B, S, n*H],
        final [B, S, H], in the target's dtype), else the target's forward (with the last layer's raw output when
        the draft reads it, `draft.needs_pre_head`)."""
        pre_head = bool(optional(self.draft, "needs_pre_head"))
        if "final" in batch:
            if pre_head:
                raise ValueError("data.feature_cache: the cache holds no pre-hc_head stream, which this draft reads; "
                                 "set data.feature_cache=null")
            dtype = self.target.embed_weight.dtype
            return TargetFeatures(aux=batch["aux"].to(dtype), final=batch["final"].to(dtype))
        return self.target.features(batch["input_ids"], batch["attention_mask"], pre_head=pre_head)

    @torch.no_grad()
    def measure_target(self, batch: dict[str, torch.Tensor], max_positions: int = 128) -> dict | None:
        """The target's next-token distribution at up to `max_positions` held-out loss positions of `batch` (is it
        near-uniform, or one repeated token? dspark.targets.health); None when the batch has no loss position."""
        final = self.features(batch).final  # [B, S, H]
        predicts = (batch["loss_mask"] * batch["attention_mask"])[:, 1:].bool()  # position t predicts token t+1
        rows = final[:, :-1][predicts][:max_positions]  # [N, H]
        return distribution_health(self.target.logits_from_final(rows)) if rows.shape[0] else None

    # ---- the objective -----------------------------------------------------------------------------
    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def training_losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The training step's losses (an objective may skip metrics on steps the logger does not write)."""
        return self.losses(batch)

    def validation_sums(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def validation_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    # ---- steps -----------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        out = self._run(lambda: self.training_losses(batch))
        bs = batch["input_ids"].shape[0]
        # Under DDP / FSDP each rank's loss parts are its share over the global normaliser (/ world size), so their
        # mean over ranks is the one-process value: logged as that (sync_dist), not as rank 0's share.
        sync = is_distributed()
        for k in self.TRAIN_LOGGED:
            if k in out:
                self.log(f"train/{k}", out[k].detach(), prog_bar=k in ("loss", "tau_prob"), batch_size=bs,
                         sync_dist=sync)
        if "agree_count" in out:
            self.log("train/agree", out["agree_count"].sum() / out["agree_total"].sum().clamp_min(1), batch_size=bs)
        self.log("train/tokens", float(batch["attention_mask"].sum()), reduce_fx="sum", batch_size=bs)
        return out["loss"]

    def on_validation_epoch_start(self) -> None:
        self._val = {}

    def validation_step(self, batch, batch_idx):
        if getattr(self, "target_health", None) is None:  # once per run (dspark.targets.health)
            self.target_health = self.measure_target(batch)
        for key, value in self._run(lambda: self.validation_sums(batch)).items():
            v = value.detach().double()
            self._val[key] = self._val[key] + v if key in self._val else v

    def on_validation_epoch_end(self) -> None:
        """The held-out sums reduced over ranks (in place, under DDP), turned into metrics, logged and kept in
        last_val_metrics."""
        if not self._val:
            return
        if dist.is_available() and dist.is_initialized():
            for v in self._val.values():
                dist.all_reduce(v)
        metrics = self.validation_metrics(self._val)
        for k, v in metrics.items():
            self.log(k, v.float(), prog_bar=k == "val/tau_prob", sync_dist=False, rank_zero_only=False)
        self.last_val_metrics = {k: float(v) for k, v in metrics.items()}

    @staticmethod
    def agreement(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """val/agree_k (top-1 agreement with the teacher at draft position k) and val/agree from the summed
        agree_count / agree_total [g]."""
        count, total = sums["agree_count"], sums["agree_total"]
        metrics = {f"val/agree_{k}": v for k, v in enumerate(count / total.clamp_min(1))}
        metrics["val/agree"] = count.sum() / total.sum().clamp_min(1)
        return metrics

    # ---- optimisation ---------------------------------------------------------------------------
    def configure_optimizers(self):
        params = [p for p in self.draft.parameters() if p.requires_grad]
        # fused: one pass per parameter instead of foreach's ~10 (on one CPU core 0.02 s against 0.12 s per step
        # for the 25 M parameters of dspark_smollm2); the same update within float32 rounding
        fused = bool(params) and all(p.device.type in ("cpu", "cuda") for p in params)
        opt = torch.optim.AdamW(params, lr=self.optim.lr, weight_decay=self.optim.weight_decay,
                                betas=tuple(self.optim.betas), fused=fused)
        # A fused AdamW says it can take a GradScaler's scale inside its step; Lightning's mixed-precision plugin then
        # refuses gradient clipping (it would clip still-scaled gradients). The scaler unscales before the step
        # instead (its path for every other optimizer; bf16 uses no scaler at all), so clipping stays correct.
        opt._step_supports_amp_scaling = False
        o = self.optim  # read at every step: a resume sets its schedule (on_load_checkpoint) before the first
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: o.lr_schedule().multiplier(s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---- checkpoint: RNG state travels with the weights ------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[LR_SCHEDULE_KEY] = self.optim.lr_schedule().record()  # an extension's schedule resumes as it was
        checkpoint["rng"] = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": _numpy_state_to_plain(np.random.get_state()),
            "python": random.getstate(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        o = self.optim  # this run's values (dspark.training.resume refused any change not in resume_override)
        # another trainer.max_steps continues the decay from the resume step (dspark.training.schedule)
        o.schedule = resumed_schedule(checkpoint, int(checkpoint.get("global_step") or 0), o.max_steps,
                                      o.warmup_ratio, o.min_lr_ratio)
        multiplier = o.schedule.multiplier
        rewrite_optimizer_state(checkpoint, o.lr, o.weight_decay, o.betas, multiplier)
        if "optimizer_states" not in checkpoint and self._trainer is not None:
            # a sharded checkpoint (trainer=fsdp2): the strategy loaded the optimizers in place already, with the
            # lr of the schedule they were saved under (trainer.max_steps may have changed): rewrite them live
            step = int(((checkpoint.get("lr_schedulers") or [{}])[0]).get("last_epoch", 0))
            for opt in self.trainer.optimizers:
                for group in opt.param_groups:
                    group.update(initial_lr=o.lr, lr=o.lr * multiplier(step), weight_decay=o.weight_decay,
                                 betas=tuple(o.betas))
        rng = checkpoint.get("rng")
        if not rng:
            return
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        np.random.set_state(_numpy_state_from_plain(rng["numpy"]))
        random.setstate(rng["python"])
