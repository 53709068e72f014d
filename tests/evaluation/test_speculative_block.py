"""Block verification (vLLM rejection_sample_method="block", dspark.evaluation.verify.verify_block): lossless at
T = 0 (greedy path), the target's distribution at T = 1 (chi-square over the first emitted tokens of a Markov
target / draft pair, with power against broken variants), and a hand-checked case where it accepts more than
token-by-token verification."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_speculative import _random_dist, chi2_pvalue, dense_draft, eval_setup, llama_target, prompts  # noqa: F401

import dspark.evaluation.speculative as spec
import dspark.evaluation.verify as verify
from dspark.evaluation.speculative import speculative_generate, target_generate
from dspark.evaluation.verify import verify_block, verify_rejection


# ---- T = 0: lossless ------------------------------------------------------------------------------
@pytest.mark.parametrize("g", [1, 3])
def test_block_greedy_equals_plain_greedy_target(llama_target, g):
    draft = dense_draft(llama_target)
    for prompt in prompts(3, 64, seed=10 + g):
        ref = target_generate(llama_target, prompt, 12)
        out, stats = speculative_generate(llama_target, draft, prompt, max_new_tokens=12, num_drafts=g,
                                          rejection_sample_method="block")
        assert out.tolist() == ref.tolist()


def test_block_mode_is_what_runs_at_t1(llama_target, monkeypatch):
    calls = []
    monkeypatch.setattr(spec, "verify_block", lambda *a: calls.append(1) or verify_block(*a))
    monkeypatch.setattr(spec, "verify_rejection", lambda *a: pytest.fail("standard verification ran"))
    draft = dense_draft(llama_target)
    out, stats = speculative_generate(llama_target, draft, prompts(1, 64)[0], max_new_tokens=8, num_drafts=3,
                                      temperature=1.0, generator=torch.Generator().manual_seed(0),
                                      rejection_sample_method="block")
    assert len(calls) == len(stats) >= 1 and len(out) == 8
    with pytest.raises(ValueError, match="rejection_sample_method"):
        speculative_generate(llama_target, draft, prompts(1, 64)[0], max_new_tokens=4, num_drafts=2,
                             rejection_sample_method="fly")


# ---- T = 1: the emitted tokens follow the target ---------------------------------------------------
def markov_counts(verifier, p_first, p_next, q_first, q_next, g: int, trials: int, seed: int) -> torch.Tensor:
    """Joint counts [V*V] of the first two emitted tokens. Target and draft are Markov chains: the first token from
    p_first / q_first, every later one from p_next[prev] / q_next[prev]. Rounds of g drafts until two are out.
    Drafts are sampled with numpy (speed), the verifier draws from its torch generator."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    n_vocab = p_first.numel()
    qf, qn = q_first.double().numpy(), q_next.double().numpy()
    qf, qn = qf / qf.sum(), qn / qn.sum(-1, keepdims=True)
    counts = torch.zeros(n_vocab, n_vocab)
    for _ in range(trials):
        emitted: list[int] = []
        while len(emitted) < 2:
            prev = emitted[-1] if emitted else None
            ys, qs, ps = [], [], [p_first if prev is None else p_next[prev]]
            for _k in range(g):
                y = int(rng.choice(n_vocab, p=qf if prev is None else qn[prev]))
                ys.append(y), qs.append(q_first if prev is None else q_next[prev]), ps.append(p_next[y])
                prev = y
            n, nxt = verifier(torch.tensor(ys), torch.stack(qs), torch.stack(ps), gen)
            emitted += ys[:n] + [nxt]
        counts[emitted[0], emitted[1]] += 1
    return counts.flatten()


def _chain(seed: int, n_vocab: int = 3):
    g = torch.Generator().manual_seed(seed)
    p0, q0 = _random_dist(g, n_vocab), _random_dist(g, n_vocab)
    p1, q1 = _random_dist(g, n_vocab, n_vocab), _random_dist(g, n_vocab, n_vocab)
    return p0, p1, q0, q1, (p0[:, None] * p1).flatten()


def _stop_at_first_failure(draft_tokens, q_probs, target_probs, generator):
    """Wrong: tau = the first i with u_i > h_i (vLLM keeps scanning: tau is the LAST i + 1 with u_i <= h_i)."""
    g = draft_tokens.numel()
    p, q = target_probs.double(), q_probs.double()
    ratio = [1.0]
    for i, y in enumerate(draft_tokens.tolist()):
        ratio.append(min(ratio[-1] * float(p[i, y]) / float(q[i, y]), 1.0))
    tau = 0
    for i in range(g):
        if i < g - 1:
            r = float((ratio[i + 1] * p[i + 1] - q[i + 1]).clamp_min(0).sum())
            d = r + 1 - ratio[i + 1]
            h = r / d if d > 0 else 1.0
        else:
            h = ratio[g]
        if float(torch.rand((), generator=generator)) > h:
            break
        tau = i + 1
    row = p[g] if tau == g else (ratio[tau] * p[tau] - q[tau]).clamp_min(0)
    return tau, int(torch.multinomial(row, 1, generator=generator))


