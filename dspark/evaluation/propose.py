"""The draft's inference path (SPEC.md 2): one block of gamma drafts from the target's context features.

    main_x = draft.combine(aux[:, :a])                 context = positions 0..a-1   [1, a, H]
    ctx    = draft.context_kv(main_x, 0..a-1)
    block  = [x0, m, ..., m] at positions a, a+1, ...  (length g "anchor", g+1 "mask")
    h      = draft.backbone(block, ctx, block_attention_mask)[pred_offset : pred_offset + g]   [g, H]
    U      = draft.base_logits(h)                                                            [g, V]
    prev_0 = x0;  logits_k = U_k + markov_head.step(prev_k, h_k) bias;  y_k ~ logits_k / T;  prev_{k+1} = y_k

It is the same computation as DraftLightningModule.draft_outputs (same draft methods, same mask
builder), except that the Markov head runs step by step on the draft's own samples instead of the
ground truth (pass `forced_tokens` to feed given tokens instead, i.e. teacher forcing).
A draft without a Markov head (DFlash) samples each position from U_k independently.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.training.blocks import LAYOUTS, block_attention_mask


@dataclass
class Proposal:
    tokens: torch.Tensor  # [g] long, the drafted tokens y_0..y_{g-1}
    q_probs: torch.Tensor  # [g, V] fp32, the distribution each y_k was drawn from (one-hot at T=0)
    conf: torch.Tensor | None  # [g] fp32 sigmoid(confidence logit), None without a confidence head
    logits: torch.Tensor  # [g, V] fp32 Markov-corrected logits before temperature scaling
    conf_logits: torch.Tensor | None = None  # [g] fp32 raw confidence logits (for calibration / STS)

    @property
    def num_drafts(self) -> int:
        return int(self.tokens.numel())


def draft_config(draft: torch.nn.Module):
    """The draft's config dataclass (every draft keeps it at `.config`)."""
    cfg = getattr(draft, "config", None)
    if cfg is None or not hasattr(cfg, "sliding_window"):
        raise AttributeError(f"{type(draft).__name__}: no .config with a sliding_window field")
    return cfg


def sample_from_logits(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [V] -> (token [] long, probs [V] fp32 actually sampled from).

    T == 0: argmax, probs = one-hot. T > 0: categorical on softmax(logits / T).
    """
    logits = logits.float()
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        tok = logits.argmax()
        return tok, torch.nn.functional.one_hot(tok, logits.numel()).float()
    probs = torch.softmax(logits / temperature, dim=-1)  # [V]
    dev = generator.device if generator is not None else probs.device
    tok = torch.multinomial(probs.to(dev), 1, generator=generator).to(probs.device)[0]
    return tok, probs


def _check_inputs(aux: torch.Tensor, anchor_pos: int, num_drafts: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if num_drafts < 1:
        raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
    if aux.dim() != 3 or aux.shape[0] != 1:
        raise ValueError(f"target_feats_aux must be [1, S, n*H], got {tuple(aux.shape)}")
    if not 1 <= anchor_pos <= aux.shape[1]:
        raise ValueError(
            f"anchor_pos {anchor_pos} needs context features for positions 0..{anchor_pos - 1}, "
            f"target_feats_aux has {aux.shape[1]} positions"
        )


@torch.no_grad()
def propose(
    draft: torch.nn.Module,
    target_feats_aux: torch.Tensor,
    anchor_token: int,
    anchor_pos: int,
    *,
    num_drafts: int,
    mask_token_id: int,
    layout: str = "anchor",
    window: int | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    forced_tokens: torch.Tensor | None = None,
) -> Proposal:
    """Draft `num_drafts` tokens after the anchor x0 = `anchor_token` sitting at position `anchor_pos`.

    target_feats_aux: [1, S, n*H] target layer outputs with S >= anchor_pos; only positions
    0..anchor_pos-1 are read (the anchor's own target state does not exist yet).
    forced_tokens: optional [g] long; when given, y_k = forced_tokens[k] is fed to the Markov head instead
    of a sample (teacher forcing), the returned logits / q_probs / conf are those of that path.
    """
    g, a = int(num_drafts), int(anchor_pos)
    _check_inputs(target_feats_aux, a, g, layout)
    if forced_tokens is not None and tuple(forced_tokens.shape) != (g,):
        raise ValueError(f"forced_tokens must be [{g}], got {tuple(forced_tokens.shape)}")
    dev = target_feats_aux.device

    # ---- parallel stage: one non-causal forward over the block ----------------------------------
    main_x = draft.combine(target_feats_aux[:, :a])  # [1, a, H]
    ctx = draft.context_kv(main_x, torch.arange(a, device=dev).unsqueeze(0))
    block_len = g if layout == "anchor" else g + 1
    pred_offset = 0 if layout == "anchor" else 1
    block_ids = torch.full((1, block_len), int(mask_token_id), dtype=torch.long, device=dev)  # [1, L]
    block_ids[0, 0] = int(anchor_token)
    block_pos = (a + torch.arange(block_len, device=dev)).unsqueeze(0)  # [1, L]
    anchors = torch.tensor([[a]], dtype=torch.long, device=dev)  # [1, 1]
    mask = block_attention_mask(anchors, block_len, a, window)  # [1, L, a + L]
    h = draft.backbone(block_ids, block_pos, ctx, mask)[0, pred_offset : pred_offset + g]  # [g, H]
    base = draft.base_logits(h)  # [g, V]

    # ---- sequential stage: Markov-corrected sampling, left to right -----------------------------
    markov = getattr(draft, "markov_head", None)
    has_conf = getattr(draft, "confidence_head", None) is not None
    prev = torch.tensor([int(anchor_token)], dtype=torch.long, device=dev)  # [1]
    state = None
    tokens, q_rows, logit_rows, conf = [], [], [], []
    for k in range(g):
        h_k = h[k : k + 1]  # [1, H]
        feat = None
        if markov is not None:
            bias, feat, state = markov.step(prev, h_k, state)  # [1, V], [1, r]
            logits_k = (base[k : k + 1] + bias)[0]  # [V]
        else:
            logits_k = base[k]  # [V]
        if has_conf:
            conf.append(draft.confidence_logit(h_k, feat).float()[0])
        y, q = sample_from_logits(logits_k, temperature, generator)
        if forced_tokens is not None:
            y = forced_tokens[k].to(device=dev, dtype=torch.long)
        tokens.append(y)
        q_rows.append(q)
        logit_rows.append(logits_k.float())
        prev = y.view(1)
    return Proposal(
        tokens=torch.stack(tokens),  # [g]
        q_probs=torch.stack(q_rows),  # [g, V]
        conf=torch.sigmoid(torch.stack(conf)) if has_conf else None,  # [g]
        logits=torch.stack(logit_rows),  # [g, V]
        conf_logits=torch.stack(conf) if has_conf else None,  # [g]
    )
