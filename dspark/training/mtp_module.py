"""LightningModule for MTP drafts: target features -> recursive K-step teacher forcing -> CE + KL losses.

Extends DraftLightningModule (target placement, optimiser + warmup-cosine schedule, RNG in checkpoints,
the same data module and run_training); only the forward, the losses and the logged metrics differ.
Validation logs val/loss, val/ce, val/kl, val/ce_k, val/kl_k, val/tau_prob, val/l1, val/agree_k and
val/agree with the DSpark module's definitions (every position an anchor, steps as draft positions).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dspark.targets.hf_target import FrozenTarget
from dspark.training.module import DraftLightningModule, OptimConfig
from dspark.training.mtp_objectives import MTPLossWeights, mtp_losses, recursive_forward


class MTPLightningModule(DraftLightningModule):
    def __init__(self, draft: torch.nn.Module, target: FrozenTarget, *, num_steps: int, beta: float = 0.6,
                 loss_weights: MTPLossWeights = MTPLossWeights(), optim: OptimConfig = OptimConfig()):
        super().__init__(draft, target, num_drafts=num_steps, mask_token_id=-1, optim=optim)
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.num_steps, self.beta, self.mtp_weights = int(num_steps), float(beta), loss_weights
        self.needs_pre_head = bool(getattr(draft, "needs_pre_head", False))

    def _features(self, batch: dict[str, torch.Tensor]):
        if "final" in batch:  # offline cache: it stores aux + final only
            if self.needs_pre_head:
                raise ValueError("data.feature_cache: the cache holds no pre-hc_head stream, which this MTP draft "
                                 "reads; set data.feature_cache=null")
            from dspark.targets.hf_target import TargetFeatures

            dtype = self.target.embed_weight.dtype
            return TargetFeatures(aux=batch["aux"].to(dtype), final=batch["final"].to(dtype))
        return self.target.features(batch["input_ids"], batch["attention_mask"], pre_head=self.needs_pre_head)

    def _mtp_losses(self, batch, metrics: bool = True) -> dict[str, torch.Tensor]:
        ids, lm = batch["input_ids"], batch["loss_mask"] * batch["attention_mask"]  # [B, S]
        feats = self._features(batch)
        steps = recursive_forward(self.draft, self.draft.context_hidden(feats), ids, lm, feats.final, self.num_steps)
        teacher = [self.target.logits_from_final(st.teacher_final) for st in steps]  # [N_k, V] each
        return mtp_losses(steps, teacher, num_steps=self.num_steps, beta=self.beta, weights=self.mtp_weights,
                          batch_rows=(ids.shape[0], max(ids.shape[1] - 2, 0)), metrics=metrics,
                          row_normalizers=self._global_rows(steps) if self.training else None)

    def _global_rows(self, steps) -> torch.Tensor | None:
        """Scored rows per step summed over ranks / world size (None in one process): DDP then optimises
        exactly the single-process objective (see DraftLightningModule._global_normalizer)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        counts = torch.tensor([float(st.labels.numel()) for st in steps], device=steps[0].logits.device)  # [K]
        dist.all_reduce(counts)
        return counts / dist.get_world_size()

    # ---- steps -----------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        # the vocabulary-sized metrics only on the steps the logger writes
        every = int(getattr(self.trainer, "log_every_n_steps", 1) or 1) if self._trainer is not None else 1
        out = self._mtp_losses(batch, metrics=(self.global_step + 1) % every == 0)
        bs = batch["input_ids"].shape[0]
        for k in ("loss", "ce", "kl", "tau_prob", "l1"):
            if k in out:
                self.log(f"train/{k}", out[k].detach(), prog_bar=k in ("loss", "tau_prob"), batch_size=bs)
        if "agree_count" in out:
            self.log("train/agree", out["agree_count"].sum() / out["agree_total"].sum().clamp_min(1), batch_size=bs)
        self.log("train/tokens", float(batch["attention_mask"].sum()), reduce_fx="sum", batch_size=bs)
        return out["loss"]

    def validation_step(self, batch, batch_idx):
        out = self._mtp_losses(batch)
        rows = out["rows"]  # rows scored at step 0: the weight of this batch's means
        self._acc("rows", rows)
        for k, v in out.items():
            if k in ("loss", "ce", "kl", "tau_prob") or k.startswith(("ce_", "kl_")):
                self._acc(k, v.detach() * rows)
        self._acc("l1_sum", out["l1"] * out["agree_total"].sum())
        self._acc("agree_count", out["agree_count"])
        self._acc("agree_total", out["agree_total"])

    def on_validation_epoch_end(self) -> None:
        acc = self._reduced_val()
        if acc is None:
            return
        rows = acc["rows"].clamp_min(1)
        metrics = {f"val/{k}": v / rows for k, v in acc.items()
                   if k in ("loss", "ce", "kl", "tau_prob") or k.startswith(("ce_", "kl_"))}
        total = acc["agree_total"]
        metrics["val/l1"] = acc["l1_sum"] / total.sum().clamp_min(1)
        for k, v in enumerate(acc["agree_count"] / total.clamp_min(1)):
            metrics[f"val/agree_{k}"] = v
        metrics["val/agree"] = acc["agree_count"].sum() / total.sum().clamp_min(1)
        self._publish_val(metrics)
