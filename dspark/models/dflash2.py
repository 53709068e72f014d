"""DFlash2 draft for dense targets (vLLM 0.33.0 `DFlash2DraftModel`, docs/dflash2.md): DFlash (dspark_dense with
markov_rank 0, the 1+N "mask" block) plus

    grouped dynamic convolution around each sub-layer (vllm/model_executor/models/qwen3_dflash2.py:144-287):
        h, d = attention_conv.prepare(input_layernorm(x));  x = x + attention_conv.finish(self_attn(h), d)
        h, d = mlp_conv.prepare(post_attention_layernorm(x)); x = x + mlp_conv.finish(mlp(h), d)
      prepare: [d0; d1] = kernel_projection(h) [.., 2, taps, G];  returns (conv(h, d0, base_kernel[0]), d1)
      finish(y, d1) = conv(y, d1, base_kernel[1])
      conv(x, d, base)[t, c] = sum_{j < taps, p(t) >= j} (base[j, c] + d[t, j, c // group_size]) * x[t - j, c]
      with p(t) = t mod (block length): causal inside each block, the coefficients of the current row t;
    candidate selector (qwen3_dflash2.py:290-358; the walk: v1/worker/gpu/spec_decode/dflash2/speculator.py:15-75,
      206-265): per prediction row k (normed hidden n_k), candidates = the top-K of unary = lm_head(n_k), scores
        s_k(c) = unary_k(c) + <predecessor_codebook[prev_k] * hidden_projection(n_k), successor_codebook[c]>
      prev_0 = the anchor x0, prev_k = the token drafted at step k-1; y_k = argmax over the K candidates (T = 0) or a
      sample of softmax(s_k / T) over them; the draft distribution is -inf outside the K candidates.

The context K/V are DFlash's (no convolution: vLLM precomputes them from hidden_norm(fc(aux))). Training (block
objective): the selector is the objective's "Markov head" -- latent = predecessor_codebook[prev] *
hidden_projection(norm(h)), w2 = successor_codebook -- so the loss is CE of lm_head(norm(h)) + edge over the whole
vocabulary with the teacher-forced predecessor (docs/dflash2.md, "Training objective"). Parameter names are the
serving checkpoint's (vLLM prepends "model."): layers.{i}.{attention,mlp}_conv.{base_kernel,kernel_projection.weight},
candidate_selector.{predecessor_codebook,successor_codebook,hidden_projection.weight}.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.common import field_error
from dspark.models.dspark_dense import DenseDraftLayer, DSparkDenseConfig, DSparkDenseDraft
from dspark.models.proposal import Proposal, sample_from_logits
from dspark.models.registry import register
from dspark.ops.attention import PackedBlockMask


@dataclass(kw_only=True)
class DFlash2Config(DSparkDenseConfig):
    GROUP_KEYS: ClassVar[tuple[str, ...]] = ("num_layers", "block_size", "mask_token_id", "target_layer_ids",
                                             "sliding_window", "conv_kernel_size", "conv_group_size",
                                             "selector_rank", "selector_top_k")

    conv_kernel_size: int = 3  # taps (vLLM dflash_config.conv_kernel_size)
    conv_group_size: int = 16  # channels sharing one dynamic coefficient; divides hidden_size
    selector_rank: int = 32  # r of the candidate selector's codebooks
    selector_top_k: int = 8  # K candidates per position

    def validate(self) -> "DFlash2Config":
        super().validate()
        bad = lambda key, why: field_error(self, key, why)  # noqa: E731
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if int(getattr(self, key)) < 1:
                raise bad(key, f"must be >= 1, got {getattr(self, key)}")
        if self.hidden_size % self.conv_group_size:
            raise bad("conv_group_size", f"({self.conv_group_size}) must divide hidden_size ({self.hidden_size}); "
                                         "vLLM raises otherwise (qwen3_dflash2.py:182-185)")
        if self.selector_top_k > self.vocab_size:
            raise bad("selector_top_k", f"({self.selector_top_k}) exceeds the vocabulary ({self.vocab_size})")
        if self.markov_rank != 0:
            raise bad("markov_rank", f"must be 0 (DFlash2 has the candidate selector, no Markov head), got "
                                     f"{self.markov_rank}")
        if self.layout != "mask":
            raise bad("layout", f"must be 'mask' (vLLM's DFlash speculator runs only the 1+N mask block), got "
                                f"{self.layout!r}")
        if self.window_rule == "query" and self.sliding_window is not None and self.block_size + 1 > self.sliding_window:
            raise bad("sliding_window", f"{self.sliding_window} is shorter than the 1 + {self.block_size} block: the "
                                        "block's slots would not all see each other, and the backbone reads the "
                                        "convolution's block length from the mask; use block_size <= "
                                        f"{self.sliding_window - 1}")
        if self.draft_vocab_size not in (None, self.vocab_size):
            raise bad("draft_vocab_size", "must be null: vLLM's DFlash2 takes the candidates' ids from the draft LM "
                                          "head without the d2t map and indexes its [vocab_size] codebooks with them "
                                          "(qwen3_dflash2.py:299-307, 408-413)")
        return self


def grouped_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, offset: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """x [B, T, H], delta [B, T, taps, G] (coefficients of each row), base [taps, H], offset [T] long (position
    inside its block) -> [B, T, H]: out[t] = sum_{j <= offset[t]} (base[j] + delta[t, j] per group) * x[t - j]."""
    B, T, H = x.shape
    taps, G = base.shape[0], H // group_size
    xs = x.view(B, T, G, group_size)
    coef = base.view(1, 1, taps, G, group_size) + delta.unsqueeze(-1)  # [B, T, taps, G, gs]
    out = coef[:, :, 0] * xs
    for j in range(1, taps):
        shifted = F.pad(xs[:, : T - j], (0, 0, 0, 0, j, 0))  # row t holds x[t - j]
        out = out + coef[:, :, j] * shifted * (offset >= j).view(1, T, 1, 1).to(x.dtype)
    return out.view(B, T, H)


class GroupedConv(nn.Module):
    """vLLM's DFlashGroupedConv: base_kernel [2, taps, H] (side 0 before the sub-layer, side 1 after),
    kernel_projection Linear(H -> 2 * taps * G). Starts as the identity (base tap 0 = 1, no dynamic part)."""

    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size, self.groups = taps, group_size, hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, h: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, T, H] -> (side-0 convolution of h [B, T, H], side-1 coefficients [B, T, taps, G])."""
        d = self.kernel_projection(h).view(*h.shape[:2], 2, self.taps, self.groups)
        return grouped_conv(h, d[:, :, 0], self.base_kernel[0], offset, self.group_size), d[:, :, 1]

    def finish(self, y: torch.Tensor, d1: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        return grouped_conv(y, d1, self.base_kernel[1], offset, self.group_size)


class DFlash2Layer(DenseDraftLayer):
    """The dense draft layer (same names) with attention_conv / mlp_conv around its two sub-layers."""

    def __init__(self, cfg: DFlash2Config, rotary: nn.Module):
        super().__init__(cfg, rotary)
        self.attention_conv = GroupedConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x, positions, ctx_kv, mask, offset):
        h, d = self.attention_conv.prepare(self.input_layernorm(x), offset)
        x = x + self.attention_conv.finish(self.self_attn(h, positions, ctx_kv, mask), d, offset)
        h, d = self.mlp_conv.prepare(self.post_attention_layernorm(x), offset)
        return x + self.mlp_conv.finish(self.mlp(h), d, offset)


