"""Speculative decoding: greedy equality with plain decoding, lossless rejection sampling (chi-square),
vLLM-style acceptance counting, and propose() == the training forward (one inference path)."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_llama_target, tiny_v4_config
from transformers import DeepseekV4ForCausalLM, LlamaConfig, LlamaForCausalLM

import dspark.evaluation.speculative as spec
from dspark.evaluation.metrics import AcceptanceCounter
from dspark.models.block_draft import propose
from dspark.models.proposal import Proposal, RequestProposer
from dspark.evaluation.speculative import acceptance_counter, speculative_generate, target_generate
from dspark.evaluation.verify import verify_greedy, verify_rejection
from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft
from dspark.targets.hf_target import FrozenTarget
from dspark.training.block_module import BlockDraftModule

V, MASK = 64, 63


# ---- tiny models ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_target() -> FrozenTarget:
    return tiny_llama_target(V)


def dense_draft(target: FrozenTarget, seed: int = 1, **kw) -> DSparkDenseDraft:
    torch.manual_seed(seed)
    keys = dict(num_layers=1, block_size=3, mask_token_id=MASK, target_layer_ids=[0, 1], markov_rank=8)
    keys.update(kw)
    draft = DSparkDenseDraft(DSparkDenseConfig.from_target_config(target.model.config, **keys)).eval()
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    return draft


def prompts(n: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g)
            for _ in range(n)]


# ---- (1) greedy speculative decoding == plain greedy decoding ------------------------------------
@pytest.mark.parametrize("layout", ["anchor", "mask"])
@pytest.mark.parametrize("g", [1, 3])
def test_greedy_equals_target_with_random_draft(llama_target, layout, g):
    draft = dense_draft(llama_target, layout=layout)
    for prompt in prompts(3, V, seed=g):
        ref = target_generate(llama_target, prompt, 12)
        out, stats = speculative_generate(llama_target, draft, prompt, max_new_tokens=12, num_drafts=g)
        assert out.tolist() == ref.tolist()
        assert stats and all(s.num_drafts == g and 0 <= s.num_accepted <= g for s in stats)
        # every token is accounted for: 1 prefill token + (n + 1) per step, the last step truncated
        before_last = 1 + sum(s.num_accepted + 1 for s in stats[:-1])
        assert before_last < len(out) <= before_last + stats[-1].num_accepted + 1


class OracleDraft(RequestProposer):
    """Drafts the target's own greedy continuation (all accepted); with `corrupt`, every other call gets one
    wrong token, cycling through the positions, to exercise partial acceptance."""

    def __init__(self, reference: list[int], corrupt: bool):
        self.reference, self.corrupt, self.calls = reference, corrupt, 0

    def propose(self, feats, tokens, *, num_drafts, temperature, generator):
        a = tokens.numel() - 1
        assert feats.aux.shape[1] == a and tokens.tolist() == self.reference[: a + 1], \
            "the loop's anchor must be the target's greedy token at position a, after the verified prefix"
        toks = list(self.reference[a + 1 : a + 1 + num_drafts])
        if self.corrupt and self.calls % 2 == 1:
            k = (self.calls // 2) % num_drafts
            toks[k] = (toks[k] + 1) % V
        self.calls += 1
        t = torch.tensor(toks)
        return Proposal(tokens=t, q_probs=torch.nn.functional.one_hot(t, V).float(), conf=None,
                        logits=torch.zeros(num_drafts, V))


@pytest.mark.parametrize("corrupt", [False, True])
@pytest.mark.parametrize("g", [1, 3])
def test_greedy_equals_target_with_oracle_draft(llama_target, g, corrupt):
    for prompt in prompts(3, V, seed=10 + g):
        n_new = 13
        cont = target_generate(llama_target, prompt, n_new + g + 2)
        reference = prompt.tolist() + cont.tolist()
        out, stats = speculative_generate(llama_target, OracleDraft(reference, corrupt), prompt,
                                          max_new_tokens=n_new, num_drafts=g)
        assert out.tolist() == cont[:n_new].tolist()  # truncated exactly at max_new_tokens
        accepted = [s.num_accepted for s in stats]
        if not corrupt:
            assert all(n == g for n in accepted)  # every draft accepted, bonus tokens emitted
            assert len(stats) == math.ceil((n_new - 1) / (g + 1))
        else:
            assert min(accepted) < g and max(accepted) == g  # rejections and full acceptances
            assert g == 1 or any(0 < n < g for n in accepted)  # partial acceptances too


def test_eos_stops_both_decoders_at_the_same_token(llama_target):
    draft = dense_draft(llama_target)
    prompt = prompts(1, V, seed=3)[0]
    ref = target_generate(llama_target, prompt, 16).tolist()
    eos = ref[5]
    cut = ref.index(eos) + 1
    plain = target_generate(llama_target, prompt, 16, eos_token_id=eos)
    out, _ = speculative_generate(llama_target, draft, prompt, max_new_tokens=16, num_drafts=3,
                                  eos_token_id=[eos])
    assert plain.tolist() == ref[:cut] and out.tolist() == ref[:cut]


class TargetAsDraft(RequestProposer):
    """A 'draft' that samples from the target itself through the `draft.propose` interface (MTP-style)."""

    def __init__(self, target: FrozenTarget, corrupt_every: int = 0):
        self.target, self.corrupt_every = target, corrupt_every
        self.calls: list[tuple[int, int]] = []  # (feature length, tokens length) per call

    def propose(self, feats, tokens, *, num_drafts, temperature, generator):
        self.calls.append((feats.aux.shape[1], tokens.numel()))
        seq, toks, rows = tokens.tolist(), [], []
        for _ in range(num_drafts):
            _, logits = spec.score(self.target, torch.tensor(seq))
            if temperature == 0:  # greedy oracle, wrong wherever the position is a multiple of corrupt_every
                y = int(logits[-1].argmax())
                if self.corrupt_every and len(seq) % self.corrupt_every == 0:
                    y = (y + 1) % V
                p = torch.nn.functional.one_hot(torch.tensor(y), V).float()
            else:
                p = torch.softmax(logits[-1] / temperature, -1)
                y = int(torch.multinomial(p, 1, generator=generator))
            toks.append(y)
            rows.append(p)
            seq.append(y)
        return Proposal(tokens=torch.tensor(toks), q_probs=torch.stack(rows), conf=None,
                        logits=torch.zeros(num_drafts, V))


def test_sampling_with_the_target_as_draft_accepts_everything(llama_target):
    """At T > 0, a draft whose q is exactly the target's distribution is always fully accepted: checks the
    loop's row alignment and temperature handling on the rejection path, and that a draft with its own
    `propose` gets the features of exactly the positions before x0 (tokens = those positions + x0)."""
    draft = TargetAsDraft(llama_target)
    gens = [torch.Generator().manual_seed(s) for s in (0, 1)]
    out = spec.speculative_generate_batch(llama_target, draft, [torch.tensor([1, 2, 3]), torch.tensor([5])],
                                          max_new_tokens=10, num_drafts=2, temperature=0.8,
                                          generators=gens)
    assert [len(t) for t in out.tokens] == [10, 10]
    assert all(s.num_accepted == 2 for steps in out.steps for s in steps)
    assert draft.calls and all(n_tok == n_feat + 1 for n_feat, n_tok in draft.calls)


def test_draft_sample_method_greedy_drafts_the_argmax_and_stays_lossless(llama_target):
    """vLLM's draft_sample_method (config/speculative.py:634-640): "greedy" (its default) drafts the argmax and
    verifies with a one-hot q; "probabilistic" samples at the request temperature. At T > 0 the target verifies
    at T either way; rejection sampling with a one-hot q keeps the target's distribution (chi-square)."""
    temps = []

    class Recording(TargetAsDraft):
        def propose(self, feats, tokens, *, num_drafts, temperature, generator):
            temps.append(temperature)
            return super().propose(feats, tokens, num_drafts=num_drafts, temperature=temperature, generator=generator)

    for method, want in (("greedy", 0.0), ("probabilistic", 0.8)):
        temps.clear()
        out = spec.speculative_generate_batch(llama_target, Recording(llama_target), [torch.tensor([1, 2, 3])],
                                              max_new_tokens=8, num_drafts=2, temperature=0.8,
                                              generators=[torch.Generator().manual_seed(0)],
                                              draft_sample_method=method)
        assert temps and set(temps) == {want} and len(out.tokens[0]) == 8
    with pytest.raises(ValueError, match="draft_sample_method"):
        spec.speculative_generate_batch(llama_target, Recording(llama_target), [torch.tensor([1])], max_new_tokens=2,
                                        num_drafts=1, draft_sample_method="topk")
    g = torch.Generator().manual_seed(4)
    p, q = _random_dist(g, 5), _random_dist(g, 5)
    greedy_q = torch.nn.functional.one_hot(q.argmax(), 5).float()
    assert chi2_pvalue(_first_token_counts(verify_rejection, p, greedy_q, 20000, seed=5), p) > 1e-3
    assert chi2_pvalue(_first_token_counts(_always_accept, p, greedy_q, 20000, seed=5), p) < 1e-3  # has power


