"""The MTP chain as vLLM 0.33.0 serves it, shared by every MTP draft for inference AND training.

vLLM's MTP speculator (`vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py` of vllm==0.33.0;
MTPSpeculator, mtp/speculator.py:12-36, is that class) drafts in two phases per verify round:
  * step 0, "prefill" (propose :165-320 -> _prefill :440-490; inputs _prepare_prefill_inputs_kernel :686-766):
    one draft row per position p the target just verified, input token t_{p+1} (the target's ids shifted left
    by one, the last kept row getting the new bonus token x0) and the TARGET hidden h_p, at position p. Its KV
    goes into the draft's own cache and stays there: row p is built once, from (t_{p+1}, h_p). The row of the
    last kept position a-1 gives y_0.
  * steps k >= 1 (_multi_step_decode :492-542 / _generate_draft :634-684; prepare_decode_inputs :808-889,
    update_draft_inputs :891-994): ONE new row per request, input (y_{k-1}, out_{k-1}) at position a-1+k (seq_len
    grows by one per step), attending to the step-0 rows 0..a-1 plus the chain's own earlier rows. Context rows
    are never recomputed at depth k.
Rows of rejected drafts are overwritten by the next round's step 0 (same positions), so the draft cache only
ever holds step-0 rows for positions < a when a round starts. With num_nextn_predict_layers >= 2 and
num_speculative_tokens >= 2 vLLM runs a different speculator (multi_module_mtp/, chosen by
config/speculative.py:2188-2194): not modelled, refused here.

A draft provides
    draft.step_rows(input_ids [B,T], hidden [B,T,...], position_ids [B,T], layer_idx, past, mask [B,T,P+T])
        -> (out [B,T,...], kv)   new rows attending to `past` rows (kv returned by earlier calls, or None) and to
                                 themselves as `mask` allows (keys: the P past rows, then the T new rows)
    draft.attention_window -> int | None   (keys with position_q - position_k >= window are not visible)
    draft.context_hidden(feats), draft.logits(out, layer_idx), draft.config.num_layers
`ChainDraft` gives such a draft its eval interface (`propose`, `propose_batch`, `new_cache`): the chain below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dspark.models.proposal import Proposal, RequestProposer, sample_from_logits

# the config member VLLM_TOKENS_NOTE (dspark.models.contract.OPTIONAL) of the families vLLM serves as method "mtp"
MTP_TOKENS_NOTE = ("vLLM's default num_speculative_tokens for MTP is num_nextn_predict_layers "
                   "(config/speculative.py:1600-1606); pass it explicitly to match")


def check_chain(draft: nn.Module, num_steps: int, where: str) -> None:
    """vLLM serves >= 2 MTP layers with >= 2 drafts through its multi-module speculator, not this recursion."""
    if int(draft.config.num_layers) > 1 and int(num_steps) > 1:
        raise ValueError(f"{where}: num_layers={draft.config.num_layers} with {num_steps} chained steps: vLLM 0.33.0 "
                         "runs >= 2 MTP layers with its multi-module MTP speculator (config/speculative.py:2188-2194), "
                         "a different recursion that dspark does not model; use draft.num_layers=1 (vLLM's "
                         "target_dependent_ar chain) or a single step")


def concat_kv(a: Any, b: Any) -> Any:
    """Row-wise (dim 1) concatenation of two per-row kv values (a tensor or a tuple of tensors / None)."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, torch.Tensor):
        return torch.cat([a, b], dim=1)
    return tuple(None if x is None else torch.cat([x, y], dim=1) for x, y in zip(a, b))


def take_kv(kv: Any, n: int) -> Any:
    """The first n rows of a per-row kv value (None when n == 0)."""
    return slice_kv(kv, 0, n)


def slice_kv(kv: Any, start: int, stop: int) -> Any:
    """Rows start..stop-1 of a per-row kv value (None when empty)."""
    if kv is None or stop <= start:
        return None
    if isinstance(kv, torch.Tensor):
        return kv[:, start:stop]
    return tuple(None if x is None else x[:, start:stop] for x in kv)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """q_pos [B, T], k_pos [B, K] -> bool [B, T, K]: key at or before the query and inside the window."""
    gap = q_pos[:, :, None] - k_pos[:, None, :]  # [B, T, K]
    ok = gap >= 0
    return ok if window is None else ok & (gap < window)


