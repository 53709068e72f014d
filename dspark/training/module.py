"""LightningModule: one training step = target features -> packed blocks -> draft -> DSpark losses."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import lightning as L
import numpy as np
import torch
import torch.distributed as dist

from dspark.targets.hf_target import FrozenTarget
from dspark.training.blocks import Blocks, block_attention_mask, build_blocks
from dspark.training.objectives import LossWeights, draft_losses, draft_losses_fused, position_weights


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


@dataclass
class DraftOutputs:
    logits: torch.Tensor  # [B, A, g, V] Markov-corrected draft logits (teacher-forced prev)
    conf_logits: torch.Tensor | None  # [B, A, g]
    hidden: torch.Tensor  # [B, A, g, H] backbone output at the prediction rows (before the Markov head)
    blocks: Blocks
    final: torch.Tensor  # [B, S, H] target final hidden (teacher rows are gathered from it)


def lm_head_input(draft: torch.nn.Module, h: torch.Tensor | None) -> torch.Tensor | None:
    """The rows the draft feeds its (shared, frozen) LM head: base_logits(h) == lm_head(norm(h)) for the
    DSpark drafts here. None when the draft's logits are not of that form (the unfused loss is used);
    h=None only asks whether the draft qualifies."""
    from dspark.models.dspark_dense import DSparkDenseDraft
    from dspark.models.dspark_v4 import DSparkV4Draft

    if not isinstance(draft, (DSparkV4Draft, DSparkDenseDraft)):
        return None
    return draft.norm if h is None else draft.norm(h)


def _numpy_state_to_plain(state) -> dict:
    """numpy's RNG state with tensors instead of arrays, so checkpoints load with weights_only=True."""
    name, keys, pos, has_gauss, cached = state
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _numpy_state_from_plain(d: dict):
    return (d["name"], d["keys"].numpy().astype(np.uint32), d["pos"], d["has_gauss"], d["cached_gaussian"])


