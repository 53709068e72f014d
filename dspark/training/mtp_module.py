"""The MTP drafts' objective: target features -> the served chain, teacher-forced for K steps -> CE + KL losses.

Validation logs val/loss, val/ce, val/kl, val/ce_k, val/kl_k, val/tau_prob, val/l1, val/agree_k and val/agree with
the DSpark module's definitions (every position an anchor, steps as draft positions).
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from dspark.models.contract import optional
from dspark.objective_keys import MTPKeys
from dspark.ops.lm_head import lm_head_logits
from dspark.targets.hf_target import FrozenTarget
from dspark.training.module import DraftLightningModule, OptimConfig, is_distributed
from dspark.training.mtp_objectives import MTPLossWeights, mtp_losses, recursive_forward

_VAL_MEANS = ("loss", "ce", "kl", "tau_prob")  # + ce_k / kl_k: means over the rows scored at step 0


class MTPDraftModule(DraftLightningModule):
    KEYS = MTPKeys
    TRAIN_LOGGED = ("loss", "ce", "kl", "tau_prob", "l1")

    def __init__(self, draft: torch.nn.Module, target: FrozenTarget, *, beta: float = 0.6,
                 loss_weights: MTPLossWeights = MTPLossWeights(), optim: OptimConfig = OptimConfig()):
        super().__init__(draft, target, optim)
        self.num_steps, self.beta, self.mtp_weights = int(draft.config.num_steps), float(beta), loss_weights

    @classmethod
    def from_config(cls, keys: MTPKeys, draft, target: FrozenTarget, optim: OptimConfig) -> "MTPDraftModule":
        """The module from its train.* keys (checked by dspark.schema before any model loads)."""
        weights = MTPLossWeights(**{k: float(v) for k, v in keys.mtp_loss_weights.items()})
        return cls(draft, target, beta=float(keys.mtp_beta), loss_weights=weights, optim=optim)

    def losses(self, batch, metrics: bool = True) -> dict[str, torch.Tensor]:
        ids, lm = batch["input_ids"], batch["loss_mask"] * batch["attention_mask"]  # [B, S]
        feats = self.features(batch)
        if optional(self.draft, "reduced_vocab"):
            return self._reduced_vocab_losses(ids, lm, feats, metrics)
        steps = recursive_forward(self.draft, self.draft.context_hidden(feats), ids, lm, feats.final, self.num_steps)
        teacher = [self.target.logits_from_final(st.teacher_final) for st in steps]  # [N_k, V] each
        return _chain_losses(self, ids, steps, teacher, metrics)

    def _reduced_vocab_losses(self, ids, lm, feats, metrics: bool) -> dict[str, torch.Tensor]:
        """A draft scoring Vd of the V target ids (EAGLE-3's d2t / t2d): its logits over its Vd columns, the teacher
        the target's logits at those columns (so softmax renormalises the target over the draft vocabulary, as
        EAGLE-3 trains: speculators 0.9.0 eagle3/core.py:249-254, losses/eager.py:11-30), labels as draft ids (-1
        outside: no CE term). Only the Vd LM-head rows are multiplied, for the draft and for the teacher."""
        draft = self.draft
        cols = draft.draft_to_target()  # [Vd]
        steps = recursive_forward(draft, draft.context_hidden(feats), ids, lm, feats.final, self.num_steps,
                                  logits_fn=lambda rows, k: draft.draft_logits(rows))
        w = self.target.lm_head_weight.index_select(0, cols)  # [Vd, H]
        to_draft = draft.target_to_draft()  # [V], -1 outside
        for st in steps:
            st.labels = to_draft[st.labels]
        teacher = [lm_head_logits(st.teacher_final, w, self.target.head_fp32) for st in steps]  # [N_k, Vd] each
        return _chain_losses(self, ids, steps, teacher, metrics)

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


def _chain_losses(module: MTPDraftModule, ids: torch.Tensor, steps, teacher: list[torch.Tensor],
                  metrics: bool) -> dict[str, torch.Tensor]:
    """The MTP objective over a teacher-forced chain's steps and the teacher's logits at each ([N_k, V or Vd]),
    with the module's step weights and loss weights; DDP's global row counts in training."""
    return mtp_losses(steps, teacher, num_steps=module.num_steps, beta=module.beta, weights=module.mtp_weights,
                      batch_rows=(ids.shape[0], max(ids.shape[1] - 2, 0)), metrics=metrics,
                      row_normalizers=module._global_rows(steps) if module.training else None)