def test_batched_cached_decoding_equals_one_request_at_a_time(llama_target):
    """Requests of different lengths batched together (left padding, per-row rollback of rejected drafts,
    finished rows dropped) decode exactly as each request alone through the uncached reference."""
    draft = TargetAsDraft(llama_target, corrupt_every=4)
    ps = prompts(5, V, seed=21)
    refs = [target_generate(llama_target, p, 14) for p in ps]
    eos = refs[2].tolist()[6]  # request 2 (at least) stops early: its row leaves the batch mid-run
    refs = [target_generate(llama_target, p, 14, eos_token_id=eos) for p in ps]
    out = spec.speculative_generate_batch(llama_target, draft, ps, max_new_tokens=14, num_drafts=3,
                                          eos_token_id=eos)
    assert [t.tolist() for t in out.tokens] == [r.tolist() for r in refs]
    assert any(0 < s.num_accepted < 3 for steps in out.steps for s in steps)  # partial rollbacks happened
    plain = spec.plain_generate(llama_target, ps, 14, eos_token_id=eos)
    assert [t.tolist() for t in plain.tokens] == [r.tolist() for r in refs]
    assert plain.target_forwards == 1 + max(len(r) for r in refs) - 1  # one batched forward per token
    assert out.target_forwards == 1 + max(len(s) for s in out.steps)
    t = out.timing
    assert t.rounds == out.target_forwards - 1 and 0 <= t.overhead_s <= t.total_s