class DraftLightningModule(L.LightningModule):
    def __init__(self, draft: torch.nn.Module, target: FrozenTarget, *, num_drafts: int, mask_token_id: int,
                 layout: str = "anchor", window: int | None = None, decay_gamma: float | None = 4.0,
                 loss_weights: LossWeights = LossWeights(), optim: OptimConfig = OptimConfig(),
                 fused_loss: bool = True):
        super().__init__()
        self.draft = draft
        self.__dict__["target"] = target  # not a submodule: never optimised, never checkpointed
        self.num_drafts, self.mask_token_id, self.layout = num_drafts, mask_token_id, layout
        self.window, self.decay_gamma = window, decay_gamma
        self.loss_weights, self.optim = loss_weights, optim
        self.fused_loss = fused_loss  # losses from hidden rows (dspark.ops.fused_loss) when the draft allows
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

    # ---- forward ----------------------------------------------------------------------------------
    def _target_features(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached features from the batch (offline cache) when present, else the target's forward.
        -> aux [B, S, n*H], final [B, S, H] in the target's dtype."""
        if "aux" in batch:
            dtype = self.target.embed_weight.dtype
            return batch["aux"].to(dtype), batch["final"].to(dtype)
        feats = self.target.features(batch["input_ids"], batch["attention_mask"])
        return feats.aux, feats.final

    def _draft_hidden(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Blocks, torch.Tensor]:
        """-> (h [B, A, g, H] backbone output at the prediction rows, blocks, target final [B, S, H])."""
        ids, am = batch["input_ids"], batch["attention_mask"]  # [B, S]
        B, S = ids.shape
        aux, final = self._target_features(batch)  # [B, S, n*H], [B, S, H]
        blocks = build_blocks(ids, batch["loss_mask"], batch["anchors"], batch["keep"], self.num_drafts,
                              self.mask_token_id, self.layout)
        A, Lb = blocks.input_ids.shape[1:]
        g = self.num_drafts
        draft = self.draft
        main_x = draft.combine(aux)  # [B, S, H]
        ctx_pos = torch.arange(S, device=ids.device).expand(B, S)
        ctx = draft.context_kv(main_x, ctx_pos)
        mask = block_attention_mask(batch["anchors"], Lb, S, self.window)  # [B, A*Lb, S + A*Lb]
        h = draft.backbone(blocks.input_ids.flatten(1), blocks.positions.flatten(1), ctx, mask)  # [B, A*Lb, H]
        h = h.view(B, A, Lb, -1)[:, :, blocks.pred_offset : blocks.pred_offset + g]  # [B, A, g, H]
        return h, blocks, final

    def draft_outputs(self, batch: dict[str, torch.Tensor]) -> DraftOutputs:
        h, blocks, final = self._draft_hidden(batch)
        draft = self.draft
        logits = draft.base_logits(h)  # [B, A, g, V]
        feat = None
        if getattr(draft, "markov_head", None) is not None:
            bias, feat = draft.markov_head(blocks.prev_ids, h)
            logits = logits + bias
        conf = draft.confidence_logit(h, feat) if getattr(draft, "confidence_head", None) is not None else None
        return DraftOutputs(logits=logits, conf_logits=conf, hidden=h, blocks=blocks, final=final)

    def _teacher_rows(self, final: torch.Tensor, b: Blocks) -> torch.Tensor:
        """Target final hidden at the teacher positions: [B, S, H] -> [B, A, g, H]."""
        H = final.shape[-1]
        rows = torch.gather(final, 1, b.teacher_positions.flatten(1).unsqueeze(-1).expand(-1, -1, H))
        return rows.view(*b.labels.shape, H)

    def _losses(self, batch) -> tuple[dict[str, torch.Tensor], Blocks]:
        if self.fused_loss and lm_head_input(self.draft, None) is not None:
            return self._losses_fused(batch)
        out = self.draft_outputs(batch)
        b = out.blocks
        teacher = self.target.logits_from_final(self._teacher_rows(out.final, b))  # [B, A, g, V]
        eval_mask = b.eval_mask.flatten(0, 1)  # [B*A, g]
        flat = lambda t: None if t is None else t.flatten(0, 1)  # noqa: E731  [B, A, ...] -> [B*A, ...]
        losses = draft_losses(
            flat(out.logits), flat(b.labels), eval_mask, flat(teacher), flat(out.conf_logits),
            decay_gamma=self.decay_gamma, weights=self.loss_weights,
            normalizer=self._global_normalizer(eval_mask) if self.training else None,
        )
        return losses, b

    def _losses_fused(self, batch) -> tuple[dict[str, torch.Tensor], Blocks]:
        """The same losses through the fused LM loss (dspark.ops.fused_loss): no [B, A, g, V] logits."""
        h, b, final = self._draft_hidden(batch)
        draft = self.draft
        head = getattr(draft, "markov_head", None)
        latent = feat = None
        if head is not None:
            latent, feat = head.latent(b.prev_ids, h)  # [B, A, g, r] x2
        conf = draft.confidence_logit(h, feat) if getattr(draft, "confidence_head", None) is not None else None
        eval_mask = b.eval_mask.flatten(0, 1)  # [B*A, g]
        flat = lambda t: None if t is None else t.flatten(0, 1)  # noqa: E731  [B, A, ...] -> [B*A, ...]
        losses = draft_losses_fused(
            flat(lm_head_input(draft, h)), flat(self._teacher_rows(final, b)), self.target.lm_head_weight,
            flat(latent), None if head is None else head.markov_w2.weight, flat(b.labels), eval_mask,
            flat(conf), decay_gamma=self.decay_gamma, weights=self.loss_weights,
            normalizer=self._global_normalizer(eval_mask) if self.training else None,
        )
        return losses, b

    def _global_normalizer(self, eval_mask: torch.Tensor) -> torch.Tensor | None:
        """Sum of loss weights over all ranks / world size, so DDP optimises the single-process loss."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        total = position_weights(eval_mask, self.decay_gamma).sum()
        dist.all_reduce(total)
        return total / dist.get_world_size()

    # ---- steps -----------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        out, _ = self._losses(batch)
        bs = batch["input_ids"].shape[0]
        for k in ("loss", "ce", "l1", "conf", "tau_prob"):
            if k in out:
                self.log(f"train/{k}", out[k].detach(), prog_bar=k in ("loss", "tau_prob"), batch_size=bs)
        if "agree_total" in out:
            agree = out["agree_count"].sum() / out["agree_total"].sum().clamp_min(1)
            self.log("train/agree", agree, batch_size=bs)
        self.log("train/tokens", float(batch["attention_mask"].sum()), reduce_fx="sum", batch_size=bs)
        return out["loss"]

    def on_validation_epoch_start(self) -> None:
        self._val = {}

    def _acc(self, key: str, value: torch.Tensor) -> None:
        v = value.detach().double()
        self._val[key] = self._val[key] + v if key in self._val else v

    def validation_step(self, batch, batch_idx):
        out, b = self._losses(batch)
        em = b.eval_mask.flatten(0, 1)
        wsum = position_weights(em, self.decay_gamma).sum()
        nblocks = em[:, 0].sum()
        self._acc("wsum", wsum)
        self._acc("nblocks", nblocks)
        for k in ("loss", "ce", "l1", "conf"):
            if k in out:
                self._acc(k, out[k] * wsum)
        if "tau_prob" in out:
            self._acc("tau_prob", out["tau_prob"] * nblocks)
            self._acc("agree_count", out["agree_count"])
            self._acc("agree_total", out["agree_total"])

    def _reduced_val(self) -> dict[str, torch.Tensor] | None:
        """The validation accumulators summed over ranks (in place, under DDP); None when nothing was accumulated."""
        acc = self._val
        if not acc:
            return None
        if dist.is_available() and dist.is_initialized():
            for v in acc.values():
                dist.all_reduce(v)
        return acc

    def _publish_val(self, metrics: dict[str, torch.Tensor]) -> None:
        """Log the (already rank-reduced) validation metrics and keep them in last_val_metrics."""
        for k, v in metrics.items():
            self.log(k, v.float(), prog_bar=k == "val/tau_prob", sync_dist=False, rank_zero_only=False)
        self.last_val_metrics = {k: float(v) for k, v in metrics.items()}

    def on_validation_epoch_end(self) -> None:
        acc = self._reduced_val()
        if acc is None:
            return
        metrics = {}
        for k in ("loss", "ce", "l1", "conf"):
            if k in acc:
                metrics[f"val/{k}"] = acc[k] / acc["wsum"].clamp_min(1e-12)
        if "tau_prob" in acc:
            metrics["val/tau_prob"] = acc["tau_prob"] / acc["nblocks"].clamp_min(1)
            per_pos = acc["agree_count"] / acc["agree_total"].clamp_min(1)
            for k, v in enumerate(per_pos):
                metrics[f"val/agree_{k}"] = v
            metrics["val/agree"] = acc["agree_count"].sum() / acc["agree_total"].sum().clamp_min(1)
        self._publish_val(metrics)

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