@dataclass
class ChainCache:
    """One request's step-0 rows across verify rounds (the draft-side KV cache): row p built from (t_{p+1}, h_p) at
    position p, for p in start..n-1; `ids` [n] = t_1..t_n guards against reuse on another sequence. A windowed
    draft (attention_window W) drops the rows no later query can see (p <= a - W after the round at anchor a), as
    vLLM's sliding-window draft cache does, so a round's cost stops growing with the context."""

    kv: Any = None
    ids: torch.Tensor | None = None
    start: int = 0

    @property
    def n(self) -> int:
        return 0 if self.ids is None else int(self.ids.numel())


@torch.no_grad()
def chain_propose(draft: nn.Module, feats, tokens: torch.Tensor, *, num_drafts: int, temperature: float = 0.0,
                  generator: torch.Generator | None = None, cache: ChainCache | None = None):
    """`num_drafts` drafts after x0 = tokens[a], exactly as vLLM's MTP speculator drafts them (module docstring).

    tokens [a+1] long (prompt + generated, x0 last); feats: TargetFeatures of batch 1 covering positions 0..a-1.
    `cache` (kept by the caller across rounds of one request) holds step-0 rows of an earlier round: only rows
    n..a-1 are computed (the rows after the cached prefix; at least the last one). cache=None recomputes every
    step-0 row: the uncached reference, same arithmetic.
    """
    a = int(tokens.numel()) - 1
    if a < 1:
        raise ValueError("chain_propose: tokens must hold at least one context token before x0")
    if num_drafts < 1:
        raise ValueError(f"chain_propose: num_drafts must be >= 1, got {num_drafts}")
    check_chain(draft, num_drafts, "chain_propose")
    ctx_hidden = draft.context_hidden(feats)[:, :a]  # [1, a, ...]
    if ctx_hidden.shape[0] != 1 or ctx_hidden.shape[1] != a:
        raise ValueError(f"chain_propose: features must be batch 1 with >= {a} positions, got {tuple(ctx_hidden.shape)}")
    dev = ctx_hidden.device
    ids = tokens.to(dev).long()
    cache = ChainCache() if cache is None else cache
    keep = min(cache.n, a - 1)  # cached rows reused; row a-1 (holding x0) is new every round
    if keep and not torch.equal(cache.ids[:keep].to(dev), ids[1 : keep + 1]):
        raise ValueError("chain_propose: the cache holds rows of another sequence (its tokens differ)")
    window = draft.attention_window
    lo = 0 if window is None else max(keep - window + 1, 0)  # the oldest row a query of this round can see
    if lo < keep and cache.start > lo:  # rows it needs were dropped (the request went back past the window)
        keep, lo, cache.kv, cache.start = 0, 0, None, 0

    # step 0: rows keep..a-1, input t_{p+1} and h_p at position p, attending to rows lo..p (within the window)
    past = slice_kv(cache.kv, lo - cache.start, keep - cache.start)  # cached rows lo..keep-1
    q_pos = torch.arange(keep, a, device=dev).unsqueeze(0)  # [1, a-keep]
    mask = visible(q_pos, torch.arange(lo, a, device=dev).unsqueeze(0), window)  # [1, a-keep, a-lo]
    out, kv = draft.step_rows(ids[keep + 1 : a + 1].unsqueeze(0), ctx_hidden[:, keep:a], q_pos, 0, past, mask)
    rows = concat_kv(past, kv)  # step-0 rows lo..a-1
    nxt = lo if window is None else max(a - window + 1, lo)  # no later round sees rows before nxt
    cache.kv, cache.start, cache.ids = slice_kv(rows, nxt - lo, a - lo), nxt, ids[1 : a + 1].clone()

    h = out[:, -1:]  # [1, 1, ...] out_0 of row a-1
    chain_kv = rows  # step-0 rows lo..a-1, then one row per chain step
    ys, q_rows, logit_rows = [], [], []
    for k in range(int(num_drafts)):
        if k:
            q = torch.tensor([[a - 1 + k]], device=dev)  # [1, 1]
            mask = visible(q, torch.arange(lo, a + k, device=dev).unsqueeze(0), window)  # [1, 1, a+k-lo]
            h, kv = draft.step_rows(ys[-1].view(1, 1).to(dev), h, q, k, chain_kv, mask)
            chain_kv = concat_kv(chain_kv, kv)
        logits = draft.logits(h, k)[0, 0].float()  # [V]
        y, q_probs = sample_from_logits(logits, temperature, generator)
        ys.append(y)
        q_rows.append(q_probs)
        logit_rows.append(logits)
    return Proposal(tokens=torch.stack(ys), q_probs=torch.stack(q_rows), conf=None, logits=torch.stack(logit_rows))