def test_sampled_batch_does_not_depend_on_batch_mates(llama_target):
    """At T > 0 each request draws from its own generator: alone or batched, the same tokens."""
    draft = dense_draft(llama_target, seed=5)
    ps = prompts(3, V, seed=30)
    batched = spec.speculative_generate_batch(
        llama_target, draft, ps, max_new_tokens=9, num_drafts=2, temperature=1.0,
        generators=[torch.Generator().manual_seed(100 + i) for i in range(3)])
    for i, p in enumerate(ps):
        alone, _ = speculative_generate(llama_target, draft, p, max_new_tokens=9, num_drafts=2,
                                        temperature=1.0, generator=torch.Generator().manual_seed(100 + i))
        assert alone.tolist() == batched.tokens[i].tolist()


def _session_target(kind: str) -> FrozenTarget:
    if kind == "v4":  # sliding window smaller than the sequences, hc streams averaged
        torch.manual_seed(0)
        return FrozenTarget(DeepseekV4ForCausalLM(tiny_v4_config(vocab_size=V, sliding_window=5)).eval(), [0, 2])
    from dspark.targets.tiny_hy_v4 import load_tiny_hy_v4_target  # MLA + DSA indexer keys in the cache

    target = load_tiny_hy_v4_target(layer_ids=[0, 2])
    target.capture_pre_head = True  # an optional feature field travels through the session too
    return target


@pytest.mark.parametrize("kind", ["v4", "hy_v4"])
def test_session_cache_matches_full_recompute_after_rollbacks(kind):
    """The KV session's features/logits after commits with rejected slots == a fresh forward of the kept
    tokens, for rows of different lengths (left padding)."""
    from dspark.evaluation.target_session import TargetSession

    target = _session_target(kind)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, V, (n,), generator=gen) for n in (3, 7)]
    sess = TargetSession(target, seqs)
    sess.prefill()
    for keep in ([2, 4], [1, 3], [4, 0]):
        new = torch.randint(0, V, (2, 4), generator=gen)
        logits = sess.forward(new)
        for i in range(2):
            full, ref_logits = spec.score(target, torch.cat([seqs[i], new[i]]))
            assert torch.allclose(logits[i], ref_logits[-4:], atol=1e-4)
        sess.commit(keep)
        seqs = [torch.cat([s, new[i, :k]]) for i, (s, k) in enumerate(zip(seqs, keep))]
        for i in range(2):
            full, _ = spec.score(target, seqs[i])
            got = sess.features(i)
            assert sess.tokens(i).tolist() == seqs[i].tolist()
            assert torch.allclose(got.aux, full.aux, atol=1e-4)
            assert (got.pre_head is None) == (kind == "v4")
            assert got.pre_head is None or torch.allclose(got.pre_head, full.pre_head, atol=1e-4)
    sess.retain([1])
    new = torch.randint(0, V, (1, 2), generator=gen)
    _, ref_logits = spec.score(target, torch.cat([seqs[1], new[0]]))
    assert torch.allclose(sess.forward(new)[0], ref_logits[-2:], atol=1e-4)


