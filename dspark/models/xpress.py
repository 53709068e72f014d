"""XPress draft (arXiv 2608.02438; vLLM 0.33 / 0.34 `Qwen3XPressForCausalLM`, vllm/model_executor/models/qwen3_xpress.py,
served under method "dflash"): a DFlash draft (the dense backbone, 1+N "mask" block) plus a causal low-rank refiner
over the whole block, solved by K Jacobi passes. Facts with file:line: docs/research/xpress_vllm034.md.

Refiner (XPressRefinerHead; V34 qwen3_xpress.py:24-61, 97-114; kernels.py:5-10, 136-186), block of B = N + 1 slots
(slot 0 = the anchor), hs_b = norm(h_b) the backbone's final-normed hidden of slot b:
    g      = mean_b hs_b                                   (all B slots, anchor included)
    x_b    = in_proj([down_h(hs_b); down_g(g); w1[prev_b]])     prev_0 = the token before the anchor, prev_b = blk_{b-1}
    u_b,c  = sum_{j<=b} M[c, b, j] x_j,c,   M = mix_l * tril + I     (per-channel causal mix; mix_l starts at 0)
    z_b    = u_b + mlp_down(silu(mlp_gate(u_b)) * mlp_up(u_b))
    logits_b = lm_head(hs_b) + w2(z_b)                     slots 1..B-1 draft
Training (the block objective, teacher-forced: blk = the true tokens) scores base + w2(z) through the fused loss with z
as the Markov latent and w2 as its readout (`reads_block`: dspark.training.block_module gets the whole block).
Drafting (V34 qwen3_xpress.py:116-215; xpress/speculator.py:60-108): blk_0 = the anchor, blk_{1..} = argmax base;
then K times, every slot at once, blk_{1..} = argmax(base + w2 z(blk)) (Jacobi); with xpress_topc = C > 0 each slot
chooses only among the base logits' top C, fixed for the step (C = 0: the whole vocabulary). At serving the token
before the anchor is not known: the anchor id stands in (speculator.py:88-90). Greedy only: vLLM returns token ids,
draft probabilities one-hot (V34 config/speculative.py:682-689).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.common import field_error
from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft
from dspark.models.proposal import Proposal
from dspark.models.registry import register


@dataclass(kw_only=True)
class XPressConfig(DSparkDenseConfig):
    GROUP_KEYS: ClassVar[tuple[str, ...]] = DSparkDenseConfig.GROUP_KEYS + (
        "xpress_rank", "xpress_mlp_hidden", "xpress_num_passes", "xpress_topc")

    xpress_rank: int = 256  # r (vLLM xpress_rank)
    xpress_mlp_hidden: int = 512  # the refiner MLP's width (vLLM xpress_mlp_hidden; speculators rank x mlp_ratio 2)
    xpress_num_passes: int = 6  # K Jacobi passes (vLLM xpress_num_passes)
    xpress_topc: int = 512  # C candidates per slot; 0 = the whole vocabulary (vLLM xpress_topc)

    @property
    def vllm_method(self) -> str:
        return "dflash"  # vLLM picks the XPress speculator from the model class (V34 qwen3_xpress.py:289-290)

    def vllm_options(self) -> dict:
        """speculative_config options of this family (V34 config/speculative.py:694-698; xpress/config.py:7-11)."""
        return {"xpress_topc": int(self.xpress_topc)}

    @property
    def xpress_block_size(self) -> int:
        """B = the 1+N block's slots (the anchor and N drafts)."""
        return self.block_size + 1

    def validate(self) -> "XPressConfig":
        super().validate()
        bad = lambda key, why: field_error(self, key, why)  # noqa: E731
        if self.markov_rank != 0:
            raise bad("markov_rank", "must be 0: XPress refines a DFlash block (no Markov head)")
        if self.layout != "mask":
            raise bad("layout", "must be mask: XPress drafts the 1+N DFlash block (sample_from_anchor false, "
                                "xpress/speculator.py:29-35)")
        if self.draft_vocab_size not in (None, self.vocab_size):
            raise bad("draft_vocab_size", "must be null: vLLM's XPress drafter needs the target's whole vocabulary "
                                          "(qwen3_xpress.py:296-298, 317-322)")
        for key in ("xpress_rank", "xpress_mlp_hidden", "xpress_num_passes"):
            if int(getattr(self, key)) < 1:
                raise bad(key, f"must be >= 1, got {getattr(self, key)}")
        if not 0 <= self.xpress_topc <= self.vocab_size:
            raise bad("xpress_topc", f"must be in [0, vocab_size={self.vocab_size}] (0: every token), got "
                                     f"{self.xpress_topc}")
        return self