def teacher_forced_chain(draft: nn.Module, context_hidden: torch.Tensor, ids: torch.Tensor,
                         num_steps: int) -> list[torch.Tensor]:
    """The served chain over whole sequences with teacher forcing: every position t starts a chain.

    context_hidden [B, S, ...], ids [B, S] -> per step k an output [B, L_k, ...], L_k = S - k - 1, whose row t is
    chain t's depth-k row: input ids[t+k+1] (the true token where serving feeds y_{k-1}), hidden = row t of step
    k-1's output (context_hidden[t] at k = 0), position t+k. It attends, as in serving, to the step-0 rows 0..t
    (the context rows of a round whose anchor row is t) and to chain t's own rows at depths 1..k, within the
    draft's window. Steps with no row (S < k + 2) are left out.
    """
    check_chain(draft, num_steps, "teacher_forced_chain")
    b, s = ids.shape
    if s < 2:
        return []
    dev, window = ids.device, draft.attention_window
    l0 = s - 1
    pos0 = torch.arange(l0, device=dev).expand(b, l0)  # [B, L0]
    out, kv = draft.step_rows(ids[:, 1:], context_hidden[:, :l0], pos0, 0, None, visible(pos0, pos0, window))
    outs, past, lengths = [out], kv, [l0]
    for k in range(1, int(num_steps)):
        lk = s - k - 1
        if lk < 1:
            break
        t = torch.arange(lk, device=dev)
        q_pos = (t + k).expand(b, lk)  # [B, Lk]
        blocks = [visible(q_pos, pos0, window) & (t[:, None] >= torch.arange(l0, device=dev))]  # step-0 rows 0..t
        for m, lm in enumerate(lengths[1:], start=1):  # chain t's depth-m row: row t of step m (position t+m)
            own = torch.eye(lk, lm, dtype=torch.bool, device=dev).expand(b, lk, lm)
            blocks.append(own & visible(q_pos, (torch.arange(lm, device=dev) + m).expand(b, lm), window))
        blocks.append(torch.eye(lk, dtype=torch.bool, device=dev).expand(b, lk, lk))  # itself
        out, kv = draft.step_rows(ids[:, k + 1 :], outs[-1][:, :lk], q_pos, k, past, torch.cat(blocks, dim=-1))
        outs.append(out)
        past = concat_kv(past, kv)
        lengths.append(lk)
    return outs


class ChainDraft(RequestProposer):
    """Mixin of the MTP families: drafting is the served chain (chain_propose), request by request, each request
    with its own draft-side cache of step-0 rows (a ChainCache kept by the decoding loop across rounds)."""

    def new_cache(self) -> ChainCache:
        return ChainCache()

    @torch.no_grad()
    def propose(self, feats, tokens: torch.Tensor, *, num_drafts: int, temperature: float = 0.0,
                generator: torch.Generator | None = None, cache: ChainCache | None = None) -> Proposal:
        """`num_drafts` chain drafts after x0 = tokens[a] (chain_propose): step-0 rows (t_{p+1}, h_p) once, then one
        row (y_{k-1}, out_{k-1}) per step; `cache` = this request's ChainCache (None: recompute every row)."""
        return chain_propose(self, feats, tokens, num_drafts=num_drafts, temperature=temperature, generator=generator,
                             cache=cache)


__all__ = ["MTP_TOKENS_NOTE", "ChainCache", "ChainDraft", "chain_propose", "teacher_forced_chain", "check_chain",
           "concat_kv", "take_kv", "slice_kv", "visible"]