class CandidateSelector(nn.Module):
    """vLLM's CandidateSelector. As the block objective's Markov head: latent(prev, h) = (predecessor_codebook[prev]
    * hidden_projection(norm(h)), predecessor_codebook[prev]); project(latent) = latent @ successor_codebook^T;
    markov_w2.weight = successor_codebook (what the fused loss reads). `head_input` is the draft's norm."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int, head_input, std: float = 0.02):
        super().__init__()
        self.rank, self.top_k = rank, top_k
        object.__setattr__(self, "_head_input", head_input)  # a draft method, never a submodule
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.reset_parameters(std)

    def reset_parameters(self, std: float = 0.02) -> None:
        """predecessor rows 1 (the edge starts as a predecessor-free low-rank bias, so every factor gets gradient),
        successor rows and the projection Normal(0, std)."""
        with torch.no_grad():
            self.predecessor_codebook.fill_(1.0)
            nn.init.normal_(self.successor_codebook, std=std)
            nn.init.normal_(self.hidden_projection.weight, std=std)

    @property
    def markov_w2(self) -> SimpleNamespace:
        return SimpleNamespace(weight=self.successor_codebook)

    def latent(self, prev: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev [...] (predecessor ids), h [..., H] pre-norm -> (latent [..., r], predecessor rows [..., r])."""
        e = self.predecessor_codebook[prev.long()]
        return e * self.hidden_projection(self._head_input(h)).to(e.dtype), e

    def project(self, latent: torch.Tensor) -> torch.Tensor:
        """latent [..., r] -> edge bias [..., V]."""
        return latent @ self.successor_codebook.t()

    def edge_scores(self, prev: torch.Tensor, hid: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """prev [B] predecessor ids, hid [B, r] = hidden_projection(n_k), cand [B, K] -> edge [B, K]."""
        e = self.predecessor_codebook[prev.long()] * hid  # [B, r]
        return torch.einsum("br,bkr->bk", e, self.successor_codebook[cand])


@register("dflash2", config=DFlash2Config, objective="block", serving="dspark.export.dflash2")
class DFlash2Draft(DSparkDenseDraft):
    """The dense DFlash draft (combine / context_kv / base_logits / the mask block, inherited) with DFlash2 layers
    and the candidate selector; proposals walk the K candidates as vLLM's DFlash2Speculator does."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)  # validates; builds fc, hidden_norm, DFlash layers, norm
        self.layers = nn.ModuleList(DFlash2Layer(cfg, self.rotary_emb) for _ in range(cfg.num_layers))
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank,
                                                    cfg.selector_top_k, self.head_input, cfg.initializer_range)
        self._init_weights()

    def _init_weights(self) -> None:
        """Normal(0, initializer_range) for the dense layers' matrices; the convolutions start as the identity and
        the selector as CandidateSelector.reset_parameters (DSparkDenseDraft.__init__ calls this before the
        DFlash2 modules exist, then __init__ here again)."""
        for name, p in self.named_parameters():
            if p.dim() == 2 and not name.startswith("candidate_selector.") and "_conv." not in name:
                nn.init.normal_(p, std=self.config.initializer_range)
        for m in self.modules():
            if isinstance(m, GroupedConv):
                m.reset_parameters()
            elif isinstance(m, CandidateSelector):
                m.reset_parameters(self.config.initializer_range)

    # the block objective's Markov head is the selector (DSparkDenseDraft sets markov_head = None in __init__)
    @property
    def markov_head(self):
        return self._modules.get("candidate_selector")

    @markov_head.setter
    def markov_head(self, value) -> None:
        if value is not None:
            raise AttributeError("DFlash2Draft.markov_head is its candidate_selector")

    def backbone(self, block_ids, block_positions, ctx, attn_mask) -> torch.Tensor:
        """block_ids/positions [B, T] (whole blocks of length Lb, T = A * Lb), attn_mask [B, T, S+T] (dense, or a
        PackedBlockMask) -> pre-norm hidden [B, T, H]. Lb is the mask's own-block width (the convolution's
        block_size = 1 + num_speculative_tokens in vLLM)."""
        T = block_ids.shape[1]
        if isinstance(attn_mask, PackedBlockMask):
            block_len = int(attn_mask.block_len)
        else:
            block_len = int(attn_mask[0, 0, attn_mask.shape[-1] - T:].sum())
        if block_len < 1 or T % block_len:
            raise ValueError(f"DFlash2Draft.backbone: {T} block slots are not whole blocks of {block_len}")
        offset = torch.arange(T, device=block_ids.device) % block_len  # [T]
        x = F.embedding(block_ids, self._shared("embed_weight")).to(self.fc.weight.dtype)  # [B, T, H]
        for layer, kv in zip(self.layers, ctx):
            x = layer(x, block_positions, kv, attn_mask, offset)
        return x

    def _sample_blocks(self, h: torch.Tensor, x0: torch.Tensor, temperature: float, gens: list,
                       forced_tokens: torch.Tensor | None) -> list[Proposal]:
        """vLLM's candidate walk: h [B, g, H] (pre-norm) of the g mask rows, x0 [B] anchors."""
        bsz, g = h.shape[:2]
        sel = self.candidate_selector
        unary = self.base_logits(h).float()  # [B, g, V]
        V = unary.shape[-1]
        cand_val, cand_ids = unary.topk(sel.top_k, dim=-1)  # [B, g, K]
        hid = sel.hidden_projection(self.head_input(h))  # [B, g, r]
        prev = x0.clone()
        tokens, q_rows, logit_rows = [], [], []
        for k in range(g):
            scores = (cand_val[:, k] + sel.edge_scores(prev, hid[:, k], cand_ids[:, k]).float())  # [B, K]
            picked = [sample_from_logits(scores[i], temperature, gens[i]) for i in range(bsz)]
            idx = torch.stack([t for t, _ in picked]).to(h.device)  # [B] index into the K candidates
            y = cand_ids[:, k].gather(1, idx.view(bsz, 1)).view(bsz)
            if forced_tokens is not None:
                y = forced_tokens[:, k].to(device=h.device, dtype=torch.long)
            q = torch.zeros(bsz, V, device=h.device).scatter_(1, cand_ids[:, k], torch.stack([p for _, p in picked]))
            logits = torch.full((bsz, V), float("-inf"), device=h.device).scatter_(1, cand_ids[:, k], scores)
            tokens.append(y)
            q_rows.append(q)
            logit_rows.append(logits)
            prev = y
        toks, qs, lgs = torch.stack(tokens, 1), torch.stack(q_rows, 1), torch.stack(logit_rows, 1)
        return [Proposal(tokens=toks[i], q_probs=qs[i], conf=None, logits=lgs[i]) for i in range(bsz)]


__all__ = ["CandidateSelector", "DFlash2Config", "DFlash2Draft", "DFlash2Layer", "GroupedConv", "grouped_conv"]
