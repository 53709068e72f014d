"""Is the target degenerate? A near-uniform target (random weights) or one that repeats a single token makes
acceptance numbers look good while meaning nothing: a draft matches a uniform distribution closely (high tau_prob
with zero top-1 agreement), and a target that only emits "\\n" is trivially predicted (AL at its maximum).
Training measures the target's next-token distribution on held-out rows; eval counts the target's own output
tokens. Either way the verdict is one warning line that says what the number then means."""
from __future__ import annotations

import math
from collections import Counter

import torch

NEAR_UNIFORM = 0.9  # mean entropy >= this share of ln V: the target is (close to) a uniform guess
ONE_TOKEN = 0.5  # one token is the target's top choice / output at >= this share of positions


def distribution_health(logits: torch.Tensor) -> dict:
    """The target's next-token distribution at N held-out positions, logits [N, V] -> mean entropy (nats), ln V,
    its most frequent top-1 token and that token's share of the N positions."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    entropy = -(logp.exp() * logp).sum(-1).mean()
    top, count = Counter(logp.argmax(-1).tolist()).most_common(1)[0]
    return {"positions": int(logits.shape[0]), "entropy": float(entropy), "ln_vocab": math.log(logits.shape[-1]),
            "top_token": int(top), "top_token_share": count / logits.shape[0]}


def output_health(outputs: list[list[int]]) -> dict | None:
    """The target's generated tokens (greedy: the speculative output IS the target's) -> the most frequent token
    and its share of all generated tokens; None when nothing was generated."""
    counts = Counter(t for out in outputs for t in out)
    total = sum(counts.values())
    if not total:
        return None
    top, count = counts.most_common(1)[0]
    return {"tokens": total, "top_token": int(top), "top_token_share": count / total}


def degenerate_warning(health: dict | None, tokenizer=None, what: str = "tau_prob") -> str | None:
    """One warning line when `health` (distribution_health / output_health) shows a degenerate target, else None.
    `what`: the number the warning qualifies (tau_prob in training, AL in eval)."""
    if not health:
        return None
    token = repr(tokenizer.decode([health["top_token"]])) if tokenizer is not None else f"id {health['top_token']}"
    if "entropy" in health and health["entropy"] >= NEAR_UNIFORM * health["ln_vocab"]:
        return (f"warning: the target is near-uniform (mean entropy {health['entropy']:.2f} of ln V = "
                f"{health['ln_vocab']:.2f} nats on {health['positions']} held-out positions; random weights?): {what} "
                "then measures how closely the draft matches noise, not a draft worth serving")
    if health["top_token_share"] >= ONE_TOKEN:
        where = (f"{health['top_token_share']:.0%} of its {health['tokens']} output tokens" if "tokens" in health else
                 f"its top choice at {health['top_token_share']:.0%} of {health['positions']} held-out positions")
        return (f"warning: the target repeats one token ({token}: {where}): {what} then measures predicting that "
                "token, not real text")
    return None
