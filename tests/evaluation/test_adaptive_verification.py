"""vLLM's adaptive verification, simulated (dspark.evaluation.adaptive): the online acceptance estimator against a
direct per-element transcription of vLLM's kernels (v1/worker/gpu/spec_decode/acceptance_estimator.py), that it
learns a known logistic, and the head-vs-estimator comparison on hand-checked rounds."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dspark.evaluation import adaptive
from dspark.evaluation.adaptive import OnlineAcceptanceEstimator, estimator_features
from test_speculative import _eval_cfg, eval_setup  # noqa: F401  (eval.py's tiny run)


# ---- direct transcriptions (one element at a time, Python floats) -----------------------------------
def feature_direct(row: list[float], temp: float) -> float:
    """_local_max_sumexp_kernel + _predict_kernel (:195-216, :280-302): logit(max q), clamped to +-40."""
    t = temp if temp > 0 else 1.0
    z = [x / t for x in row]
    m = max(z)
    comp = max(sum(math.exp(x - m) for x in z) - 1.0, 0.0)
    f = -math.log(comp) if comp > 0 else math.inf
    return min(max(f, -40.0), 40.0)


class EstimatorDirect:
    """_accumulate_kernel (:23-88) and _refit_kernel (:91-160), element by element."""

    def __init__(self, g: int, interval: int):
        self.g, self.interval, self.since = g, interval, 0
        self.w, self.b = 0.5, [-0.2] * g
        self.clear()

    def clear(self):
        self.a = [0.0] * self.g
        self.bk = [0.0] * self.g
        self.c = [0.0] * self.g
        self.g0 = [0.0] * self.g
        self.g1 = [0.0] * self.g
        self.n = [0.0] * self.g

    def predict(self, f: float, k: int) -> float:
        return 1.0 / (1.0 + math.exp(-(self.w * f + self.b[k])))

    def step(self, feats, preds, accepted, verified):
        for r in range(len(accepted)):
            for k in range(self.g):
                if not (k <= accepted[r] and k < verified[r]):
                    continue
                f, p = feats[r][k], preds[r][k]
                wt, res = p * (1 - p), (1.0 if k < accepted[r] else 0.0) - p
                self.a[k] += wt * f * f
                self.bk[k] += wt * f
                self.c[k] += wt
                self.g0[k] += res * f
                self.g1[k] += res
                self.n[k] += 1
        self.since += 1
        if self.since < self.interval:
            return
        self.since = 0
        lam, damp = 1e-3, 50.0
        c = [x + lam for x in self.c]
        a = sum(self.a) + lam
        sw = (sum(self.g0) - sum(self.bk[k] * self.g1[k] / c[k] for k in range(self.g))) / \
             (a - sum(self.bk[k] ** 2 / c[k] for k in range(self.g)))
        total = sum(self.n)
        sw *= total / (total + damp)
        if sw != sw or self.w + sw < 0:
            sw = 0.0
        self.w += sw
        for k in range(self.g):
            sb = (self.g1[k] - self.bk[k] * sw) / c[k] * (self.n[k] / (self.n[k] + damp))
            self.b[k] += sb if sb == sb else 0.0
        self.clear()


# ---- the feature --------------------------------------------------------------------------------
def test_feature_matches_the_direct_transcription():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, 11, generator=g) * 3
    logits[0, 0] = torch.tensor([0.0] * 10 + [200.0])  # one token carries all the mass: clamped at +40
    for temp in (0.0, 0.7, 1.0):
        got = estimator_features(logits, temp)  # [4, 3]
        want = torch.tensor([[feature_direct(logits[i, k].tolist(), temp) for k in range(3)] for i in range(4)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 vs float64: a few ulp of exp/log
    assert float(estimator_features(logits, 1.0)[0, 0]) == 40.0
    # the feature is logit(max q): q_max = 1/2 -> 0
    assert float(estimator_features(torch.tensor([math.log(3.0), 0.0, 0.0, 0.0]), 1.0)) == pytest.approx(0.0, abs=1e-6)


# ---- the estimator --------------------------------------------------------------------------------
def test_estimator_matches_the_direct_transcription():
    rng = np.random.default_rng(1)
    g, interval = 3, 4
    est, ref = OnlineAcceptanceEstimator(g), EstimatorDirect(g, interval)
    est.REFIT_INTERVAL = interval
    for _ in range(3 * interval + 1):  # three refits
        r = int(rng.integers(1, 5))
        feats = rng.normal(0, 2, size=(r, g)).astype(np.float32)
        preds = est.predict(torch.from_numpy(feats))
        ref_preds = [[ref.predict(float(feats[i, k]), k) for k in range(g)] for i in range(r)]
        np.testing.assert_allclose(preds.numpy(), ref_preds, rtol=1e-5, atol=1e-6)
        verified = rng.integers(0, g + 1, size=r)
        accepted = np.minimum(rng.integers(0, g + 1, size=r), verified)
        est.step(torch.from_numpy(feats), preds, torch.from_numpy(accepted), torch.from_numpy(verified))
        ref.step(feats.astype(np.float64).tolist(), preds.double().tolist(), accepted.tolist(), verified.tolist())
    assert est.refits == 3
    assert float(est.slope) == pytest.approx(ref.w, rel=1e-4, abs=1e-5)
    np.testing.assert_allclose(est.intercepts.numpy(), ref.b, rtol=1e-4, atol=1e-5)
    assert float(est.slope) != 0.5  # it moved


def test_estimator_learns_a_known_logistic():
    """Drafts accepted position by position with P = sigmoid(1.5 f + b_k), b = (1, 0, -1). Each refit is one damped
    Newton step on that round's statistics only (they are cleared), so the coefficients fluctuate around the truth
    with the noise of one round: their mean over the later refits is close to it."""
    rng = np.random.default_rng(2)
    g, w_true, b_true = 3, 1.5, np.array([1.0, 0.0, -1.0])
    est = OnlineAcceptanceEstimator(g)
    est.REFIT_INTERVAL = 5
    trace = []
    for step in range(600):
        feats = rng.normal(0, 1.5, size=(64, g))
        ok = rng.random((64, g)) < 1 / (1 + np.exp(-(w_true * feats + b_true)))
        accepted = np.where(ok.all(1), g, np.argmin(ok, axis=1))  # first failure
        preds = est.predict(torch.from_numpy(feats))
        est.step(torch.from_numpy(feats), preds, torch.from_numpy(accepted), torch.full((64,), g))
        if step >= 100 and est.steps_since_refit == 0:
            trace.append([float(est.slope), *est.intercepts.tolist()])
    mean = np.mean(trace, axis=0)
    assert len(trace) == 100 and est.refits == 120
    assert mean[0] == pytest.approx(w_true, abs=0.1)
    np.testing.assert_allclose(mean[1:], b_true, atol=0.1)
    # learning from nothing but labels: the cold start (0.5, -0.2) is far from the truth
    assert abs(0.5 - w_true) > 0.5


# ---- head vs estimator on hand-checked rounds -----------------------------------------------------
def _steps(accepted, conf, feats):
    return [SimpleNamespace(num_accepted=n, conf=c, est_feature=f) for n, c, f in zip(accepted, conf, feats)]


def test_simulate_hand_checked():
    """One batch, two requests, g = 2, one round: request 0 accepts both drafts, request 1 none. SPS(B) = 12 / (B + 2)
    (a fixed cost per step plus one per verified token). Verify all: B = 6, tokens (1 + 2) + (1 + 0) = 4 ->
    4 * 12 / 8 = 6 tok/s. A perfect head, (1, 1) / (0, 0): the scheduler's objective tau * SPS(B) is 6, 7.2, 8, 6.86
    for B = 2..5, so lengths (2, 0), tokens 4, B = 4 -> 8 tok/s. The cold-start estimator on features 0:
    p = sigmoid(-0.2) = 0.450 everywhere, survival (0.450, 0.2025) in both rows: objective 6, 5.88, 5.80, ... so
    lengths (0, 0), tokens 2, B = 2 -> 6 tok/s. The head pays (x 4/3)."""
    sps = lambda b: 12.0 / (b + 2)  # noqa: E731
    batch = [_steps([2], [[1.0, 1.0]], [[0.0, 0.0]]), _steps([0], [[0.0, 0.0]], [[0.0, 0.0]])]
    out = adaptive.simulate([batch], sps)
    assert out["verify_all"]["tokens_per_s"] == pytest.approx(6.0) and out["verify_all"]["mean_batch"] == 6
    assert out["head"]["tokens_per_s"] == pytest.approx(8.0) and out["head"]["mean_batch"] == 4
    assert out["estimator"]["tokens_per_s"] == pytest.approx(6.0) and out["estimator"]["mean_batch"] == 2
    assert out["head_vs_estimator"] == pytest.approx(4 / 3) and out["head_pays"] is True
    assert out["estimator"]["refits"] == 0
    # an anti-informative head (confident where rejected) verifies request 1's drafts: tokens 1 + 1, B = 4
    bad = [_steps([2], [[0.0, 0.0]], [[0.0, 0.0]]), _steps([0], [[1.0, 1.0]], [[0.0, 0.0]])]
    out = adaptive.simulate([bad], sps)
    assert out["head"]["tokens_per_s"] == pytest.approx(2 * 12 / 6)
    assert out["head_pays"] is False
    # a draft without a head: only the estimator is reported
    nohead = [_steps([2], [None], [[0.0, 0.0]]), _steps([0], [None], [[0.0, 0.0]])]
    out = adaptive.simulate([nohead], sps)
    assert out["head"] is None and "head_pays" not in out



def test_eval_reports_head_vs_estimator_per_benchmark(eval_setup, tmp_path, capsys):
    from dspark.evaluation.run_eval import run_eval

    root = eval_setup
    reps = run_eval(_eval_cfg(root, f"run_dir={root / 'run'}", "num_drafts=2", "plots=false", "compare_target=false",
                              "confidence=false", f"out={tmp_path / 'o'}"))
    printed = capsys.readouterr().out
    for name, rep in reps.items():
        assert f"{name}: adaptive verification (vLLM verifies fewer drafted tokens" in printed
        av = rep["adaptive_verification"]
        steps = rep["num_drafts"]  # verify steps (one per round per request)
        # verifying every draft emits what the run emitted: 1 + accepted per step
        assert av["verify_all"]["emitted_tokens"] == steps + rep["num_accepted_tokens"]
        assert av["head"] is not None and av["estimator"]["refits"] == 0  # a few steps: the cold start
        assert av["head_pays"] == (av["head"]["tokens_per_s"] > av["estimator"]["tokens_per_s"])
        assert set(av["sps_table"]) == {"batch_sizes", "sps"}
    out = run_eval(_eval_cfg(root, f"run_dir={root / 'run'}", "num_drafts=2", "plots=false", "compare_target=false",
                             "confidence=false", "adaptive_verification=false", "benchmarks=[math]",
                             f"out={tmp_path / 'o2'}"))
    assert "adaptive_verification" not in out["math"]