# ---- (2) rejection sampling is lossless ----------------------------------------------------------
def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution: 1 - P(df/2, x/2) (regularized gamma, series)."""
    s, z = df / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    term = total = 1.0 / s
    n = 0
    while term > total * 1e-15:
        n += 1
        term *= z / (s + n)
        total += term
    lower = math.exp(s * math.log(z) - z - math.lgamma(s)) * total
    return max(0.0, 1.0 - lower)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs.double() * n
    assert float(expected.min()) >= 5, "test design: too few expected counts for the chi-square test"
    stat = float(((counts.double() - expected) ** 2 / expected).sum())
    return chi2_sf(stat, counts.numel() - 1)


def test_chi2_helper_matches_tables():
    assert chi2_sf(18.467, 4) == pytest.approx(0.001, rel=1e-3)  # 99.9% quantile, df 4
    assert chi2_sf(51.179, 24) == pytest.approx(0.001, rel=1e-3)  # df 24
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, rel=1e-3)


def _random_dist(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=g) * 1.2, -1) * 0.8 + 0.2 / shape[-1]


def _always_accept(draft_tokens, q_probs, target_probs, generator):
    return draft_tokens.numel(), int(torch.multinomial(target_probs[-1], 1, generator=generator))


def _resample_from_p(draft_tokens, q_probs, target_probs, generator):
    """Wrong on rejection: samples from p instead of the residual max(p - q, 0)."""
    for k, y in enumerate(draft_tokens.tolist()):
        if float(torch.rand((), generator=generator)) * float(q_probs[k, y]) >= float(target_probs[k, y]):
            return k, int(torch.multinomial(target_probs[k], 1, generator=generator))
    return draft_tokens.numel(), int(torch.multinomial(target_probs[-1], 1, generator=generator))


def _first_token_counts(verifier, p: torch.Tensor, q: torch.Tensor, trials: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, trials, replacement=True, generator=gen)  # [trials]
    rows = torch.stack([p, p])  # [g+1, V]; row 1 is only used for the bonus
    counts = torch.zeros(p.numel())
    for y in drafts.tolist():
        n, nxt = verifier(torch.tensor([y]), q.view(1, -1), rows, gen)
        counts[y if n == 1 else nxt] += 1
    return counts


def test_rejection_sampling_first_token_follows_the_target():
    g = torch.Generator().manual_seed(0)
    p, q = _random_dist(g, 5), _random_dist(g, 5)
    assert chi2_pvalue(_first_token_counts(verify_rejection, p, q, 20000, seed=1), p) > 1e-3
    # the test has power: wrong verifiers are rejected
    assert chi2_pvalue(_first_token_counts(_always_accept, p, q, 20000, seed=1), p) < 1e-3
    assert chi2_pvalue(_first_token_counts(_resample_from_p, p, q, 20000, seed=1), p) < 1e-3


def _two_token_counts(verifier, p0, p1, q0, q1, trials: int, seed: int) -> torch.Tensor:
    """Joint counts of the first two emitted tokens. p1[a] / q1[a]: target / draft distributions of the
    second token given the first is a (the draft is Markov: q1 depends on its own first sample)."""
    gen = torch.Generator().manual_seed(seed)
    Vn = p0.numel()
    counts = torch.zeros(Vn, Vn)
    for _ in range(trials):
        y0 = int(torch.multinomial(q0, 1, generator=gen))
        y1 = int(torch.multinomial(q1[y0], 1, generator=gen))
        rows = torch.stack([p0, p1[y0], p0])  # [3, V]; p_2 (bonus) is irrelevant for the first two tokens
        n, nxt = verifier(torch.tensor([y0, y1]), torch.stack([q0, q1[y0]]), rows, gen)
        if n == 0:  # one token emitted; the next verify step drafts the second from q1[first]
            first = nxt
            y = int(torch.multinomial(q1[first], 1, generator=gen))
            n2, nxt2 = verifier(torch.tensor([y]), q1[first].view(1, -1), torch.stack([p1[first], p0]), gen)
            second = y if n2 == 1 else nxt2
        else:
            first, second = y0, (y1 if n == 2 else nxt)
        counts[first, second] += 1
    return counts.flatten()


def test_rejection_sampling_two_positions_joint_follows_the_target():
    g = torch.Generator().manual_seed(2)
    p0, q0 = _random_dist(g, 5), _random_dist(g, 5)
    p1, q1 = _random_dist(g, 5, 5), _random_dist(g, 5, 5)
    joint = (p0[:, None] * p1).flatten()  # [25]
    assert chi2_pvalue(_two_token_counts(verify_rejection, p0, p1, q0, q1, 12000, seed=3), joint) > 1e-3
    assert chi2_pvalue(_two_token_counts(_always_accept, p0, p1, q0, q1, 12000, seed=3), joint) < 1e-3


def test_verify_greedy_and_rejection_edge_cases():
    logits = torch.tensor([[0.0, 5, 0], [3, 0, 0], [0, 0, 1]])  # argmax 1, 0, 2
    assert verify_greedy(torch.tensor([1, 0]), logits) == (2, 2)  # all accepted + bonus
    assert verify_greedy(torch.tensor([1, 2]), logits) == (1, 0)  # mismatch at k=1 -> target's token
    assert verify_greedy(torch.tensor([0, 0]), logits) == (0, 1)  # later matches do not count
    with pytest.raises(ValueError, match=r"\[g\+1, V\]"):
        verify_greedy(torch.tensor([1, 0]), logits[:2])
    # q one-hot on p's argmax and p one-hot: rejection sampling reduces to greedy
    p = torch.nn.functional.one_hot(logits.argmax(-1), 3).float()
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([[0.0, 1, 0], [0, 0, 1]])  # drafts 1 then 2, both with certainty
    assert verify_rejection(torch.tensor([1, 2]), q, p, gen) == (1, 0)  # residual at k=1 is p_1 itself
    with pytest.raises(ValueError, match="q = 0"):
        verify_rejection(torch.tensor([0]), torch.tensor([[0.0, 1, 0]]), p[:2], gen)


# ---- (3) acceptance counting as vLLM --------------------------------------------------------------
def test_acceptance_counter_hand_computed():
    c = AcceptanceCounter()
    for n in (3, 0, 1, 3):  # 4 steps of 3 drafts
        c.update(3, n)
    r = c.report()
    assert r["num_drafts"] == 4 and r["num_draft_tokens"] == 12 and r["num_accepted_tokens"] == 7
    assert r["accepted_per_pos"] == [3, 2, 2]
    assert r["mean_acceptance_length"] == pytest.approx(1 + 7 / 4)
    assert r["draft_acceptance_rate"] == pytest.approx(7 / 12)
    assert r["per_position_rate"] == pytest.approx([0.75, 0.5, 0.5])
    assert r["per_position_conditional_rate"] == pytest.approx([0.75, 2 / 3, 1.0])

    other = AcceptanceCounter()
    other.update(4, 4)  # longer draft: the per-position list grows
    other.update(4, 0)
    m = AcceptanceCounter.merged([c, other]).report()
    assert m["num_drafts"] == 6 and m["num_accepted_tokens"] == 11 and m["accepted_per_pos"] == [4, 3, 3, 1]
    assert m["mean_acceptance_length"] == pytest.approx(1 + 11 / 6)
    assert m["per_position_rate"] == pytest.approx([4 / 6, 3 / 6, 3 / 6, 1 / 6])

    empty = AcceptanceCounter()
    empty.update(2, 0)
    assert empty.report()["per_position_conditional_rate"] == [0.0, None]  # r_1 / r_0 undefined
    with pytest.raises(ValueError):
        c.update(2, 3)


def test_acceptance_counter_from_step_stats():
    steps = [spec.StepStats(anchor_pos=5, draft_tokens=[1, 2], num_accepted=1, next_token=4, conf=None),
             spec.StepStats(anchor_pos=7, draft_tokens=[1, 2], num_accepted=2, next_token=4, conf=None)]
    assert acceptance_counter(steps).report()["accepted_per_pos"] == [2, 1]


# ---- (4) propose() is the training forward ------------------------------------------------------
@pytest.mark.parametrize("layout,window,kind", [("anchor", None, "vanilla"), ("mask", None, "rnn"),
                                                ("anchor", 3, "gated"), ("mask", 2, "vanilla")])
def test_propose_teacher_forced_equals_training_forward(llama_target, layout, window, kind):
    g, S, a = 3, 12, 6
    draft = dense_draft(llama_target, seed=5, markov_head_type=kind, layout=layout, sliding_window=window)
    for p in draft.parameters():  # make the heads matter: bigger weights than the 0.02 init
        torch.nn.init.normal_(p, std=0.3) if p.dim() == 2 else None
    ids = torch.randint(0, MASK, (1, S), generator=torch.Generator().manual_seed(7))
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids),
                 anchors=torch.tensor([[a]]), keep=torch.tensor([[True]]))
    module = BlockDraftModule(draft, llama_target)
    with torch.no_grad():
        ref = module.draft_outputs(batch)
    aux = llama_target.features(ids).aux  # [1, S, 2H]; propose reads positions 0..a-1 only
    prop = propose(draft, aux, int(ids[0, a]), a, num_drafts=g, forced_tokens=ids[0, a + 1 : a + 1 + g])
    torch.testing.assert_close(prop.logits, ref.logits[0, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prop.conf, torch.sigmoid(ref.conf_logits[0, 0]), atol=1e-6, rtol=1e-5)
    # only the context before the anchor is read: garbage after it changes nothing
    noisy = aux.clone()
    noisy[:, a:] = torch.randn_like(noisy[:, a:])
    again = propose(draft, noisy, int(ids[0, a]), a, num_drafts=g, forced_tokens=ids[0, a + 1 : a + 1 + g])
    torch.testing.assert_close(again.logits, prop.logits)
    # free-running at T=0: y_k = argmax of the Markov-corrected logits given the previous own token
    free = propose(draft, aux, int(ids[0, a]), a, num_drafts=g)
    assert free.tokens[0] == prop.logits[0].argmax()
    assert torch.equal(free.tokens, free.logits.argmax(-1))
    assert torch.equal(free.q_probs, torch.nn.functional.one_hot(free.tokens, V).float())


def test_propose_sampling_and_dflash_draft(llama_target):
    draft = dense_draft(llama_target, markov_rank=0, layout="mask")  # DFlash: no Markov head, no confidence head
    aux = llama_target.features(torch.tensor([[1, 2, 3, 4]])).aux
    gen = torch.Generator().manual_seed(0)
    prop = propose(draft, aux, 5, 4, num_drafts=3, temperature=0.7,
                   generator=gen)
    assert prop.conf is None and prop.tokens.shape == (3,) and prop.q_probs.shape == (3, V)
    torch.testing.assert_close(prop.q_probs, torch.softmax(prop.logits / 0.7, -1))
    assert torch.allclose(prop.q_probs.sum(-1), torch.ones(3))
    with pytest.raises(ValueError, match="anchor_pos"):
        propose(draft, aux, 5, 5, num_drafts=3)
    with pytest.raises(ValueError, match="layout"):
        dense_draft(llama_target, markov_rank=0, layout="causal")


# ---- (5) DeepSeek-V4 draft on a tiny DeepSeek-V4 target -----------------------------------------
def v4_target_and_draft():
    """A random tiny DeepSeek-V4 target (vocab 50, window 4) and a 1-layer DSpark V4 draft (mask id 49)."""
    from dspark.models.dspark_v4 import DSparkV4Config, DSparkV4Draft

    torch.manual_seed(0)
    hf = tiny_v4_config(initializer_range=0.2)
    target = FrozenTarget(DeepseekV4ForCausalLM(hf), [0, 2])
    draft = DSparkV4Draft(DSparkV4Config.from_target_config(
        hf, num_layers=1, block_size=3, mask_token_id=49, target_layer_ids=[0, 2], markov_rank=4)).eval()
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    return target, draft


def test_v4_draft_speculative_greedy_equals_target():
    target, draft = v4_target_and_draft()
    for prompt in prompts(2, 50, seed=4):
        ref = target_generate(target, prompt, 10)
        for layout in ("anchor", "mask"):
            draft.config.layout = layout
            out, stats = speculative_generate(target, draft, prompt, max_new_tokens=10, num_drafts=3)
            assert out.tolist() == ref.tolist()
            assert all(s.conf is not None and len(s.conf) == 3 for s in stats)


@pytest.mark.parametrize("layout", ["anchor", "mask"])
def test_propose_batch_rows_equal_proposing_alone(layout):
    """Right-padded contexts of different lengths in one draft forward (V4 draft, window 4 < contexts):
    every row's logits, confidences and sampled tokens equal proposing that request alone."""
    target, draft = v4_target_and_draft()
    draft.config.layout = layout
    ctxs = [target.features(torch.randint(0, 49, (1, n))).aux for n in (2, 9, 5)]
    x0 = [3, 17, 40]
    kw = dict(num_drafts=3, temperature=1.0)
    batch = draft.propose_blocks(ctxs, x0, generators=[torch.Generator().manual_seed(i) for i in range(3)], **kw)
    for i, (c, x) in enumerate(zip(ctxs, x0)):
        alone = propose(draft, c, x, c.shape[1], generator=torch.Generator().manual_seed(i), **kw)
        assert batch[i].tokens.tolist() == alone.tokens.tolist()
        assert torch.allclose(batch[i].logits, alone.logits, atol=1e-5)
        assert torch.allclose(batch[i].conf_logits, alone.conf_logits, atol=1e-5)


