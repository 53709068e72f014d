"""Why a greedy speculative output differs from the plain target's (eval's `exact k/n` below n/n).

At T=0 speculative decoding emits the target's argmax at every position, so the two outputs are equal token for token
up to rounding: the verify forward runs the target over several tokens at once, the plain decode over one, and in
bfloat16 those two shapes of one computation round differently. Where the target's two best tokens are (nearly) tied,
that flips the argmax and the outputs part. `greedy_difference` finds the first differing request and token and
measures the target's top-2 logit margin there (a float32 LM head on the target's hidden state, with the committed
prefix the two runs share); `difference_line` says in words whether that margin is within the dtype's rounding (rerun in
float32 for an exact check) or well above it (not rounding: the speculative decoding lost exactness there).
"""
from __future__ import annotations

import torch

from dspark.ops.lm_head import lm_head_logits
from dspark.targets.hf_target import FrozenTarget

NEAR_TIE_STEPS = 4  # a margin within this many rounding steps of the dtype at the top logit is a rounding near-tie


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where token lists a and b differ (one ending first: its length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def top2_margin(target: FrozenTarget, ids: torch.Tensor) -> tuple[float, float]:
    """ids [S] -> (top-1 minus top-2 logit, top-1 logit) of the target's next-token logits after them, from its hidden
    state (in its dtype) through a float32 LM head."""
    final = target.features(ids[None].to(target.device)).final[0, -1]  # [H]
    top = lm_head_logits(final, target.lm_head_weight, True).topk(2).values
    return float(top[0] - top[1]), float(top[0])


def greedy_difference(target: FrozenTarget, spec, plain) -> dict | None:
    """The first request (conversation order, then turn) whose greedy speculative output differs from the plain
    target's, with the target's top-2 margin at the first differing token (`token`: its 0-based index in the
    output); None when every request agrees. `spec`,
    `plain`: dspark.evaluation.run_eval.ConversationRuns of the same conversations (spec's prompts recorded). Within
    a conversation the first differing request has the same prompt in both runs (its earlier turns agree)."""
    requests = [(c, t, s.tolist(), p.tolist()) for c, (st, pt) in enumerate(zip(spec.outputs, plain.outputs))
                for t, (s, p) in enumerate(zip(st, pt))]
    differing = [i for i, (_, _, s, p) in enumerate(requests) if s != p]
    if not differing:
        return None
    c, t, s, p = requests[differing[0]]
    k = first_difference(s, p)
    prompt = spec.prompts[c][t]
    margin, top = top2_margin(target, torch.cat([prompt, torch.tensor(p[:k], dtype=prompt.dtype)]))
    dtype = target.lm_head_weight.dtype
    step = torch.finfo(dtype).eps * max(1.0, abs(top))  # about one rounding step of the dtype at the top logit
    tok = target.tokenizer

    def word(ids: list[int], i: int) -> str | None:
        return None if i >= len(ids) else (tok.decode([ids[i]]) if tok is not None else str(ids[i]))

    return {"request": differing[0] + 1, "conversation": c + 1, "turn": t + 1, "token": k,
            "speculative": word(s, k), "target": word(p, k), "differing": len(differing), "requests": len(requests),
            "margin": margin, "dtype": str(dtype).removeprefix("torch."), "rounding_step": step,
            "near_tie": margin <= NEAR_TIE_STEPS * step}


def difference_line(name: str, d: dict) -> str:
    """One console line for a benchmark's greedy_difference."""
    dtype = d["dtype"]
    tokens = ("" if d["speculative"] is None or d["target"] is None
              else f"{d['speculative']!r} where the target has {d['target']!r}; ")
    head = (f"{name}: request {d['request']} (conversation {d['conversation']}, turn {d['turn']}) differs from the "
            f"plain target's output at output token {d['token'] + 1} ({tokens}{d['differing']} of {d['requests']} "
            f"requests differ): the target's top-2 logit margin there is {d['margin']:.4g} in {dtype}")
    if not d["near_tie"]:
        return (f"{head}, well above {dtype} rounding (one step at that logit: {d['rounding_step']:.2g}): not a "
                "rounding near-tie, so the speculative output lost exactness there (worth reporting with this run)")
    if dtype == "float32":
        return (f"{head}, within float32 rounding (one step at that logit: {d['rounding_step']:.2g}): a near-exact "
                "tie that the verify forward (several tokens) and the one-token decode round differently")
    return (f"{head}, within {dtype} rounding (one step at that logit: {d['rounding_step']:.2g}): the verify forward "
            "(several tokens) and the one-token decode round differently and the near-tie flips; rerun with "
            "target.dtype=float32 for exact checks")
