"""Acceptance metrics counted exactly as vLLM's spec-decode metrics do (docs/CONTRACTS.md §7).

Per verify step: drafts += 1, draft_tokens += len(draft), accepted += number of accepted drafts (the
bonus / correction token is NOT counted), accepted_per_pos[i] += 1 for every i < n_accepted.
    mean acceptance length  AL  = 1 + accepted / drafts          (includes the bonus token)
    per-position rate       r_i = accepted_per_pos[i] / drafts   (cumulative: P(first i+1 all accepted))
    conditional rate        r_i / r_{i-1}                        (r_{-1} = 1)
    draft acceptance rate       = accepted / draft_tokens
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceCounter:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def update(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Record one verify step of `num_draft_tokens` drafts of which the first `num_accepted` survived."""
        if num_draft_tokens < 0 or not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(
                f"need 0 <= num_accepted <= num_draft_tokens, got accepted={num_accepted} drafted={num_draft_tokens}"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: "AcceptanceCounter") -> "AcceptanceCounter":
        """Add `other`'s counts into this counter (e.g. across prompts); returns self."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine = self.accepted_per_pos + [0] * (n - len(self.accepted_per_pos))
        theirs = other.accepted_per_pos + [0] * (n - len(other.accepted_per_pos))
        self.accepted_per_pos = [x + y for x, y in zip(mine, theirs)]
        return self

    @classmethod
    def merged(cls, counters) -> "AcceptanceCounter":
        total = cls()
        for c in counters:
            total.merge(c)
        return total

    def report(self) -> dict:
        """Counts and derived rates; rates are None when undefined (no drafts, or r_{i-1} == 0)."""
        d = self.num_drafts
        rates = [c / d for c in self.accepted_per_pos] if d else [None] * len(self.accepted_per_pos)
        conditional, prev = [], 1.0
        for r in rates:
            conditional.append(None if r is None or not prev else r / prev)
            prev = r
        return {
            "num_drafts": d,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "mean_acceptance_length": 1 + self.num_accepted_tokens / d if d else None,
            "draft_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None,
            "per_position_rate": rates,
            "per_position_conditional_rate": conditional,
        }


def acceptance_length_from_conditional(conditional: list[float | None]) -> float:
    """AL = 1 + sum_i prod_{j<=i} c_j from the per-position conditional rates c (None: never reached, 0). Equals the
    counted AL whenever accepted_per_pos covers every accepted token (sum_i accepted_per_pos[i] = accepted), which
    vLLM's counting guarantees; benchmarks/acceptance_decomposition.py mixes two drafts' c through it."""
    al, alive = 1.0, 1.0
    for c in conditional:
        alive *= float(c or 0.0)
        al += alive
    return al
