"""Speculative decoding (chain drafting) of a batch of requests, and plain target decoding.

The target side runs in a `TargetSession` (KV cache, requests of different lengths batched with left
padding). One round, for every unfinished request:

    sequence so far: [prompt, generated...]; x0 = its last token (the target's bonus/correction token),
    at position a; the target's layer outputs for positions 0..a-1 are cached from earlier forwards.
    1. propose g drafts y_0..y_{g-1} from those context features and x0      (draft.propose_batch: the family's
       inference path, with its settings -- layout, mask token, window -- from draft.config)
       draft_sample_method (vLLM's speculative_config.draft_sample_method, vllm/config/speculative.py:634-640):
       "probabilistic" samples y_k from the draft distribution at the request temperature and verifies with
       the full q; "greedy" (vLLM's default) takes the draft argmax and verifies with a one-hot q
       (v1/worker/gpu/spec_decode/speculator.py:444-482, rejection_sampler_utils.py:191-194). Both are lossless.
    2. ONE batched target forward over [x0, y_0..y_{g-1}] of every request: rows 0..g are p_0..p_g
    3. verify (greedy at T=0, rejection sampling at T>0): n accepted + one next token; rejection_sample_method
       (vLLM's speculative_config.rejection_sample_method): "standard" (token by token) or "block" (Sun et al.'s
       block verification, dspark.evaluation.verify.verify_block); both greedy at T=0, as vLLM
    4. keep x0, y_0..y_{n-1} in the cache (their features are the next context: the target is causal, so
       they do not depend on the rejected drafts); next becomes x0.
Each request also keeps a draft-side cache across its rounds (`draft.new_cache()`; block drafts: the draft's context
KV of the verified positions, MTP: the chain's step-0 rows), so step 1 projects only the 1 + n positions verified
in the last round, as vLLM's drafters do (`draft_cache=False`: the whole context every round, the reference).
Stops after an eos token (kept in the output) or exactly at max_new_tokens. Each request draws its random
numbers from its own generator, so its output does not depend on what it is batched with.

`target_generate` is the uncached one-request reference (full-prefix recompute per token): the oracle the
tests compare against. `plain_generate` is the batched, cached plain decoding eval.py times against.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dspark.evaluation.adaptive import estimator_features
from dspark.evaluation.metrics import AcceptanceCounter
from dspark.evaluation.target_session import TargetSession
from dspark.evaluation.verify import REJECTION_SAMPLE_METHODS, verify_block, verify_greedy, verify_rejection
from dspark.models.proposal import Proposal, sample_from_logits
from dspark.targets.hf_target import FrozenTarget, TargetFeatures


@dataclass
class StepStats:
    """One verify step."""

    anchor_pos: int  # position a of x0
    draft_tokens: list[int]  # y_0..y_{g-1}
    num_accepted: int  # n (bonus excluded)
    next_token: int  # correction (n < g) or bonus (n == g) token from the target
    conf: list[float] | None  # draft confidences c_k, None without a confidence head
    conf_logits: list[float] | None = None  # raw confidence logits (calibration / STS)
    est_feature: list[float] | None = None  # vLLM's online acceptance estimator's feature per draft (adaptive.py)

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


def _verify(prop: Proposal, rows: torch.Tensor, temperature: float, generator,
            method: str = "standard") -> tuple[int, int]:
    """rows [g+1, V] target logits -> (n_accepted, next_token)."""
    if temperature == 0:
        return verify_greedy(prop.tokens, rows)
    verify = verify_block if method == "block" else verify_rejection
    return verify(prop.tokens, prop.q_probs, torch.softmax(rows / temperature, dim=-1), generator)


@dataclass
class Timing:
    """Wall-clock split of a decoding run (seconds). overhead = everything outside model forwards."""

    rounds: int = 0
    total_s: float = 0.0
    target_s: float = 0.0
    draft_s: float = 0.0

    @property
    def overhead_s(self) -> float:
        return max(self.total_s - self.target_s - self.draft_s, 0.0)

    def report(self) -> dict:
        per = (lambda x: x / self.rounds) if self.rounds else (lambda x: None)
        return {"rounds": self.rounds, "total_s": round(self.total_s, 4), "target_forward_s": round(self.target_s, 4),
                "draft_forward_s": round(self.draft_s, 4), "overhead_s": round(self.overhead_s, 4),
                "overhead_share": self.overhead_s / self.total_s if self.total_s else None,
                "overhead_per_round_ms": None if not self.rounds else 1e3 * per(self.overhead_s),
                "round_ms": None if not self.rounds else 1e3 * per(self.total_s)}


@dataclass
class Decoded:
    """The outcome of decoding a batch: tokens and verify steps per request, and the timing split."""

    tokens: list[torch.Tensor]  # [N_i] long per request
    steps: list[list[StepStats]]  # per request (empty for plain decoding)
    timing: Timing = field(default_factory=Timing)
    target_forwards: int = 0  # batched target forwards, prefill included


def _generators(generators, n: int) -> list:
    if generators is None:
        return [None] * n
    if isinstance(generators, torch.Generator):
        generators = [generators]
    if len(generators) != n:
        raise ValueError(f"got {len(generators)} generators for {n} prompts (one per request)")
    return list(generators)


def _timed(timing: Timing, attr: str, fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    setattr(timing, attr, getattr(timing, attr) + time.perf_counter() - t0)
    return out


def _start(target: FrozenTarget, prompts, max_new_tokens: int, temperature: float, eos_token_id, generators):
    """Prefill every request; sample its first token. -> (session, outputs, x0 per request, timing)."""
    _check_common(max_new_tokens, temperature)
    seqs = [_prompt_tensor(p, target.device) for p in prompts]
    gens = _generators(generators, len(seqs))
    eos = _eos_set(eos_token_id)
    outs = [_Output(max_new_tokens, eos) for _ in seqs]
    timing = Timing()
    t0 = time.perf_counter()
    session = TargetSession(target, seqs)
    logits = _timed(timing, "target_s", session.prefill)  # [B, V]
    x0 = []
    for i, out in enumerate(outs):
        tok = int(sample_from_logits(logits[i], temperature, gens[i])[0]) if not out.done else 0
        out.extend([tok])
        x0.append(tok)
    timing.total_s += time.perf_counter() - t0
    return session, outs, x0, gens, timing


def _drop_finished(session: TargetSession, outs: list, x0: list[int]) -> list[int]:
    """Remove finished requests from the session; returns x0 of the remaining rows."""
    alive = [r for r, req in enumerate(session.requests) if not outs[req].done]
    if len(alive) != session.batch_size and alive:
        session.retain(alive)
    return [x0[r] for r in alive]


DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


@torch.no_grad()
def speculative_generate_batch(
    target: FrozenTarget,
    draft: torch.nn.Module,
    prompts: Sequence,
    *,
    max_new_tokens: int,
    num_drafts: int,
    temperature: float = 0.0,
    eos_token_id: int | Sequence[int] | None = None,
    generators: Sequence[torch.Generator | None] | torch.Generator | None = None,
    draft_sample_method: str = "probabilistic",
    draft_cache: bool = True,
    rejection_sample_method: str = "standard",
) -> Decoded:
    """Speculative decoding of a batch of prompts ([P_i] each). At T=0 every request's tokens equal
    `target_generate`'s; at T>0 they follow the same distribution. num_drafts is vLLM's num_speculative_tokens;
    draft_sample_method as vLLM's (module docstring). The draft proposes through its eval interface
    (`draft.propose_batch(feats, tokens, num_drafts=, temperature=, generators=, caches=)`, `draft.new_cache()`:
    dspark.models.block_draft.BlockDraft, dspark.models.proposal.RequestProposer). draft_cache: each request keeps
    its draft-side cache across rounds (block drafts: the context KV of the verified positions, MTP: the chain's
    step-0 rows), as vLLM's drafters do; False recomputes the draft's whole context every round (same proposals
    up to float rounding: tests/models/test_draft_cache.py). rejection_sample_method: "standard" | "block" (module
    docstring)."""
    g = int(num_drafts)
    if g < 1:
        raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
    if draft_sample_method not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, got {draft_sample_method!r}")
    if rejection_sample_method not in REJECTION_SAMPLE_METHODS:
        raise ValueError(f"rejection_sample_method must be one of {REJECTION_SAMPLE_METHODS}, "
                         f"got {rejection_sample_method!r}")
    draft_temperature = temperature if draft_sample_method == "probabilistic" else 0.0
    session, outs, x0, gens, timing = _start(target, prompts, max_new_tokens, temperature, eos_token_id, generators)
    steps: list[list[StepStats]] = [[] for _ in outs]
    # per request, across rounds (block drafts: context KV of verified positions; MTP: the chain's step-0 rows);
    # finished requests' caches are no longer passed (session.requests), a rejected draft never enters a cache
    caches = [draft.new_cache() if draft_cache else None for _ in outs]
    forwards = 1
    x0 = _drop_finished(session, outs, x0)
    while x0:
        t_round = time.perf_counter()
        rows = range(session.batch_size)
        feats = [session.features(r) for r in rows]
        seqs = [torch.cat([session.tokens(r), session.tokens(r).new_tensor([x0[r]])]) for r in rows]
        props = _timed(timing, "draft_s", draft.propose_batch, feats, seqs, num_drafts=g,
                       temperature=draft_temperature, generators=[gens[req] for req in session.requests],
                       caches=[caches[req] for req in session.requests])  # seqs: [a_r + 1] tokens each
        new_ids = torch.stack([torch.cat([torch.tensor([x], device=p.tokens.device), p.tokens])
                               for x, p in zip(x0, props)])  # [B, g + 1]
        logits = _timed(timing, "target_s", session.forward, new_ids)  # [B, g + 1, V]
        forwards += 1
        keep = []
        for r, (req, prop) in enumerate(zip(session.requests, props)):
            n, nxt = _verify(prop, logits[r], temperature, gens[req], rejection_sample_method)
            steps[req].append(StepStats(
                anchor_pos=session.lengths[r], draft_tokens=prop.tokens.tolist(), num_accepted=n, next_token=nxt,
                conf=None if prop.conf is None else prop.conf.tolist(),
                conf_logits=None if prop.conf_logits is None else prop.conf_logits.tolist(),
                est_feature=estimator_features(prop.logits, temperature).tolist()))
            outs[req].extend(prop.tokens[:n].tolist() + [nxt])
            keep.append(1 + n)
            x0[r] = nxt
        session.commit(keep)
        x0 = _drop_finished(session, outs, x0)
        for req in set(range(len(outs))) - set(session.requests):
            caches[req] = None  # finished: its draft-side cache goes with its target rows
        timing.rounds += 1
        timing.total_s += time.perf_counter() - t_round
    return Decoded([torch.tensor(o.tokens, dtype=torch.long) for o in outs], steps, timing, forwards)


@torch.no_grad()
def speculative_generate(target: FrozenTarget, draft: torch.nn.Module, prompt_ids, *, generator=None,
                         **kwargs) -> tuple[torch.Tensor, list[StepStats]]:
    """One request: prompt_ids [P] -> (generated tokens [N] long, one StepStats per verify step)."""
    out = speculative_generate_batch(target, draft, [prompt_ids], generators=[generator], **kwargs)
    return out.tokens[0], out.steps[0]


@torch.no_grad()
def plain_generate(
    target: FrozenTarget,
    prompts: Sequence,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | Sequence[int] | None = None,
    generators: Sequence[torch.Generator | None] | torch.Generator | None = None,
) -> Decoded:
    """Batched KV-cached plain decoding (one target forward of one token per request per round)."""
    session, outs, x0, gens, timing = _start(target, prompts, max_new_tokens, temperature, eos_token_id, generators)
    forwards = 1
    x0 = _drop_finished(session, outs, x0)
    while x0:
        t_round = time.perf_counter()
        ids = torch.tensor(x0, dtype=torch.long, device=target.device).unsqueeze(1)  # [B, 1]
        logits = _timed(timing, "target_s", session.forward, ids)[:, 0]  # [B, V]
        forwards += 1
        session.commit([1] * session.batch_size)
        for r, req in enumerate(session.requests):
            tok = int(sample_from_logits(logits[r], temperature, gens[req])[0])
            outs[req].extend([tok])
            x0[r] = tok
        x0 = _drop_finished(session, outs, x0)
        timing.rounds += 1
        timing.total_s += time.perf_counter() - t_round
    return Decoded([torch.tensor(o.tokens, dtype=torch.long) for o in outs], [[] for _ in outs], timing, forwards)
