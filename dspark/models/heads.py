"""DSpark sequential heads: the Markov head (vanilla / gated / RNN) and the confidence head.

Markov head (SPEC 2.6): the previously sampled token prev_k adds a low-rank bias to the base logits,
    e_k = markov_w1[prev_k]            (Embedding V x r)
    bias_k = latent_k @ markov_w2^T    (markov_w2 weight [V_draft, r])
with latent_k = e_k (vanilla), sigmoid(gate_proj([h_k; e_k])) * e_k (gated), or, for the RNN head,
tanh(o_k) where a GRU-like state s_k over the block gives
    [g; c; o] = joint_proj([s_{k-1}; e_k; h_k]);  s_k = sigmoid(g) s_{k-1} + (1 - sigmoid(g)) tanh(c)
(s_{-1} = 0 at the start of every block). These variants follow deepseek-ai/DeepSpec.

The feature handed to the confidence head is e_k = markov_w1[prev_k] for every kind (DeepSpec's
`confidence_head_with_markov` uses the raw previous-token embedding).

Confidence head (SPEC 2.7): c_k = sigmoid(proj([h_k; feat_k])), proj Linear(H + r -> 1), computed
in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

MARKOV_HEAD_KINDS = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    """Low-rank previous-token bias on the draft logits.

    Parameters: markov_w1 (Embedding [vocab, rank]), markov_w2 (Linear rank -> draft_vocab, no bias),
    plus gate_proj (gated: Linear hidden+rank -> rank) or joint_proj (rnn: Linear 2*rank+hidden -> 3*rank).
    """

    def __init__(self, vocab: int, draft_vocab: int, rank: int, hidden: int, kind: str = "vanilla"):
        super().__init__()
        if kind not in MARKOV_HEAD_KINDS:
            raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_KINDS}, got {kind!r}")
        if min(vocab, draft_vocab, rank, hidden) < 1:
            raise ValueError(
                f"MarkovHead sizes must be positive: vocab={vocab} draft_vocab={draft_vocab} "
                f"rank={rank} hidden={hidden}"
            )
        self.kind = kind
        self.vocab = vocab
        self.draft_vocab = draft_vocab
        self.rank = rank
        self.hidden = hidden
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) weights, zero biases (DeepSpec's HF default init)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    # -- pieces ------------------------------------------------------------------------------------
    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        """e = markov_w1[prev]: prev [...] int -> [..., r]."""
        return self.markov_w1(prev.long())

    def project(self, latent: torch.Tensor) -> torch.Tensor:
        """latent [..., r] -> bias [..., V_draft] = latent @ markov_w2^T."""
        return self.markov_w2(latent.to(self.markov_w2.weight.dtype))

    def _gated_latent(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """e [..., r], h [..., H] -> sigmoid(gate_proj([h; e])) * e  [..., r]."""
        gate_in = torch.cat([h.to(e.dtype), e], dim=-1)  # [..., H + r]
        return torch.sigmoid(self.gate_proj(gate_in)) * e

    def _rnn_cell(self, state: torch.Tensor, e: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One GRU-like step. state [N, r], e [N, r], h [N, H] -> (latent [N, r], new state [N, r])."""
        z = torch.cat([state.to(e.dtype), e, h.to(e.dtype)], dim=-1)  # [N, 2r + H]
        gate_raw, cand_raw, out_raw = self.joint_proj(z).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        new_state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return torch.tanh(out_raw), new_state

    # -- teacher-forced block ----------------------------------------------------------------------
    def forward(self, prev: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced over whole blocks.

        prev [B, A, g] (token before each block position; prev[..., 0] = anchor token),
        h [B, A, g, H] backbone hidden -> (bias [B, A, g, V_draft], feat [B, A, g, r]).
        The RNN kind scans along g with its state reset to zero at the start of every block.
        """
        e = self.embed(prev)  # [B, A, g, r]
        if self.kind == "vanilla":
            latent = e
        elif self.kind == "gated":
            latent = self._gated_latent(e, h)
        else:
            latent = self._rnn_scan(e, h)
        return self.project(latent), e

    def _rnn_scan(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """e [..., g, r], h [..., g, H] -> latents [..., g, r], state reset per block."""
        lead = e.shape[:-2]
        g = e.shape[-2]
        e_flat = e.reshape(-1, g, self.rank)  # [N, g, r]
        h_flat = h.reshape(-1, g, h.shape[-1])  # [N, g, H]
        state = e_flat.new_zeros(e_flat.shape[0], self.rank)  # [N, r]
        latents = []
        for k in range(g):
            latent, state = self._rnn_cell(state, e_flat[:, k], h_flat[:, k])
            latents.append(latent)
        return torch.stack(latents, dim=1).reshape(*lead, g, self.rank)

    # -- inference ---------------------------------------------------------------------------------
    def step(
        self, prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One block position for N sequences.

        prev [N] int, h [N, H], state (RNN: [N, r] or None at the block start; other kinds: ignored)
        -> (bias [N, V_draft], feat [N, r], new state ([N, r] for RNN, None otherwise)).
        Matches forward() position by position when fed the same prev tokens.
        """
        e = self.embed(prev)  # [N, r]
        if self.kind == "vanilla":
            return self.project(e), e, None
        if self.kind == "gated":
            return self.project(self._gated_latent(e, h)), e, None
        if state is None:
            state = e.new_zeros(e.shape[0], self.rank)
        latent, state = self._rnn_cell(state, e, h)
        return self.project(latent), e, state


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(proj([h_k; feat_k])); proj Linear(in_dim -> 1), evaluated in fp32."""

    def __init__(self, in_dim: int, bias: bool = False):
        super().__init__()
        if in_dim < 1:
            raise ValueError(f"ConfidenceHead in_dim must be positive, got {in_dim}")
        self.in_dim = in_dim
        self.proj = nn.Linear(in_dim, 1, bias=bias)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.proj.weight, mean=0.0, std=std)
        if self.proj.bias is not None:
            nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor, feat: torch.Tensor | None = None) -> torch.Tensor:
        """h [..., H], feat [..., r] (or None when the head reads h only) -> logit [...] fp32."""
        x = h.float() if feat is None else torch.cat([h.float(), feat.float()], dim=-1)  # [..., in_dim]
        if x.shape[-1] != self.in_dim:
            raise ValueError(f"ConfidenceHead expects {self.in_dim} input features, got {x.shape[-1]}")
        bias = None if self.proj.bias is None else self.proj.bias.float()
        return torch.nn.functional.linear(x, self.proj.weight.float(), bias).squeeze(-1)