class XPressRefiner(nn.Module):
    """The refiner head (module docstring); parameter names are vLLM's own (w1, down_h, down_g, in_proj, mlp_*, w2),
    mix_l the RAW mixer the checkpoint stores as `xpress_head.mix.L` (vLLM folds it on load, qwen3_xpress.py:87-95)."""

    reads_block = True  # block_module hands it every block row and the previous token of each

    def __init__(self, cfg: XPressConfig):
        super().__init__()
        r, m, H, V, B = cfg.xpress_rank, cfg.xpress_mlp_hidden, cfg.hidden_size, cfg.vocab_size, cfg.xpress_block_size
        self.w1 = nn.Embedding(V, r)
        self.down_h = nn.Linear(H, r, bias=False)
        self.down_g = nn.Linear(H, r, bias=False)
        self.in_proj = nn.Linear(3 * r, r, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(r, B, B))
        self.mlp_gate = nn.Linear(r, m, bias=False)
        self.mlp_up = nn.Linear(r, m, bias=False)
        self.mlp_down = nn.Linear(m, r, bias=False)
        self.w2 = nn.Linear(r, V, bias=False)

    @property
    def markov_w2(self) -> nn.Linear:
        """The readout [V, r] (the fused loss's Markov readout slot)."""
        return self.w2

    def reset_parameters(self, std: float) -> None:
        for mod in (self.w1, self.down_h, self.down_g, self.in_proj, self.mlp_gate, self.mlp_up, self.mlp_down,
                    self.w2):
            nn.init.normal_(mod.weight, std=std)
        nn.init.zeros_(self.mix_l)  # the mixer starts as the identity (speculators model_definitions.py:43-49)

    def hidden_cache(self, hs: torch.Tensor) -> torch.Tensor:
        """hs [..., B, H] (normed) -> the pass-invariant part of x, in_proj[:, :2r] [down_h(hs_b); down_g(mean hs)]
        [..., B, r]."""
        r = self.down_h.out_features
        dh = self.down_h(hs)  # [..., B, r]
        c = torch.cat([dh, self.down_g(hs.mean(-2, keepdim=True)).expand_as(dh)], -1)  # [..., B, 2r]
        return F.linear(c, self.in_proj.weight[:, : 2 * r])

    def latent_from(self, xh: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """xh [..., B, r] (hidden_cache), prev [..., B] long -> z [..., B, r]."""
        r = self.down_h.out_features
        x = xh + F.linear(self.w1(prev).to(xh.dtype), self.in_proj.weight[:, 2 * r:])  # [..., B, r]
        b = x.shape[-2]
        mix = self.mix_l * torch.ones(b, b, device=x.device, dtype=torch.bool).tril() + torch.eye(
            b, device=x.device, dtype=self.mix_l.dtype)  # [r, B, B]: M[c, k, j]
        u = torch.einsum("ckj,...jc->...kc", mix.to(x.dtype), x)  # [..., B, r]
        return u + self.mlp_down(F.silu(self.mlp_gate(u)) * self.mlp_up(u))

    def block_latent(self, prev: torch.Tensor, hs: torch.Tensor) -> torch.Tensor:
        """prev [..., B] long, hs [..., B, H] normed -> z [..., B, r] (teacher forcing: prev = the true tokens)."""
        return self.latent_from(self.hidden_cache(hs), prev)


@register("xpress", config=XPressConfig, objective="block", serving="dspark.export.xpress")
class XPressDraft(DSparkDenseDraft):
    """The dense DFlash backbone + the refiner (`xpress_head`)."""

    def __init__(self, cfg: XPressConfig):
        super().__init__(cfg)
        self.xpress_head = XPressRefiner(cfg)
        self.xpress_head.reset_parameters(cfg.initializer_range)

    @property
    def markov_head(self):  # the block objective's hook: the refiner's latent is the Markov latent's place
        return self.__dict__.get("_modules", {}).get("xpress_head")

    @markov_head.setter
    def markov_head(self, value) -> None:  # DSparkDenseDraft.__init__ sets None (no Markov head)
        if value is not None:
            raise ValueError("XPressDraft has no Markov head")

    def refined_logits(self, hs: torch.Tensor, blk: torch.Tensor, prev0: torch.Tensor) -> torch.Tensor:
        """hs [B, L, H] normed, blk [B, L] (slot 0 = the anchor), prev0 [B] -> logits of slots 1.. [B, L-1, V]."""
        head = self.xpress_head
        prev = torch.cat([prev0.unsqueeze(1), blk[:, :-1]], 1)
        z = head.block_latent(prev, hs)[:, 1:]
        lm_head = self._shared("lm_head_weight")
        return F.linear(hs[:, 1:].to(lm_head.dtype), lm_head) + head.w2(z).to(lm_head.dtype)

    @torch.no_grad()
    def _draft_block(self, h_all: torch.Tensor, pred_offset: int, x0: torch.Tensor, temperature: float, gens: list,
                     forced_tokens: torch.Tensor | None) -> list[Proposal]:
        """K Jacobi passes over the 1+N block as vLLM 0.34 drafts it (module docstring); greedy, q one-hot."""
        cfg, head = self.config, self.xpress_head
        hs = self.head_input(h_all)  # [B, L, H]
        lm_head = self._shared("lm_head_weight")
        base = F.linear(hs[:, 1:].to(lm_head.dtype), lm_head).float()  # [B, N, V]
        bsz, n, v = base.shape
        xh = head.hidden_cache(hs)  # pass-invariant
        prev0 = x0  # the anchor stands in for the token before it (xpress/speculator.py:88-90)
        blk = torch.cat([x0.unsqueeze(1), base.argmax(-1)], 1)  # [B, L]
        topc = int(cfg.xpress_topc)
        cand = base.topk(min(topc, v), dim=-1).indices if topc else None  # [B, N, C], fixed for the step

        def refined(b: torch.Tensor) -> torch.Tensor:
            z = head.latent_from(xh, torch.cat([prev0.unsqueeze(1), b[:, :-1]], 1))[:, 1:]  # [B, N, r]
            return base + head.w2(z).float()

        if forced_tokens is not None:  # teacher forcing: one refinement with the given tokens
            blk = torch.cat([x0.unsqueeze(1), forced_tokens.to(blk)], 1)
            logits = refined(blk)
        else:
            logits = base
            for _ in range(int(cfg.xpress_num_passes)):
                logits = refined(blk)
                if cand is None:
                    pick = logits.argmax(-1)
                else:
                    pick = cand.gather(-1, logits.gather(-1, cand).argmax(-1, keepdim=True)).squeeze(-1)
                blk = torch.cat([x0.unsqueeze(1), pick], 1)
        toks = blk[:, 1:]
        q = F.one_hot(toks, v).float()
        return [Proposal(tokens=toks[i], q_probs=q[i], conf=None, logits=logits[i]) for i in range(bsz)]


__all__ = ["XPressConfig", "XPressDraft", "XPressRefiner"]
