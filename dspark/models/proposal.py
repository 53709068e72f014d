"""What a draft hands the verifier, and how it samples: shared by every family's inference path.

`Proposal` is one request's block of drafts; `sample_from_logits` is the draft-side sampling (argmax + one-hot q
at T = 0, categorical at T > 0). `RequestProposer` is the eval interface of drafts that propose request by request
(MTP chains with their per-request draft cache): `propose_batch` over the rounds' requests from their `propose`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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


class RequestProposer:
    """Eval interface of a draft that proposes one request at a time:
        draft.propose(feats, tokens [a+1] (x0 last), *, num_drafts, temperature, generator[, cache]) -> Proposal
    with feats the TargetFeatures of positions 0..a-1. `new_cache()` gives a request's draft-side cache, kept by
    the decoding loop across its rounds (None: the draft keeps none)."""

    def new_cache(self):
        return None

    def propose_batch(self, feats: list, tokens: list[torch.Tensor], *, num_drafts: int, temperature: float,
                      generators: list, caches: list | None = None) -> list[Proposal]:
        """One Proposal per request i after x0 = tokens[i][-1] at position a_i = len(tokens[i]) - 1; feats[i]
        covers positions 0..a_i-1 at least."""
        caches = caches if caches is not None else [None] * len(tokens)
        return [self.propose(f.prefix(t.numel() - 1), t, num_drafts=num_drafts, temperature=temperature, generator=g,
                             **({} if c is None else {"cache": c}))
                for f, t, g, c in zip(feats, tokens, generators, caches)]


__all__ = ["Proposal", "RequestProposer", "sample_from_logits"]
