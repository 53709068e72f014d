"""Reference speculative decoding loop (chain drafting) and plain target decoding, batch size 1.

Correctness over speed: every target call recomputes the full prefix (no KV cache) through the same
`target.features` + `target.logits_from_final` path, so plain and speculative decoding score tokens
with the same function. One loop step:

    sequence so far: [prompt, generated...]; x0 = its last token (the target's bonus/correction token),
    at position a; the target's layer outputs for positions 0..a-1 are known from the previous forward.
    1. propose g drafts y_0..y_{g-1} from those context features and x0        (dspark.evaluation.propose)
    2. one target forward over [.., x0, y_0..y_{g-1}]: rows a..a+g are p_0..p_g
    3. verify (greedy at T=0, rejection sampling at T>0): n accepted + one next token
    4. append y_0..y_{n-1}, next; next becomes x0; the same forward's features at 0..a+n are the context
       of the next step (causal target: they do not depend on the rejected drafts).
Stops after an eos token (kept in the output) or exactly at max_new_tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.evaluation.metrics import AcceptanceCounter
from dspark.evaluation.propose import Proposal, propose, sample_from_logits
from dspark.evaluation.verify import verify_greedy, verify_rejection
from dspark.targets.hf_target import FrozenTarget, TargetFeatures


@dataclass
class StepStats:
    """One verify step."""

    anchor_pos: int  # position a of x0
    draft_tokens: list[int]  # y_0..y_{g-1}
    num_accepted: int  # n (bonus excluded)
    next_token: int  # correction (n < g) or bonus (n == g) token from the target
    conf: list[float] | None  # draft confidences c_k, None without a confidence head

    @property
    def num_drafts(self) -> int:
        return len(self.draft_tokens)


def acceptance_counter(stats: Sequence[StepStats]) -> AcceptanceCounter:
    """vLLM-style counts of a list of verify steps."""
    counter = AcceptanceCounter()
    for s in stats:
        counter.update(s.num_drafts, s.num_accepted)
    return counter


def _prompt_tensor(prompt_ids, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().to(device)  # [P]
    if ids.numel() == 0:
        raise ValueError("prompt_ids is empty: the target needs at least one token to condition on")
    return ids


def _eos_set(eos_token_id) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    return frozenset(int(t) for t in eos_token_id)


def _check_common(max_new_tokens: int, temperature: float) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")


@torch.no_grad()
def score(target: FrozenTarget, ids: torch.Tensor) -> tuple[TargetFeatures, torch.Tensor]:
    """One full-prefix target forward. ids [L] -> (features of batch 1 and length L, logits [L, V] fp32)."""
    feats = target.features(ids.unsqueeze(0))
    return feats, target.logits_from_final(feats.final[0]).float()


def draft_propose(draft, feats: TargetFeatures, tokens: torch.Tensor, *, num_drafts: int, mask_token_id: int,
                  layout: str, window: int | None, temperature: float, generator) -> Proposal:
    """One block of drafts after x0 = tokens[-1] at position a = len(tokens) - 1; feats cover 0..a-1 at least.

    Drafts with their own inference path (MTP) implement `draft.propose(feats, tokens, num_drafts=,
    temperature=, generator=)`; DSpark / DFlash drafts go through dspark.evaluation.propose.
    """
    a = tokens.numel() - 1
    if hasattr(draft, "propose"):
        return draft.propose(feats.prefix(a), tokens, num_drafts=num_drafts, temperature=temperature,
                             generator=generator)
    return propose(draft, feats.aux, int(tokens[-1]), a, num_drafts=num_drafts, mask_token_id=mask_token_id,
                   layout=layout, window=window, temperature=temperature, generator=generator)


class _Output:
    """Generated tokens with the stopping rule (eos kept, hard cap at max_new_tokens)."""

    def __init__(self, max_new_tokens: int, eos: frozenset[int]):
        self.tokens: list[int] = []
        self.max_new_tokens, self.eos = max_new_tokens, eos
        self.done = max_new_tokens == 0

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if self.done:
                return
            self.tokens.append(int(t))
            self.done = int(t) in self.eos or len(self.tokens) >= self.max_new_tokens


def target_generate(
    target: FrozenTarget,
    prompt_ids,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Plain autoregressive decoding, one full-prefix target forward per token. Returns tokens [N] long."""
    _check_common(max_new_tokens, temperature)
    seq = _prompt_tensor(prompt_ids, target.device)
    out = _Output(max_new_tokens, _eos_set(eos_token_id))
    while not out.done:
        _, logits = score(target, seq)
        tok, _ = sample_from_logits(logits[-1], temperature, generator)
        out.extend([int(tok)])
        seq = torch.cat([seq, tok.view(1).to(seq.device)])
    return torch.tensor(out.tokens, dtype=torch.long)


def _verify(prop: Proposal, rows: torch.Tensor, temperature: float, generator) -> tuple[int, int]:
    """rows [g+1, V] target logits -> (n_accepted, next_token)."""
    if temperature == 0:
        return verify_greedy(prop.tokens, rows)
    return verify_rejection(prop.tokens, prop.q_probs, torch.softmax(rows / temperature, dim=-1), generator)


@torch.no_grad()
def speculative_generate(
    target: FrozenTarget,
    draft: torch.nn.Module,
    prompt_ids,
    *,
    max_new_tokens: int,
    num_drafts: int,
    mask_token_id: int,
    layout: str = "anchor",
    window: int | None = None,
    temperature: float = 0.0,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, list[StepStats]]:
    """Speculative decoding of one prompt. prompt_ids [P] -> (generated tokens [N] long, one StepStats per
    verify step). At T=0 the tokens equal `target_generate`'s; at T>0 they follow the same distribution."""
    _check_common(max_new_tokens, temperature)
    seq = _prompt_tensor(prompt_ids, target.device)  # [a] tokens whose target features are known
    out = _Output(max_new_tokens, _eos_set(eos_token_id))
    stats: list[StepStats] = []
    if out.done:
        return torch.zeros(0, dtype=torch.long), stats

    feats, logits = score(target, seq)  # prefill: features of positions 0..P-1, logits [P, V]
    x0, _ = sample_from_logits(logits[-1], temperature, generator)
    x0 = int(x0)
    out.extend([x0])
    g = int(num_drafts)
    while not out.done:
        a = seq.numel()  # position of x0
        prop = draft_propose(draft, feats, torch.cat([seq, seq.new_tensor([x0])]), num_drafts=g,
                             mask_token_id=mask_token_id, layout=layout, window=window,
                             temperature=temperature, generator=generator)
        ys = prop.tokens.to(seq.device)  # [g]
        full = torch.cat([seq, seq.new_tensor([x0]), ys])  # [a + 1 + g]
        feats_full, logits = score(target, full)
        n, nxt = _verify(prop, logits[a : a + g + 1], temperature, generator)  # rows p_0..p_g
        stats.append(StepStats(anchor_pos=a, draft_tokens=ys.tolist(), num_accepted=n, next_token=nxt,
                               conf=None if prop.conf is None else prop.conf.tolist()))
        out.extend(ys[:n].tolist() + [nxt])
        seq = full[: a + 1 + n]  # [.., x0, y_0..y_{n-1}]
        feats = feats_full.prefix(a + 1 + n)  # features of exactly those positions
        x0 = nxt
    return torch.tensor(out.tokens, dtype=torch.long), stats