# ---- eval.py pipeline on a tiny dense target with a chat template -------------------------------
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tiny_hf_target_dir(path) -> None:
    """Byte-level tokenizer (256 bytes + ChatML specials + <|mask|>) and a random tiny Llama, saved as an HF folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|mask|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                      eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)


@pytest.fixture(scope="module")
def eval_setup(tmp_path_factory):
    """A finished 'training run' (exported draft + draft_config.json), its Lightning .ckpt, benchmark files."""
    from omegaconf import OmegaConf

    from dspark import factory
    from dspark.io import atomic_write_json, save_safetensors_atomic

    root = tmp_path_factory.mktemp("eval")
    _tiny_hf_target_dir(root / "target")
    draft_group = dict(kind="dspark_dense", num_layers=1, block_size=3, mask_token_id=None, target_layer_ids=[0, 1],
                       markov_rank=8, markov_head_type="vanilla", sliding_window=None, layout="anchor",
                       init_from_target=False, arch={})
    cfg = OmegaConf.create({"target": {"kind": "hf", "path": str(root / "target"), "dtype": "float32"},
                            "draft": draft_group})
    target = factory.build_target(cfg.target, cfg.draft)
    draft = factory.build_draft(cfg.draft, target)
    state = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    save_safetensors_atomic(state, root / "run" / "draft" / "model.safetensors")
    atomic_write_json(root / "run" / "draft" / "draft_config.json", draft_group)
    from dspark.training.module import _numpy_state_to_plain
    import numpy as np

    import io

    from dspark.integrity import write_checked, write_manifest

    write_manifest(root / "run" / "draft")  # what training leaves: the draft folder sealed by its checksums
    buf = io.BytesIO()
    torch.save({"state_dict": {f"draft.{k}": v for k, v in state.items()}, "global_step": 3,
                "rng": {"numpy": _numpy_state_to_plain(np.random.get_state()), "torch": torch.get_rng_state()}}, buf)
    write_checked(root / "run" / "checkpoints" / "last.ckpt", buf.getbuffer())
    data = root / "data"
    data.mkdir()
    (data / "chat.jsonl").write_text('{"turns": ["Hello there, how are you?", "second turn"]}\n'
                                     '{"turns": ["Write 2+2."]}\n\n{"turns": ["Third prompt here"]}\n')
    (data / "math.jsonl").write_text('{"turns": ["What is 7*6?"]}\n')
    return root


def _eval_cfg(root, *overrides):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    configs = Path(__file__).resolve().parents[2] / "configs"
    base = ["target=hf", f"target.path={root / 'target'}", "target.dtype=float32", f"data_dir={root / 'data'}",
            "benchmarks=[chat,math]", "num_prompts=2", "max_new_tokens=10"]
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        return compose(config_name="eval", overrides=base + list(overrides))


def test_eval_writes_vllm_style_reports(eval_setup, capsys):
    import json

    from dspark.evaluation.run_eval import run_eval

    root = eval_setup
    reports = run_eval(_eval_cfg(root, f"run_dir={root / 'run'}"))
    chat = json.loads((root / "run" / "eval" / "chat.T0.g3.json").read_text())
    assert chat == json.loads(json.dumps(reports["chat"]))
    assert chat["num_prompts"] == 2 and chat["engine"] == "dspark-reference" and chat["gamma"] == 3
    assert chat["temperature"] == 0.0 and set(chat["versions"]) >= {"torch", "transformers"}
    assert chat["greedy_outputs_equal_target"] == "3/3"  # 2 conversations, 3 turns; lossless at T=0
    assert chat["num_requests"] == 3 and set(chat["per_turn"]) == {"1", "2"}
    assert chat["wall_time_s"]["target"] > 0 and chat["speedup_vs_target"] > 0
    assert chat["mean_acceptance_length"] == 1 + chat["num_accepted_tokens"] / chat["num_drafts"]
    assert chat["num_draft_tokens"] == 3 * chat["num_drafts"] and len(chat["per_position_rate"]) == 3
    assert reports["math"]["num_prompts"] == 1
    assert (root / "run" / "eval" / "summary.T0.g3.json").is_file()
    assert "AL" in capsys.readouterr().out  # the stdout summary
    for png in ("acceptance.T0.g3.png", "reliability.T0.g3.png"):
        assert (root / "run" / "eval" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    conf = json.loads((root / "run" / "eval" / "confidence.T0.g3.json").read_text())
    steps = chat["num_drafts"] + reports["math"]["num_drafts"]
    assert conf["split"]["fit_blocks"] + conf["split"]["heldout_blocks"] == steps  # every verify step is a block
    assert len(conf["calibration"]["temperatures"]) == 3 and conf["scheduler"]["scheduler"]["tokens_per_s"] > 0
    assert chat["harness"]["rounds"] >= 1 and 0 <= chat["harness"]["overhead_share"] <= 1
    per_token = (chat["num_requests"] + chat["num_drafts"]) / chat["generated_tokens"]  # prefill + verify steps
    assert chat["target_forwards_per_token"] == {"speculative": per_token, "target": 1.0}
    # the Lightning checkpoint of the same weights gives the same greedy run
    ck = run_eval(_eval_cfg(root, f"draft_ckpt={root / 'run' / 'checkpoints' / 'last.ckpt'}",
                            f"out={root / 'ck_eval'}", "benchmarks=[chat]", "compare_target=false"))
    assert ck["chat"]["accepted_per_pos"] == chat["accepted_per_pos"]
    assert ck["chat"]["num_drafts"] == chat["num_drafts"]
    assert (root / "ck_eval" / "chat.T0.g3.json").is_file()


def test_eval_sampling_and_input_errors(eval_setup, tmp_path):
    from dspark.evaluation.run_eval import read_benchmark, run_eval
    from dspark.factory import ConfigError

    root = eval_setup
    rep = run_eval(_eval_cfg(root, f"run_dir={root / 'run'}", "temperature=1.0", "num_drafts=2",
                             "benchmarks=[math]", f"out={tmp_path / 'o'}"))["math"]
    assert rep["gamma"] == 2 and rep["num_draft_tokens"] == 2 * rep["num_drafts"]
    assert "greedy_outputs_equal_target" not in rep
    # the vLLM settings these numbers correspond to; vLLM's default draft_sample_method is greedy
    assert {k: rep["vllm_settings"][k] for k in ("method", "num_speculative_tokens", "draft_sample_method")} == \
        {"method": "dspark", "num_speculative_tokens": 2, "draft_sample_method": "greedy"}
    assert (tmp_path / "o" / "math.T1.g2.json").is_file()
    prob = run_eval(_eval_cfg(root, f"run_dir={root / 'run'}", "temperature=1.0", "num_drafts=2",
                              "draft_sample_method=probabilistic", "benchmarks=[math]", f"out={tmp_path / 'o'}"))
    assert prob["math"]["vllm_settings"]["draft_sample_method"] == "probabilistic"
    assert (tmp_path / "o" / "math.T1.g2.prob.json").is_file()
    with pytest.raises(ConfigError, match="draft_sample_method"):
        run_eval(_eval_cfg(root, f"run_dir={root / 'run'}", "draft_sample_method=topk"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"turns": ["ok"]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_benchmark(bad)
    bad.write_text('{"turns": ["ok"]}\n\n{"turns": []}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3"):
        read_benchmark(bad)
    with pytest.raises(ConfigError, match="run_dir"):
        run_eval(_eval_cfg(root))  # neither run_dir nor draft_ckpt
    with pytest.raises(ConfigError, match="run_dir"):
        run_eval(_eval_cfg(root, f"run_dir={tmp_path}"))  # no exported draft there


def test_eval_refuses_a_target_with_other_weights(eval_setup, tmp_path):
    """draft/target.json (written at the end of training) pins the target's weights: the same target passes,
    a retrained one under the same path is refused naming `target`, unless allow_target_mismatch."""
    import json
    import shutil

    from dspark.evaluation.run_eval import run_eval
    from dspark.factory import ConfigError
    from dspark.targets.hf_target import load_hf_target

    root = eval_setup
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    cfg = _eval_cfg(root, f"run_dir={run}", "benchmarks=[math]", "compare_target=false", "plots=false")
    target = load_hf_target(str(root / "target"), [0, 1])
    (run / "draft" / "target.json").write_text(json.dumps({"kind": "hf", "path": "x", "fingerprint": target.fingerprint()}))
    assert run_eval(cfg)["math"]["num_drafts"] > 0
    with torch.no_grad():
        target.model.get_output_embeddings().weight.mul_(1.01)  # "retrained": one tensor differs
    (run / "draft" / "target.json").write_text(json.dumps({"kind": "hf", "path": "x", "fingerprint": target.fingerprint()}))
    with pytest.raises(ConfigError, match="target.*different weights"):
        run_eval(cfg)
    cfg.allow_target_mismatch = True
    assert run_eval(cfg)["math"]["num_drafts"] > 0


def test_acceptance_length_from_conditional_rates_equals_the_counted_one():
    """benchmarks/acceptance_decomposition.py rebuilds AL from the reported conditional rates: exact for any counts."""
    from dspark.evaluation.metrics import acceptance_length_from_conditional

    gen = torch.Generator().manual_seed(0)
    for gamma in (1, 3, 6):
        c = AcceptanceCounter()
        for n in torch.randint(0, gamma + 1, (200,), generator=gen).tolist():
            c.update(gamma, int(n))
        r = c.report()
        assert acceptance_length_from_conditional(r["per_position_conditional_rate"]) == \
            pytest.approx(r["mean_acceptance_length"], rel=1e-12)
    never = AcceptanceCounter()
    never.update(3, 0)
    assert acceptance_length_from_conditional(never.report()["per_position_conditional_rate"]) == 1.0
