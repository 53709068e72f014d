"""The MTP chain as vLLM 0.33.0 serves it (issue 17, mismatch 4): step-0 rows built once from (t_{p+1}, h_p), one
appended row (y_{k-1}, out_{k-1}) per step k >= 1 at position a-1+k. Eval (chain_propose, with and without the
draft-side KV cache) and training (teacher_forced_chain) against an independent reference that runs the draft's
plain causal `step` over the explicit sequence of rows a vLLM draft cache holds at depth k."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_v4_config
from dspark.models.dsv4_mtp import DSV4MTPConfig, DSV4MTPDraft
from dspark.models.hy_v4_mtp import HYV4MTPDraft
from dspark.models.mtp_common import ChainCache, chain_propose, teacher_forced_chain
from dspark.targets.hf_target import TargetFeatures
from test_export_mtp import V, _hy_cfg, _randomise

# fp32 throughout. The cached / batched paths compute the same rows in differently shaped matmuls and softmaxes
# (other reduction orders), so they agree to float32 rounding, not bitwise: 1e-5 absolute on O(1) logits is ~100x
# fp32 epsilon times the reduction lengths here, far below any real difference (those are >= 1e-2).
TOL = dict(atol=1e-5, rtol=1e-5)


def _hy(seed: int = 0) -> HYV4MTPDraft:
    # one layer, DSA indexer on with top-2 of the keys so the indexer's key set matters
    draft = HYV4MTPDraft(_hy_cfg(num_layers=1, use_indexer=True, index_topk=2)).eval()
    _randomise(draft, seed)
    g = torch.Generator().manual_seed(100 + seed)
    draft.share_target_weights(torch.randn(V, 16, generator=g), torch.randn(V, 16, generator=g))
    return draft


def _dsv4(seed: int = 0) -> DSV4MTPDraft:
    # a window of 3 positions: the chain rows' window edge falls inside the context
    draft = DSV4MTPDraft(DSV4MTPConfig.from_target_config(tiny_v4_config(sliding_window=3), num_layers=1)).eval()
    _randomise(draft, seed)
    g = torch.Generator().manual_seed(100 + seed)
    draft.share_target_weights(torch.randn(50, 16, generator=g), torch.randn(50, 16, generator=g))
    return draft


DRAFTS = {"hy": _hy, "dsv4": _dsv4}


def _feats(draft, length: int, seed: int) -> TargetFeatures:
    g = torch.Generator().manual_seed(seed)
    c = draft.config
    if isinstance(draft, DSV4MTPDraft):
        return TargetFeatures(aux=torch.zeros(1, length, 0), final=torch.zeros(1, length, c.hidden_size),
                              pre_head=torch.randn(1, length, c.hc_mult, c.hidden_size, generator=g))
    return TargetFeatures(aux=torch.zeros(1, length, 0), final=torch.randn(1, length, c.hidden_size, generator=g))


@torch.no_grad()
def _reference_chain(draft, hidden: torch.Tensor, ids: torch.Tensor, a: int, chain_ids: list[int]):
    """Depth-k output of the chain anchored at row a-1 from the plain causal `step` over the rows vLLM's draft
    cache holds at depth k: step-0 rows 0..a-1 (ids[p+1], hidden[p], position p) and chain rows 1..k
    (chain_ids[m-1], the depth m-1 output, position a-1+m). hidden [1, >= a, ...], ids [>= a+1]."""
    row_ids = [int(i) for i in ids[1 : a + 1]]
    row_hidden = [hidden[:, p] for p in range(a)]
    outs = []
    for k in range(len(chain_ids) + 1):
        seq_ids = torch.tensor([row_ids + chain_ids[:k]])  # [1, a+k]
        seq_hidden = torch.stack(row_hidden + outs, dim=1)  # [1, a+k, ...]
        out = draft.step(seq_ids, seq_hidden, torch.arange(a + k)[None], k)[:, -1]  # the newest row
        outs.append(out)
    return outs  # depth 0..K-1, each [1, ...]


def _chain_case(kind: str, num_layers: int, a: int, g: int, seed: int):
    """-> (draft, tokens [a+1], target features of a positions, chain_propose's proposal of g drafts)."""
    draft = DRAFTS[kind](num_layers)
    tokens = torch.randint(0, draft.config.vocab_size, (a + 1,), generator=torch.Generator().manual_seed(seed))
    feats = _feats(draft, a, seed=seed + 1)
    return draft, tokens, feats, chain_propose(draft, feats, tokens, num_drafts=g)


@pytest.mark.parametrize("kind", list(DRAFTS))
def test_eval_chain_is_the_served_recursion(kind):
    a, g = 9, 4
    draft, tokens, feats, prop = _chain_case(kind, 1, a, g, seed=2)
    ref = _reference_chain(draft, draft.context_hidden(feats), tokens, a, prop.tokens[:-1].tolist())
    for k in range(g):
        logits = draft.logits(ref[k].unsqueeze(1), k)[0, 0].float()
        torch.testing.assert_close(prop.logits[k], logits, **TOL)
        assert int(prop.tokens[k]) == int(logits.argmax())


@pytest.mark.parametrize("kind", list(DRAFTS))
def test_served_chain_differs_from_the_old_full_prefix_recursion_after_step_0(kind):
    """The old recursion recomputed every row at depth k from depth k-1 outputs: same y_0, different later rows."""
    a, g = 9, 3
    draft, tokens, feats, prop = _chain_case(kind, 4, a, g, seed=5)
    hidden, ids = draft.context_hidden(feats), tokens[1:].unsqueeze(0)
    with torch.no_grad():
        for k in range(g):  # the old chain: step k over all rows, ids shifted once more, positions + k
            hidden = draft.step(ids, hidden, torch.arange(a)[None] + k, k)
            old = draft.logits(hidden[:, -1:], k)[0, 0].float()
            ids = torch.cat([ids[:, 1:], prop.tokens[k].view(1, 1)], dim=1)
            if k == 0:
                torch.testing.assert_close(prop.logits[0], old, **TOL)
            else:
                assert (prop.logits[k] - old).abs().max() > 1e-2, k


@pytest.mark.parametrize("kind", list(DRAFTS))
def test_training_chain_is_the_served_recursion_for_every_anchor(kind):
    draft = DRAFTS[kind](7)
    b, s, K = 2, 8, 3
    ids = torch.randint(0, draft.config.vocab_size, (b, s), generator=torch.Generator().manual_seed(8))
    hidden = torch.cat([draft.context_hidden(_feats(draft, s, seed=9 + i)) for i in range(b)])  # [B, S, ...]
    with torch.no_grad():
        outs = teacher_forced_chain(draft, hidden, ids, K)
    assert [o.shape[1] for o in outs] == [s - 1, s - 2, s - 3]
    for bi in range(b):
        for t in range(s - K):  # chain t: context rows 0..t (a = t + 1), teacher-forced chain ids
            ref = _reference_chain(draft, hidden[bi : bi + 1], ids[bi], t + 1,
                                   [int(ids[bi, t + m + 1]) for m in range(1, K)])
            for k in range(K):
                torch.testing.assert_close(outs[k][bi, t], ref[k][0], **TOL)


@pytest.mark.parametrize("kind", list(DRAFTS))
def test_draft_kv_cache_equals_the_uncached_reference(kind):
    """Rounds of a request: the cached call computes only the new step-0 rows (1 + accepted drafts) and equals a
    fresh full recompute (cache=None) at every round; it never recomputes a kept row."""
    draft = DRAFTS[kind](11)
    total, g = 16, 3
    tokens = torch.randint(0, draft.config.vocab_size, (total,), generator=torch.Generator().manual_seed(12))
    feats = _feats(draft, total, seed=13)
    cache, calls = ChainCache(), []
    real = draft.step_rows

    def counting(ids, *args):
        calls.append(ids.shape[1])
        return real(ids, *args)

    a = 3
    for accepted in (0, 2, 3, 1, 0, 3):  # x0 at a, then 1 + accepted tokens kept per round
        draft.step_rows = counting
        calls.clear()
        cached = chain_propose(draft, feats.prefix(a), tokens[: a + 1], num_drafts=g, cache=cache)
        new_rows = calls[0]
        draft.step_rows = real
        fresh = chain_propose(draft, feats.prefix(a), tokens[: a + 1], num_drafts=g)
        assert torch.equal(cached.tokens, fresh.tokens)
        torch.testing.assert_close(cached.logits, fresh.logits, **TOL)
        assert cache.n == a and new_rows == (a if a == 3 else a - prev) and calls[1:] == [1] * (g - 1)
        prev, a = a, a + 1 + accepted
    with pytest.raises(ValueError, match="another sequence"):
        other = tokens.flip(0)[: a + 1]
        chain_propose(draft, feats.prefix(a), other, num_drafts=g, cache=cache)


def test_two_mtp_layers_are_refused_for_chains():
    draft = DSV4MTPDraft(DSV4MTPConfig.from_target_config(tiny_v4_config(), num_layers=2))
    draft.share_target_weights(torch.randn(50, 16), torch.randn(50, 16))
    with pytest.raises(ValueError, match="multi-module MTP speculator"):
        teacher_forced_chain(draft, torch.zeros(1, 5, 2, 16), torch.zeros(1, 5, dtype=torch.long), 2)
    assert len(teacher_forced_chain(draft, torch.randn(1, 5, 2, 16), torch.zeros(1, 5, dtype=torch.long), 1)) == 1
