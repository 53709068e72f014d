"""The block drafts' objective (DSpark / DFlash, docs/CONTRACTS.md §3): target features -> packed blocks -> draft
-> losses.

The blocks, their mask, the layout and the mask token are the draft's own (its config and
dspark.models.block_draft): the training forward and the inference path build the same blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dspark.models.block_draft import block_attention_mask, packed_block_attention_mask
from dspark.models.contract import optional
from dspark.objective_keys import BlockKeys
from dspark.targets.hf_target import FrozenTarget
from dspark.training.blocks import Blocks, build_blocks
from dspark.training.module import DraftLightningModule, OptimConfig, is_distributed
from dspark.training.objectives import LossWeights, draft_losses, position_weights


@dataclass
class DraftRows:
    """The draft's outputs at the prediction rows of a batch's blocks (teacher-forced Markov prev)."""

    hidden: torch.Tensor  # [B, A, g, H] backbone output (before the heads)
    latent: torch.Tensor | None  # [B, A, g, r] Markov latent (bias = latent @ markov_w2^T), None without a head
    conf_logits: torch.Tensor | None  # [B, A, g]
    blocks: Blocks
    final: torch.Tensor  # [B, S, H] target final hidden (teacher rows are gathered from it)


@dataclass
class DraftOutputs:
    logits: torch.Tensor  # [B, A, g, V] Markov-corrected draft logits (teacher-forced prev)
    conf_logits: torch.Tensor | None  # [B, A, g]
    hidden: torch.Tensor  # [B, A, g, H] backbone output at the prediction rows (before the Markov head)
    blocks: Blocks
    final: torch.Tensor  # [B, S, H]


class BlockDraftModule(DraftLightningModule):
    KEYS = BlockKeys
    TRAIN_LOGGED = ("loss", "ce", "l1", "conf", "tau_prob")

    def __init__(self, draft: torch.nn.Module, target: FrozenTarget, *, decay_gamma: float | None = 4.0,
                 loss_weights: LossWeights = LossWeights(), optim: OptimConfig = OptimConfig(),
                 fused_loss: bool = True):
        super().__init__(draft, target, optim)
        self.decay_gamma, self.loss_weights = decay_gamma, loss_weights
        self.fused_loss = fused_loss  # False: the loss from materialised [N, V] logits (the reference), same values
        # the block mask as its rule (PackedBlockMask: each block scores only the keys it sees); False: the dense
        # [B, A*Lb, S + A*Lb] bool mask (the reference; benchmarks/bench_step.py compares the two)
        self.packed_attention_mask = True

    @classmethod
    def from_config(cls, keys: BlockKeys, draft, target: FrozenTarget, optim: OptimConfig) -> "BlockDraftModule":
        """The module from its train.* keys (checked by dspark.schema before any model loads)."""
        return cls(draft, target, decay_gamma=float(keys.decay_gamma), loss_weights=LossWeights(**keys.loss_weights),
                   optim=optim, fused_loss=bool(keys.fused_loss))

    def lm_head_vocab(self) -> tuple[int, int]:
        """(vocabulary rows the draft's LM-head GEMMs score in a training step, vocabulary rows the teacher's LM-head
        GEMM scores in a training step; 0 when the training step runs no teacher GEMM)."""
        cfg = self.draft.config
        vd = int(getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size)
        return vd, (vd if self._teacher_in_training() else 0)

    def _teacher_in_training(self) -> bool:
        """Whether a training step needs the teacher's distribution: for the L1 or confidence loss. A CE-only
        objective (DFlash) runs no teacher GEMM in training (its agreement and tau_prob are held-out metrics)."""
        return bool(self.loss_weights.l1 or self.loss_weights.conf)

    def _scored_head(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(the LM-head rows the draft scores [Vd, H], the draft id of every target id [V] long, -1 outside the
        draft's vocabulary (None for a full-vocabulary draft), the whole head [V, H]). Under autocast (bf16-mixed) the
        heads are in the autocast dtype, so that the fused loss's GEMMs run at the step's precision like every other
        linear of it (a float32 target's head would otherwise make them the step's only float32 GEMMs: 73 % of the
        FLOPs at a sixth of the bf16 rate on an AMX CPU, benchmarks/README.md); cached while the head, the dtype and the
        mapping stay the same."""
        lm_head = self.target.lm_head_weight
        dev = lm_head.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else lm_head.dtype
        reduced = optional(self.draft, "reduced_vocab")
        key = (lm_head.data_ptr(), lm_head.device, dtype, reduced and self.draft.d2t._version)
        if getattr(self, "_head_key", None) != key:
            full = lm_head.detach().to(dtype)
            if not reduced:
                self._heads_cache = (full, None, full)
            else:
                self._heads_cache = (full.index_select(0, self.draft.draft_to_target()), self.draft.target_to_draft(),
                                     full)
            self._head_key = key
        return self._heads_cache

    # ---- forward ----------------------------------------------------------------------------------
    def _hidden(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Blocks, torch.Tensor]:
        """One draft forward over every block of the batch (docs/CONTRACTS.md §3) -> (h [B, A, Lb, H] backbone output
        at every block row, blocks, target final [B, S, H]); the prediction rows are rows pred_offset.. of each
        block."""
        cfg = self.draft.config
        ids = batch["input_ids"]  # [B, S]
        B, S = ids.shape
        feats = self.features(batch)  # aux [B, S, n*H], final [B, S, H]
        g = int(cfg.block_size)
        blocks = build_blocks(ids, batch["loss_mask"], batch["anchors"], batch["keep"], g, cfg.mask_token_id,
                              cfg.layout)
        A, Lb = blocks.input_ids.shape[1:]
        draft = self.draft
        main_x = draft.combine(feats.aux)  # [B, S, H]
        ctx = draft.context_kv(main_x, torch.arange(S, device=ids.device).expand(B, S))
        build_mask = packed_block_attention_mask if self.packed_attention_mask else block_attention_mask
        # [B, A*Lb, S + A*Lb] (packed: its rule), with the draft's window rule
        mask = build_mask(batch["anchors"], Lb, S, cfg.sliding_window, cfg.window_rule)
        h = draft.backbone(blocks.input_ids.flatten(1), blocks.positions.flatten(1), ctx, mask)  # [B, A*Lb, H]
        return h.view(B, A, Lb, -1), blocks, feats.final

    def _heads(self, batch, blocks: Blocks, h_all: torch.Tensor):
        """(prediction rows h [B, A, g, H], Markov latent [B, A, g, r] | None, confidence logits [B, A, g] | None)
        from every block row's hidden h_all [B, A, Lb, H]. A head that reads the whole block (XPress's refiner:
        `reads_block`) gets every row, normed, and the teacher-forced previous token of every row: the token before the
        anchor (the anchor itself at position 0), then x_a, x_{a+1}, ..."""
        draft = self.draft
        g = int(draft.config.block_size)
        h = h_all[:, :, blocks.pred_offset : blocks.pred_offset + g]
        head, latent, feat = draft.markov_head, None, None
        if head is not None and getattr(head, "reads_block", False):
            before = batch["input_ids"].gather(1, (batch["anchors"] - 1).clamp_min(0))  # [B, A]
            latent = head.block_latent(torch.cat([before.unsqueeze(-1), blocks.prev_ids], -1),
                                       draft.head_input(h_all))[:, :, blocks.pred_offset:]  # [B, A, g, r]
        elif head is not None:
            latent, feat = head.latent(blocks.prev_ids, h)  # [B, A, g, r] x2
        return h, latent, draft.confidence_logit(h, feat) if draft.confidence_head is not None else None

    def draft_rows(self, batch: dict[str, torch.Tensor]) -> DraftRows:
        """The prediction rows' hidden, Markov latent and confidence logits (what the fused loss takes)."""
        h_all, blocks, final = self._hidden(batch)
        h, latent, conf = self._heads(batch, blocks, h_all)
        return DraftRows(hidden=h, latent=latent, conf_logits=conf, blocks=blocks, final=final)

    def draft_outputs(self, batch: dict[str, torch.Tensor]) -> DraftOutputs:
        """The prediction rows as the logits the draft drafts with: base_logits(h) + the Markov bias [B, A, g, V]
        (the training forward seen from eval; the loss reads draft_rows)."""
        h_all, blocks, final = self._hidden(batch)
        h, latent, conf = self._heads(batch, blocks, h_all)
        logits = self.draft.base_logits(h)  # [B, A, g, V]
        if latent is not None:
            logits = logits + self.draft.markov_head.project(latent)
        return DraftOutputs(logits=logits, conf_logits=conf, hidden=h, blocks=blocks, final=final)

    def _teacher_rows(self, final: torch.Tensor, b: Blocks) -> torch.Tensor:
        """Target final hidden at the teacher positions: [B, S, H] -> [B, A, g, H]."""
        H = final.shape[-1]
        rows = torch.gather(final, 1, b.teacher_positions.flatten(1).unsqueeze(-1).expand(-1, -1, H))
        return rows.view(*b.labels.shape, H)

    def _losses(self, batch) -> tuple[dict[str, torch.Tensor], Blocks]:
        """The block objective's losses (objectives.draft_losses) of a batch: fused, or from materialised logits when
        fused_loss is off (the two are tested equal)."""
        flat = lambda t: None if t is None else t.flatten(0, 1)  # noqa: E731  [B, A, ...] -> [B*A, ...]
        r = self.draft_rows(batch)
        b = r.blocks
        eval_mask = b.eval_mask.flatten(0, 1)  # [B*A, g]
        head = self.draft.markov_head
        lm_head, draft_id, full_head = self._scored_head()
        labels = flat(b.labels) if draft_id is None else draft_id[flat(b.labels)]  # [B*A, g] draft ids
        teacher = not self.training or self._teacher_in_training()
        # held out, a reduced draft is measured against the target's whole distribution (true L1 / tau_prob)
        full_teacher = None if (draft_id is None or self.training) else (full_head, self.draft.draft_to_target())
        losses = draft_losses(
            flat(self.draft.head_input(r.hidden)), flat(self._teacher_rows(r.final, b)) if teacher else None,
            lm_head, flat(r.latent), None if head is None else head.markov_w2.weight,
            labels, eval_mask, flat(r.conf_logits),
            decay_gamma=self.decay_gamma, weights=self.loss_weights,
            normalizer=self._global_normalizer(eval_mask) if self.training else None,
            teacher_head=full_teacher, materialise=not self.fused_loss)
        return losses, b

    def losses(self, batch) -> dict[str, torch.Tensor]:
        return self._losses(batch)[0]

    def _global_normalizer(self, eval_mask: torch.Tensor) -> torch.Tensor | None:
        """Sum of loss weights over all ranks / world size, so DDP optimises the single-process loss."""
        if not is_distributed():
            return None
        total = position_weights(eval_mask, self.decay_gamma).sum()
        dist.all_reduce(total)
        return total / dist.get_world_size()

    # ---- validation ------------------------------------------------------------------------------
    def validation_sums(self, batch) -> dict[str, torch.Tensor]:
        out, b = self._losses(batch)
        em = b.eval_mask.flatten(0, 1)
        wsum = position_weights(em, self.decay_gamma).sum()
        nblocks = em[:, 0].sum()
        sums = {"wsum": wsum, "nblocks": nblocks}
        sums.update({k: out[k] * wsum for k in ("loss", "ce", "l1", "conf") if k in out})
        if "tau_prob" in out:
            sums.update(tau_prob=out["tau_prob"] * nblocks, agree_count=out["agree_count"],
                        agree_total=out["agree_total"])
        return sums

    def validation_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        metrics = {f"val/{k}": sums[k] / sums["wsum"].clamp_min(1e-12) for k in ("loss", "ce", "l1", "conf")
                   if k in sums}
        if "tau_prob" in sums:
            metrics["val/tau_prob"] = sums["tau_prob"] / sums["nblocks"].clamp_min(1)
            metrics.update(self.agreement(sums))
        return metrics
