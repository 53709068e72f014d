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
    return propose_batch(draft, [target_feats_aux[:, :a]], [anchor_token], num_drafts=g,
                         mask_token_id=mask_token_id, layout=layout, window=window, temperature=temperature,
                         generators=[generator],
                         forced_tokens=None if forced_tokens is None else forced_tokens.view(1, g))[0]


@torch.no_grad()
def propose_batch(
    draft: torch.nn.Module,
    contexts: list[torch.Tensor],
    anchor_tokens: list[int],
    *,
    num_drafts: int,
    mask_token_id: int,
    layout: str = "anchor",
    window: int | None = None,
    temperature: float = 0.0,
    generators: list[torch.Generator | None] | None = None,
    forced_tokens: torch.Tensor | None = None,
) -> list[Proposal]:
    """One block per request in ONE draft forward. contexts[i]: [1, a_i, n*H] target features of request i's
    positions 0..a_i-1; its anchor x0 = anchor_tokens[i] sits at position a_i. Contexts are right-padded to
    the longest: the block mask only lets a block see context keys before its anchor, so the padding is never
    attended (the training forward packs blocks the same way). Request i samples with generators[i], in the
    same order as alone, so batching does not change its tokens. forced_tokens: optional [B, g]."""
    g, bsz = int(num_drafts), len(contexts)
    if bsz == 0 or len(anchor_tokens) != bsz:
        raise ValueError(f"need one anchor token per context, got {len(anchor_tokens)} for {bsz}")
    for c in contexts:
        _check_inputs(c, c.shape[1], g, layout)
    gens = [None] * bsz if generators is None else list(generators)
    if forced_tokens is not None and tuple(forced_tokens.shape) != (bsz, g):
        raise ValueError(f"forced_tokens must be [{bsz}, {g}], got {tuple(forced_tokens.shape)}")
    dev = contexts[0].device
    lens = [int(c.shape[1]) for c in contexts]
    width = max(lens)
    aux = contexts[0].new_zeros(bsz, width, contexts[0].shape[-1])  # [B, A, n*H] right-padded
    for i, c in enumerate(contexts):
        aux[i, : lens[i]] = c[0]

    # ---- parallel stage: one non-causal forward over every block ----------------------------------
    main_x = draft.combine(aux)  # [B, A, H]
    ctx = draft.context_kv(main_x, torch.arange(width, device=dev).expand(bsz, width))
    block_len = g if layout == "anchor" else g + 1
    pred_offset = 0 if layout == "anchor" else 1
    anchors = torch.tensor(lens, dtype=torch.long, device=dev).unsqueeze(1)  # [B, 1] = a_i
    block_ids = torch.full((bsz, block_len), int(mask_token_id), dtype=torch.long, device=dev)  # [B, L]
    block_ids[:, 0] = torch.tensor([int(t) for t in anchor_tokens], dtype=torch.long, device=dev)
    block_pos = anchors + torch.arange(block_len, device=dev)  # [B, L]
    mask = block_attention_mask(anchors, block_len, width, window)  # [B, L, A + L]
    h = draft.backbone(block_ids, block_pos, ctx, mask)[:, pred_offset : pred_offset + g]  # [B, g, H]
    base = draft.base_logits(h)  # [B, g, V]

    # ---- sequential stage: Markov-corrected sampling, left to right -----------------------------
    markov = getattr(draft, "markov_head", None)
    has_conf = getattr(draft, "confidence_head", None) is not None
    prev = block_ids[:, 0].clone()  # [B]
    state = None
    tokens, q_rows, logit_rows, conf = [], [], [], []
    for k in range(g):
        h_k = h[:, k]  # [B, H]
        feat = None
        if markov is not None:
            bias, feat, state = markov.step(prev, h_k, state)  # [B, V], [B, r]
            logits_k = base[:, k] + bias  # [B, V]
        else:
            logits_k = base[:, k]  # [B, V]
        if has_conf:
            conf.append(draft.confidence_logit(h_k, feat).float())  # [B]
        picked = [sample_from_logits(logits_k[i], temperature, gens[i]) for i in range(bsz)]
        y = torch.stack([t for t, _ in picked]).to(dev)  # [B]
        if forced_tokens is not None:
            y = forced_tokens[:, k].to(device=dev, dtype=torch.long)
        tokens.append(y)
        q_rows.append(torch.stack([q for _, q in picked]))  # [B, V]
        logit_rows.append(logits_k.float())
        prev = y
    toks, qs, lgs = torch.stack(tokens, 1), torch.stack(q_rows, 1), torch.stack(logit_rows, 1)  # [B, g(, V)]
    zs = torch.stack(conf, 1) if has_conf else None  # [B, g]
    return [Proposal(tokens=toks[i], q_probs=qs[i], conf=None if zs is None else torch.sigmoid(zs[i]),
                     logits=lgs[i], conf_logits=None if zs is None else zs[i]) for i in range(bsz)]
