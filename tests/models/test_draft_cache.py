"""Draft-side caches of eval's decoding loop (issue 13): a request's draft keeps its context across verify rounds
(block drafts: the per-layer context KV of the verified positions, `BlockContextCache`; MTP drafts: the chain's
step-0 rows, `ChainCache`) and extends it with only the positions verified since its last round, as vLLM's
drafters do. Every round's proposals equal the uncached reference (caches=None: the whole context recomputed)
across rejections (1 + n < 1 + g positions kept), requests finishing mid-batch, windows shorter than the context,
rollback (a cache ahead of its request or holding other tokens), and greedy speculative decoding with the caches
equals plain greedy decoding of the target and the uncached run step by step. A stale cache (rows of features the
request no longer has) is caught by the same comparison."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_v4_config
from transformers import DeepseekV4ForCausalLM, LlamaConfig, LlamaForCausalLM

from dspark.evaluation.speculative import speculative_generate_batch, target_generate
from dspark.models.block_draft import BlockContextCache, context_start
from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft
from dspark.models.dspark_v4 import DSparkV4Config, DSparkV4Draft
from dspark.models.dsv4_mtp import DSV4MTPConfig, DSV4MTPDraft
from dspark.models.mtp_common import ChainCache
from dspark.targets.hf_target import FrozenTarget, TargetFeatures
from test_mtp_chain import DRAFTS as MTP_DRAFTS
from test_mtp_chain import _feats as mtp_feats

# float32 throughout. The cached path computes the same rows through differently shaped ops: combine / context_kv
# over the few new positions of every request packed in one row block instead of [B, a] padded contexts, and the
# attention over a trimmed, differently padded key set (masked keys contribute exp(-inf) = 0 exactly, but the
# reductions run over other lengths and blockings). The results agree to float32 rounding, not bit for bit:
# ~K * 2^-24 relative for reductions of length K <= a few hundred here, i.e. <= ~1e-5 on the O(1..10) logits of
# these tiny drafts; any real difference (a missing, stale or misplaced row) moves them by >= 1e-2 (the stale-cache
# test below shows the comparison failing).
TOL = dict(atol=1e-5, rtol=1e-5)
V_LLAMA, MASK_LLAMA = 64, 63


def _llama_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=V_LLAMA, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)


def _share(draft, vocab: int, hidden: int, seed: int = 100) -> None:
    g = torch.Generator().manual_seed(seed)
    draft.share_target_weights(torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g))


def v4_block(window: int = 5):
    """DSpark V4 draft (anchor layout, Markov + confidence heads) with a window shorter than the contexts."""
    torch.manual_seed(0)
    hf = tiny_v4_config(initializer_range=0.2)
    draft = DSparkV4Draft(DSparkV4Config.from_target_config(
        hf, num_layers=2, block_size=3, mask_token_id=49, target_layer_ids=[0, 2], markov_rank=4,
        sliding_window=window)).eval()
    _share(draft, 50, 16)
    return draft


def dflash():
    """DFlash: dense draft, mask layout, no Markov head, whole context (no window)."""
    torch.manual_seed(1)
    draft = DSparkDenseDraft(DSparkDenseConfig.from_target_config(
        _llama_config(), num_layers=2, block_size=3, mask_token_id=MASK_LLAMA, target_layer_ids=[0, 1],
        markov_rank=0, layout="mask")).eval()
    _share(draft, V_LLAMA, 32)
    return draft


def dense_dspark_windowed():
    """Dense DSpark (anchor layout, Markov + confidence) with a window: [B, nkv, S, hd] rows trimmed."""
    torch.manual_seed(2)
    draft = DSparkDenseDraft(DSparkDenseConfig.from_target_config(
        _llama_config(), num_layers=1, block_size=3, mask_token_id=MASK_LLAMA, target_layer_ids=[0, 1],
        markov_rank=8, sliding_window=4)).eval()
    _share(draft, V_LLAMA, 32)
    return draft


def dflash_query_window(window: int = 5):
    """DFlash with vLLM's per-query window (window_rule "query", what a target whose layers all slide gives it): the
    mask row of position a + 1 sees the context from a + 2 - W (W = 5: position 5 at a = 8, as the stale-cache test
    needs); tests/ops/test_query_window.py runs the rounds with W = 2, shorter than the block."""
    torch.manual_seed(4)
    draft = DSparkDenseDraft(DSparkDenseConfig.from_target_config(
        _llama_config(), num_layers=2, block_size=3, mask_token_id=MASK_LLAMA, target_layer_ids=[0, 1],
        markov_rank=0, layout="mask", sliding_window=window, window_rule="query")).eval()
    _share(draft, V_LLAMA, 32)
    return draft


BLOCK_DRAFTS = {"dspark_v4": v4_block, "dflash": dflash, "dense_windowed": dense_dspark_windowed,
                "dflash_query_window": dflash_query_window}


def _aux_width(draft) -> int:
    return len(draft.config.target_layer_ids) * draft.config.hidden_size


def _block_feats(draft, length: int, seed: int) -> TargetFeatures:
    g = torch.Generator().manual_seed(seed)
    return TargetFeatures(aux=torch.randn(1, length, _aux_width(draft), generator=g),
                          final=torch.zeros(1, length, draft.config.hidden_size))


def assert_same(got, ref) -> None:
    """Proposals of the cached and the uncached path: same tokens, logits / q / confidences to float32 rounding."""
    assert len(got) == len(ref)
    for p, r in zip(got, ref):
        assert torch.equal(p.tokens, r.tokens)
        torch.testing.assert_close(p.logits, r.logits, **TOL)
        torch.testing.assert_close(p.q_probs, r.q_probs, **TOL)
        assert (p.conf_logits is None) == (r.conf_logits is None)
        if r.conf_logits is not None:
            torch.testing.assert_close(p.conf_logits, r.conf_logits, **TOL)


def _propose_both(draft, feats, seqs, caches, g: int, temperature: float, seed: int):
    kw = dict(num_drafts=g, temperature=temperature)
    gens = lambda: [torch.Generator().manual_seed(seed + i) for i in range(len(seqs))]  # noqa: E731
    cached = draft.propose_batch(feats, seqs, generators=gens(), caches=caches, **kw)
    ref = draft.propose_batch(feats, seqs, generators=gens(), caches=None, **kw)
    return cached, ref


class _RowCounter:
    """Counts the context positions the draft projects (rows into combine / the chain's step-0 call)."""

    def __init__(self, draft, attr: str, seq_arg: int = 0):
        self.draft, self.attr, self.real, self.rows = draft, attr, getattr(draft, attr), []
        self.seq_arg = seq_arg

    def __enter__(self):
        def counting(*args, **kwargs):
            self.rows.append(int(args[self.seq_arg].shape[1]))
            return self.real(*args, **kwargs)

        setattr(self.draft, self.attr, counting)
        return self

    def __exit__(self, *exc):
        delattr(self.draft, self.attr)  # back to the class method


# accepted drafts per round of each request (g = 3): rejections at every depth, all accepted, and requests that
# finish after 2, 4 and 5 rounds (the batch shrinks twice; finished requests' caches are no longer passed)
SCRIPTS = [[0, 3, 1, 2, 0], [2, 0], [1, 1, 3, 0]]
PROMPT_LENS = [3, 9, 6]


def _run_rounds(draft, feats_of):
    """Decoding-loop rounds over SCRIPTS; every round compares the cached proposals with the uncached ones
    (T = 0 and T = 1) and checks which positions were projected."""
    g = 3
    window = getattr(draft.config, "sliding_window", None)
    total = max(p + sum(1 + n for n in s) for p, s in zip(PROMPT_LENS, SCRIPTS)) + 1
    feats = [feats_of(draft, total, seed=10 + i) for i in range(len(SCRIPTS))]
    gen = torch.Generator().manual_seed(3)
    toks = [torch.randint(0, draft.config.vocab_size - 1, (total + 1,), generator=gen) for _ in SCRIPTS]
    caches = [draft.new_cache() for _ in SCRIPTS]
    a = list(PROMPT_LENS)  # x0 of request i sits at a[i]
    last = [None] * len(SCRIPTS)  # positions kept in the previous round
    for r in range(max(len(s) for s in SCRIPTS)):
        live = [i for i, s in enumerate(SCRIPTS) if r < len(s)]
        fs = [feats[i].prefix(a[i]) for i in live]
        seqs = [toks[i][: a[i] + 1] for i in live]
        counter_attr = "combine" if hasattr(draft, "combine") else "step_rows"
        with _RowCounter(draft, counter_attr) as counted:
            cached = draft.propose_batch(fs, seqs, num_drafts=g, temperature=0.0, generators=[None] * len(live),
                                         caches=[caches[i] for i in live])
        ref = draft.propose_batch(fs, seqs, num_drafts=g, temperature=0.0, generators=[None] * len(live))
        assert_same(cached, ref)
        assert_same(*_propose_both(draft, fs, seqs, [caches[i] for i in live], g, 1.0, seed=50 + r))
        if isinstance(caches[0], BlockContextCache):  # one combine over the new positions of every request
            lo = [context_start(a[i], window, getattr(draft.config, "window_rule", "block")) for i in live]
            expect = sum(a[i] - lo_i if last[i] is None else min(last[i], a[i] - lo_i) for i, lo_i in zip(live, lo))
            assert counted.rows == [expect]
            assert [caches[i].start for i in live] == lo and [caches[i].rows for i in live] == [
                a[i] - lo_i for i, lo_i in zip(live, lo)]
        else:  # MTP: per request, its new step-0 rows (the row of x0's predecessor is rebuilt: vLLM's bonus row)
            step0 = counted.rows[::g]
            assert step0 == [a[i] if last[i] is None else last[i] for i in live]
            w = draft.attention_window  # windowed: rows no later query sees are dropped
            assert [caches[i].start for i in live] == [0 if w is None else max(a[i] - w + 1, 0) for i in live]
            assert [caches[i].n for i in live] == [a[i] for i in live]
        for i in live:
            n = SCRIPTS[i][r]
            last[i] = 1 + n
            a[i] += 1 + n


@pytest.mark.parametrize("kind", list(BLOCK_DRAFTS))
def test_block_cache_rounds_equal_the_uncached_reference(kind):
    _run_rounds(BLOCK_DRAFTS[kind](), _block_feats)


@pytest.mark.parametrize("kind", list(MTP_DRAFTS))
def test_mtp_cache_rounds_equal_the_uncached_reference(kind):
    _run_rounds(MTP_DRAFTS[kind](3), lambda d, n, seed: mtp_feats(d, n, seed))


ALL_DRAFTS = {**BLOCK_DRAFTS, **{f"mtp_{k}": (lambda f=f: f(3)) for k, f in MTP_DRAFTS.items()}}


@pytest.mark.parametrize("kind", list(ALL_DRAFTS))
def test_a_stale_cache_is_caught_by_the_comparison(kind):
    """The comparison can fail: a cache whose row of position 5 was built from features the request no longer has
    (same tokens, so the cache cannot tell) gives proposals that differ from the reference beyond the tolerance;
    a fresh cache agrees again."""
    draft = ALL_DRAFTS[kind]()
    feats = (mtp_feats if kind.startswith("mtp_") else _block_feats)(draft, 12, seed=1)
    toks = torch.randint(0, draft.config.vocab_size - 1, (13,), generator=torch.Generator().manual_seed(2))
    kw = dict(num_drafts=3, temperature=0.0, generators=[None])
    cache = draft.new_cache()
    draft.propose_batch([feats.prefix(6)], [toks[:7]], caches=[cache], **kw)  # rows of positions 0..5 cached
    stale = TargetFeatures(**{k: None if v is None else v.clone() for k, v in vars(feats).items()})
    for v in vars(stale).values():
        if v is not None and v.numel():
            v[:, 5] += 1.0  # position 5: cached, and inside every window at a = 8 (MTP window 3 included)
    cached = draft.propose_batch([stale.prefix(8)], [toks[:9]], caches=[cache], **kw)  # reuses the stale row
    ref = draft.propose_batch([stale.prefix(8)], [toks[:9]], **kw)
    assert float((cached[0].logits - ref[0].logits).abs().max()) > 1e-3
    with pytest.raises(AssertionError):
        assert_same(cached, ref)
    assert_same(draft.propose_batch([stale.prefix(8)], [toks[:9]], caches=[draft.new_cache()], **kw), ref)


# positions projected by each call of the rollback test: a = 20, then 12 (cache ahead), 16, 14 (other tokens from 8)
ROLLBACK_ROWS = {
    "dspark_v4": [[5], [5], [4], [5]],  # W = 5: at 12 the cache [15, 20) lacks 7..14 -> recompute [7, 12); ...
    "dflash": [[20], [], [4], [6]],  # no window: 0..11 reused at 12; 0..7 reused at 14 (tokens differ at 8)
    "dense_windowed": [[4], [4], [4], [4]],  # W = 4: always [a-4, a), partly recomputed after rollbacks
    "dflash_query_window": [[4], [4], [4], [4]],  # W = 5, rule "query": always [a-4, a)
}


@pytest.mark.parametrize("kind", list(BLOCK_DRAFTS))
def test_block_cache_rolls_back_to_the_common_prefix(kind):
    """A cache ahead of its request (its tokens extend past the anchor) or holding other tokens from some position on
    is cut back to the longest common token prefix; rows it lacks (window moved back) are recomputed."""
    draft = BLOCK_DRAFTS[kind]()
    window = draft.config.sliding_window
    feats = _block_feats(draft, 30, seed=5)
    toks = torch.randint(0, draft.config.vocab_size - 1, (31,), generator=torch.Generator().manual_seed(6))
    other = toks.clone()
    other[8] = (other[8] + 1) % (draft.config.vocab_size - 1)
    feats_other = TargetFeatures(**{**vars(feats), "aux": feats.aux.clone()})
    feats_other.aux[0, 8:] += 0.5  # other tokens from position 8 on: other features there
    cache = draft.new_cache()
    calls = ((20, toks, feats), (12, toks, feats), (16, toks, feats), (14, other, feats_other))
    for (a, t, f), rows in zip(calls, ROLLBACK_ROWS[kind]):
        kw = dict(num_drafts=3, temperature=0.0, generators=[None])
        with _RowCounter(draft, "combine") as counted:
            cached = draft.propose_batch([f.prefix(a)], [t[: a + 1]], caches=[cache], **kw)
        assert_same(cached, draft.propose_batch([f.prefix(a)], [t[: a + 1]], **kw))
        lo = context_start(a, window, draft.config.window_rule)
        assert (cache.start, cache.end) == (lo, a) and torch.equal(cache.ids, t[:a])
        assert counted.rows == rows, (a, counted.rows)


def test_mtp_cache_going_back_past_its_window_is_rebuilt():
    """A ChainCache whose request goes back (same tokens, anchor earlier) past the rows its window dropped rebuilds
    them; proposals still equal the uncached ones."""
    draft = MTP_DRAFTS["dsv4"](5)  # window 3
    feats = mtp_feats(draft, 20, seed=1)
    toks = torch.randint(0, draft.config.vocab_size - 1, (21,), generator=torch.Generator().manual_seed(2))
    cache = draft.new_cache()
    for a in (15, 9, 12):
        cached = draft.propose(feats.prefix(a), toks[: a + 1], num_drafts=3, cache=cache)
        assert_same([cached], [draft.propose(feats.prefix(a), toks[: a + 1], num_drafts=3)])
        assert cache.start == a - 2 and cache.n == a


# ---- greedy speculative decoding with the caches == plain greedy decoding == the uncached run -----------------------
def _llama_target() -> FrozenTarget:
    torch.manual_seed(0)
    return FrozenTarget(LlamaForCausalLM(_llama_config()).eval(), [0, 1])


def _v4_target(pre_head: bool = False) -> FrozenTarget:
    torch.manual_seed(0)
    target = FrozenTarget(DeepseekV4ForCausalLM(tiny_v4_config(initializer_range=0.2)).eval(), [0, 2])
    target.capture_pre_head = pre_head
    return target


def _dsv4_mtp(target: FrozenTarget) -> DSV4MTPDraft:
    torch.manual_seed(3)
    draft = DSV4MTPDraft(DSV4MTPConfig.from_target_config(target.model.config, num_layers=1)).eval()
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    return draft


def _with_target(target: FrozenTarget, draft):
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    return target, draft


SPEC_CASES = {
    "dspark_v4": lambda: _with_target(_v4_target(), v4_block(window=3)),
    "dflash": lambda: _with_target(_llama_target(), dflash()),
    "dsv4_mtp": lambda: (lambda t: (t, _dsv4_mtp(t)))(_v4_target(pre_head=True)),
}


@pytest.mark.parametrize("kind", list(SPEC_CASES))
def test_greedy_speculative_decoding_with_caches_equals_plain_decoding(kind):
    """Three prompts of different lengths (left padding) batched; the eos token stops one request early, so the
    batch shrinks mid-run. Outputs == plain greedy decoding; every verify step (draft tokens, accepted count)
    == the uncached run's."""
    target, draft = SPEC_CASES[kind]()
    vocab = target.vocab_size
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab - 2, (n,), generator=gen) for n in (2, 7, 4)]
    refs = [target_generate(target, p, 14) for p in prompts]
    eos = int(refs[0][4])  # request 0 stops at its 5th token (or earlier); the others may run on
    refs = [target_generate(target, p, 14, eos_token_id=eos) for p in prompts]
    kw = dict(max_new_tokens=14, num_drafts=3, eos_token_id=eos)
    cached = speculative_generate_batch(target, draft, prompts, **kw)
    plain = speculative_generate_batch(target, draft, prompts, draft_cache=False, **kw)
    assert [t.tolist() for t in cached.tokens] == [r.tolist() for r in refs]
    assert len({len(t) for t in cached.tokens}) > 1  # requests finished at different rounds
    for c_steps, p_steps in zip(cached.steps, plain.steps):
        assert [(s.anchor_pos, s.draft_tokens, s.num_accepted) for s in c_steps] == \
               [(s.anchor_pos, s.draft_tokens, s.num_accepted) for s in p_steps]
    assert any(s.num_accepted < 3 for st in cached.steps for s in st)  # rejections happened


def test_cache_refuses_mixed_entries():
    draft = dflash()
    f = _block_feats(draft, 6, seed=0)
    t = torch.arange(6)
    with pytest.raises(ValueError, match="one BlockContextCache per request"):
        draft.propose_batch([f, f], [t, t], num_drafts=2, temperature=0.0, generators=[None, None],
                            caches=[draft.new_cache(), ChainCache()])
