"""The LightningModule every draft family trains on: target placement, target features, AdamW + warmup-cosine,
RNG in checkpoints, train / validation logging. A family's objective (dspark.models.registry `Family.objective`)
is a subclass that computes its losses (dspark.training.block_module: DSpark / DFlash blocks;
dspark.training.mtp_module: the MTP chain); dspark.training.modules maps objective names to them."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import lightning as L
import numpy as np
import torch
import torch.distributed as dist

from dspark.targets.hf_target import FrozenTarget, TargetFeatures


@dataclass
class OptimConfig:
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    max_steps: int = 100


def warmup_cosine(step: int, max_steps: int, warmup_ratio: float, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup over ceil(warmup_ratio*max_steps) steps, then cosine to min_lr_ratio."""
    warm = max(1, math.ceil(warmup_ratio * max_steps))
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, max_steps - warm))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


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

    def on_validation_start(self) -> None:
        self._attach_target()

    # ---- target features: one reader for every objective --------------------------------------------
    def features(self, batch: dict[str, torch.Tensor]) -> TargetFeatures:
        """The target's features of the batch: from the batch when the offline cache supplied them (aux [B, S, n*H],
        final [B, S, H], in the target's dtype), else the target's forward (with the last layer's raw output when
        the draft reads it, `draft.needs_pre_head`)."""
        pre_head = bool(getattr(self.draft, "needs_pre_head", False))
        if "final" in batch:
            if pre_head:
                raise ValueError("data.feature_cache: the cache holds no pre-hc_head stream, which this draft reads; "
                                 "set data.feature_cache=null")
            dtype = self.target.embed_weight.dtype
            return TargetFeatures(aux=batch["aux"].to(dtype), final=batch["final"].to(dtype))
        return self.target.features(batch["input_ids"], batch["attention_mask"], pre_head=pre_head)

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
        out = self.training_losses(batch)
        bs = batch["input_ids"].shape[0]
        for k in self.TRAIN_LOGGED:
            if k in out:
                self.log(f"train/{k}", out[k].detach(), prog_bar=k in ("loss", "tau_prob"), batch_size=bs)
        if "agree_count" in out:
            self.log("train/agree", out["agree_count"].sum() / out["agree_total"].sum().clamp_min(1), batch_size=bs)
        self.log("train/tokens", float(batch["attention_mask"].sum()), reduce_fx="sum", batch_size=bs)
        return out["loss"]

    def on_validation_epoch_start(self) -> None:
        self._val = {}

    def validation_step(self, batch, batch_idx):
        for key, value in self.validation_sums(batch).items():
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
        opt = torch.optim.AdamW(params, lr=self.optim.lr, weight_decay=self.optim.weight_decay,
                                betas=tuple(self.optim.betas))
        o = self.optim
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: warmup_cosine(s, o.max_steps, o.warmup_ratio, o.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---- checkpoint: RNG state travels with the weights ------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["rng"] = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": _numpy_state_to_plain(np.random.get_state()),
            "python": random.getstate(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        rng = checkpoint.get("rng")
        if not rng:
            return
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        np.random.set_state(_numpy_state_from_plain(rng["numpy"]))
        random.setstate(rng["python"])
