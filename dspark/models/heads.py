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


class MarkovHead(nn.Module):
    """Low-rank previous-token bias on the draft logits; one subclass per kind (MARKOV_HEADS).

    Parameters: markov_w1 (Embedding [vocab, rank]), markov_w2 (Linear rank -> draft_vocab, no bias), plus the
    kind's own layers (gated: gate_proj, rnn: joint_proj). A kind implements `block_latent` (teacher-forced,
    whole blocks) and `step_latent` (one position at inference); everything else is shared.
    `draft_to_target` (reduced-vocabulary drafts): a callable -> [V_draft] long; the [.., V_draft] bias is then
    placed at those target ids of a [.., vocab] tensor (0 elsewhere).
    """

    kind: str

    def __init__(self, vocab: int, draft_vocab: int, rank: int, hidden: int, draft_to_target=None):
        super().__init__()
        if min(vocab, draft_vocab, rank, hidden) < 1:
            raise ValueError(
                f"MarkovHead sizes must be positive: vocab={vocab} draft_vocab={draft_vocab} "
                f"rank={rank} hidden={hidden}"
            )
        self.vocab, self.draft_vocab, self.rank, self.hidden = vocab, draft_vocab, rank, hidden
        object.__setattr__(self, "_draft_to_target", draft_to_target)  # a draft method: never a submodule
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        self.add_layers(rank, hidden)
        self.reset_parameters()

    def add_layers(self, rank: int, hidden: int) -> None:
        """The kind's own layers (none for vanilla)."""

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
        """latent [..., r] -> bias = latent @ markov_w2^T: [..., V_draft], or [..., vocab] with draft_to_target."""
        small = self.markov_w2(latent.to(self.markov_w2.weight.dtype))  # [..., V_draft]
        if self._draft_to_target is None:
            return small
        out = small.new_zeros(*small.shape[:-1], self.vocab)  # [..., V]
        return out.index_copy_(out.dim() - 1, self._draft_to_target(), small)

    def block_latent(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """e [B, A, g, r], h [B, A, g, H] -> latent [B, A, g, r] (teacher-forced, state reset per block)."""
        raise NotImplementedError

    def step_latent(self, e: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """e [N, r], h [N, H], state -> (latent [N, r], new state); one block position."""
        raise NotImplementedError

    # -- teacher-forced block ----------------------------------------------------------------------
    def latent(self, prev: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head as latent @ markov_w2^T: prev [B, A, g] (token before each block position; prev[..., 0] =
        anchor token), h [B, A, g, H] -> (latent [B, A, g, r], feat [B, A, g, r]); forward = (project(latent),
        feat). The fused loss (dspark.ops.fused_loss) takes the latent and markov_w2 instead of [.., V] logits."""
        e = self.embed(prev)  # [B, A, g, r]
        return self.block_latent(e, h), e

    def forward(self, prev: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced over whole blocks: prev [B, A, g], h [B, A, g, H] -> (bias [B, A, g, V_draft],
        feat [B, A, g, r])."""
        latent, e = self.latent(prev, h)
        return self.project(latent), e

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
        latent, state = self.step_latent(e, h, state)
        return self.project(latent), e, state


class VanillaMarkovHead(MarkovHead):
    """latent_k = e_k (vLLM's DSparkMarkovHead)."""

    kind = "vanilla"

    def block_latent(self, e, h):
        return e

    def step_latent(self, e, h, state):
        return e, None


class GatedMarkovHead(MarkovHead):
    """latent_k = sigmoid(gate_proj([h_k; e_k])) * e_k (DeepSpec)."""

    kind = "gated"

    def add_layers(self, rank: int, hidden: int) -> None:
        self.gate_proj = nn.Linear(hidden + rank, rank)

    def block_latent(self, e, h):
        """e [..., r], h [..., H] -> sigmoid(gate_proj([h; e])) * e  [..., r]."""
        gate_in = torch.cat([h.to(e.dtype), e], dim=-1)  # [..., H + r]
        return torch.sigmoid(self.gate_proj(gate_in)) * e

    def step_latent(self, e, h, state):
        return self.block_latent(e, h), None


class RNNMarkovHead(MarkovHead):
    """latent_k = tanh(o_k) with a GRU-like state over the block (DeepSpec):
    [g; c; o] = joint_proj([s_{k-1}; e_k; h_k]);  s_k = sigmoid(g) s_{k-1} + (1 - sigmoid(g)) tanh(c), s_{-1} = 0."""

    kind = "rnn"

    def add_layers(self, rank: int, hidden: int) -> None:
        self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def _cell(self, state: torch.Tensor, e: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One GRU-like step. state [N, r], e [N, r], h [N, H] -> (latent [N, r], new state [N, r])."""
        z = torch.cat([state.to(e.dtype), e, h.to(e.dtype)], dim=-1)  # [N, 2r + H]
        gate_raw, cand_raw, out_raw = self.joint_proj(z).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        new_state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return torch.tanh(out_raw), new_state

    def block_latent(self, e, h):
        """e [..., g, r], h [..., g, H] -> latents [..., g, r], the state reset at every block start."""
        lead, g = e.shape[:-2], e.shape[-2]
        e_flat = e.reshape(-1, g, self.rank)  # [N, g, r]
        h_flat = h.reshape(-1, g, h.shape[-1])  # [N, g, H]
        state = e_flat.new_zeros(e_flat.shape[0], self.rank)  # [N, r]
        latents = []
        for k in range(g):
            latent, state = self._cell(state, e_flat[:, k], h_flat[:, k])
            latents.append(latent)
        return torch.stack(latents, dim=1).reshape(*lead, g, self.rank)

    def step_latent(self, e, h, state):
        if state is None:
            state = e.new_zeros(e.shape[0], self.rank)
        return self._cell(state, e, h)


MARKOV_HEADS: dict[str, type[MarkovHead]] = {c.kind: c for c in (VanillaMarkovHead, GatedMarkovHead, RNNMarkovHead)}
MARKOV_HEAD_KINDS = tuple(MARKOV_HEADS)


def build_markov_head(vocab: int, draft_vocab: int, rank: int, hidden: int, kind: str = "vanilla",
                      draft_to_target=None) -> MarkovHead:
    """The Markov head of `kind` (markov_head_type)."""
    if kind not in MARKOV_HEADS:
        raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_KINDS}, got {kind!r}")
    return MARKOV_HEADS[kind](vocab, draft_vocab, rank, hidden, draft_to_target)


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