TRIALS = 4000


@pytest.mark.parametrize("g", [2, 3])
def test_block_verification_keeps_the_target_distribution(g):
    p0, p1, q0, q1, joint = _chain(seed=4)
    assert chi2_pvalue(markov_counts(verify_block, p0, p1, q0, q1, g, TRIALS, seed=5), joint) > 1e-3


def test_stopping_at_the_first_failure_fails_the_test():
    """Power: a verifier that ends the scan at the first failed position is caught."""
    p0, p1, q0, q1, joint = _chain(seed=4)
    assert chi2_pvalue(markov_counts(_stop_at_first_failure, p0, p1, q0, q1, 2, TRIALS, seed=5), joint) < 1e-3


def test_block_with_the_wrong_residual_fails_the_test(monkeypatch):
    p0, p1, q0, q1, joint = _chain(seed=4)
    monkeypatch.setattr(verify, "_block_residual", lambda p_tau, p_row, q_row: p_row)  # resample from M_b itself
    assert chi2_pvalue(markov_counts(verify.verify_block, p0, p1, q0, q1, 2, TRIALS, seed=5), joint) < 1e-3


def test_block_with_one_hot_drafts_keeps_the_target_distribution():
    """draft_sample_method=greedy: drafts are the draft argmax and q is one-hot; still lossless at T = 1."""
    p0, p1, q0, q1, joint = _chain(seed=6)
    hot = lambda d: torch.nn.functional.one_hot(d.argmax(-1), d.shape[-1]).float()  # noqa: E731
    counts = markov_counts(verify_block, p0, p1, hot(q0), hot(q1), 2, TRIALS, seed=7)
    assert chi2_pvalue(counts, joint) > 1e-3


# ---- a hand-checked case: block accepts where token-by-token rejects ---------------------------------
def test_block_accepts_more_than_standard_hand_checked():
    """V = 2, g = 2, drafts y = (0, 0). M_b_0 = (1/3, 2/3), M_s_0 = (2/3, 1/3): p_1 = min((1/3)/(2/3), 1) = 1/2.
    M_b_1 = (1, 0), M_s_1 = (1/2, 1/2): p_2 = min(1/2 * 1/(1/2), 1) = 1.
    Block: r_1 = max(1/2*1 - 1/2, 0) + max(0 - 1/2, 0) = 0, h_0 = 0 / (0 + 1 - 1/2) = 0; h_1 = p_2 = 1, so tau = 2
    whatever the uniforms. Standard: y_0 survives with probability 1/2, then y_1 surely (ratio 2): E[n] = 1."""
    y = torch.tensor([0, 0])
    q = torch.tensor([[2 / 3, 1 / 3], [0.5, 0.5]])
    p = torch.tensor([[1 / 3, 2 / 3], [1.0, 0.0], [0.5, 0.5]])
    gen = torch.Generator().manual_seed(0)
    block = [verify_block(y, q, p, gen)[0] for _ in range(400)]
    standard = [verify_rejection(y, q, p, gen)[0] for _ in range(400)]
    assert set(block) == {2}
    assert set(standard) == {0, 2}
    assert abs(sum(standard) / 400 - 1.0) < 0.2  # binomial(400, 1/2) * 2: sd of the mean 0.05
    # where block rejects everything (tau = 0), the next token is drawn from max(M_b_0 - M_s_0, 0) = (0, 1/3)
    p2 = torch.tensor([[1 / 3, 2 / 3], [0.0, 1.0], [0.5, 0.5]])  # p_2 = 0 (h_1 = 0); r_1 = 0 + 0 = 0 (h_0 = 0)
    outs = [verify_block(y, q, p2, gen) for _ in range(200)]
    assert outs == [(0, 1)] * 200


# ---- eval.py ------------------------------------------------------------------------------------
def test_eval_runs_block_verification_and_refuses_lossy_methods(eval_setup, tmp_path):
    from test_speculative import _eval_cfg

    from dspark.evaluation.run_eval import run_eval
    from dspark.factory import ConfigError

    root = eval_setup
    rep = run_eval(_eval_cfg(root, f"run_dir={root / 'run'}", "temperature=1.0", "num_drafts=2", "plots=false",
                             "compare_target=false", "rejection_sample_method=block", "benchmarks=[math]",
                             f"out={tmp_path / 'o'}"))["math"]
    assert rep["vllm_settings"]["rejection_sample_method"] == "block"
    assert (tmp_path / "o" / "math.T1.g2.block.json").is_file()
    for lossy in ("synthetic", "fly"):
        with pytest.raises(ConfigError, match=r"rejection_sample_method: .*synthetic.*fly"):
            run_eval(_eval_cfg(root, f"run_dir={root / 'run'}", f"rejection_sample_method={lossy}"))
