"""The MTP drafts' objective: target features -> the served chain, teacher-forced for K steps -> CE + KL losses.

Validation logs val/loss, val/ce, val/kl, val/ce_k, val/kl_k, val/tau_prob, val/l1, val/agree_k and val/agree with
the DSpark module's definitions (every position an anchor, steps as draft positions).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from dspark.errors import ConfigError
from dspark.targets.hf_target import FrozenTarget
from dspark.training.module import DraftLightningModule, OptimConfig, is_distributed
from dspark.training.mtp_objectives import MTPLossWeights, mtp_losses, recursive_forward

_VAL_MEANS = ("loss", "ce", "kl", "tau_prob")  # + ce_k / kl_k: means over the rows scored at step 0


class MTPDraftModule(DraftLightningModule):
    TRAIN_LOGGED = ("loss", "ce", "kl", "tau_prob", "l1")

    def __init__(self, draft: torch.nn.Module, target: FrozenTarget, *, beta: float = 0.6,
                 loss_weights: MTPLossWeights = MTPLossWeights(), optim: OptimConfig = OptimConfig()):
        super().__init__(draft, target, optim)
        self.num_steps, self.beta, self.mtp_weights = int(draft.config.num_steps), float(beta), loss_weights

    @classmethod
    def from_config(cls, train: DictConfig, draft, target: FrozenTarget, optim: OptimConfig) -> "MTPDraftModule":
        """train.mtp_beta (step weights beta^k, default 0.6) and train.mtp_loss_weights ({ce, kl}, default the
        MTPLossWeights defaults)."""
        beta = float(train.get("mtp_beta", 0.6))
        if not beta > 0:
            raise ConfigError(f"train.mtp_beta: must be > 0, got {beta}")
        raw = OmegaConf.to_container(train.mtp_loss_weights) if train.get("mtp_loss_weights") is not None else {}
        unknown = sorted(set(raw) - {"ce", "kl"})
        if unknown:
            raise ConfigError(f"train.mtp_loss_weights: unknown keys {unknown} (ce, kl)")
        lw = MTPLossWeights(**{k: float(v) for k, v in raw.items()})
        if not (lw.ce >= 0 and lw.kl >= 0 and lw.ce + lw.kl > 0):
            raise ConfigError(f"train.mtp_loss_weights: weights must be >= 0 and not both 0, got {raw}")
        return cls(draft, target, beta=beta, loss_weights=lw, optim=optim)

    def losses(self, batch, metrics: bool = True) -> dict[str, torch.Tensor]:
        ids, lm = batch["input_ids"], batch["loss_mask"] * batch["attention_mask"]  # [B, S]
        feats = self.features(batch)
        steps = recursive_forward(self.draft, self.draft.context_hidden(feats), ids, lm, feats.final, self.num_steps)
        teacher = [self.target.logits_from_final(st.teacher_final) for st in steps]  # [N_k, V] each
        return mtp_losses(steps, teacher, num_steps=self.num_steps, beta=self.beta, weights=self.mtp_weights,
                          batch_rows=(ids.shape[0], max(ids.shape[1] - 2, 0)), metrics=metrics,
                          row_normalizers=self._global_rows(steps) if self.training else None)

    def training_losses(self, batch) -> dict[str, torch.Tensor]:
        """The vocabulary-sized metrics only on the steps the logger writes."""
        every = int(getattr(self.trainer, "log_every_n_steps", 1) or 1) if self._trainer is not None else 1
        return self.losses(batch, metrics=(self.global_step + 1) % every == 0)

    def _global_rows(self, steps) -> torch.Tensor | None:
        """Scored rows per step summed over ranks / world size (None in one process): DDP then optimises
        exactly the single-process objective (see BlockDraftModule._global_normalizer)."""
        if not is_distributed():
            return None
        counts = torch.tensor([float(st.labels.numel()) for st in steps], device=steps[0].logits.device)  # [K]
        dist.all_reduce(counts)
        return counts / dist.get_world_size()

    # ---- validation ------------------------------------------------------------------------------
    def validation_sums(self, batch) -> dict[str, torch.Tensor]:
        out = self.losses(batch)
        rows = out["rows"]  # rows scored at step 0: the weight of this batch's means
        sums = {"rows": rows}
        sums.update({k: v.detach() * rows for k, v in out.items() if k in _VAL_MEANS or k.startswith(("ce_", "kl_"))})
        sums.update(l1_sum=out["l1"] * out["agree_total"].sum(), agree_count=out["agree_count"],
                    agree_total=out["agree_total"])
        return sums

    def validation_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows = sums["rows"].clamp_min(1)
        metrics = {f"val/{k}": v / rows for k, v in sums.items() if k in _VAL_MEANS or k.startswith(("ce_", "kl_"))}
        metrics["val/l1"] = sums["l1_sum"] / sums["agree_total"].sum().clamp_min(1)
        metrics.update(self.agreement(sums))
        return metrics
