"""Confidence calibration: ECE, ROC-AUC, survival, Sequential Temperature Scaling, threshold sweep."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dspark.evaluation.calibration import (
    calibration_report,
    ece,
    fit_sequential_temperature_scaling,
    kept_lengths,
    probs_to_logits,
    reliability_table,
    roc_auc,
    survival,
    threshold_sweep,
)


def test_ece_hand_computed():
    # 2 bins: [0, .5) holds 0.2, 0.4 (conf .3, acc .5); [.5, 1] holds 0.6, 0.9, 1.0 (conf .8333, acc 2/3)
    p = [0.2, 0.4, 0.6, 0.9, 1.0]
    y = [0, 1, 1, 0, 1]
    want = 2 / 5 * abs(0.5 - 0.3) + 3 / 5 * abs(2 / 3 - 2.5 / 3)
    assert ece(p, y, n_bins=2) == pytest.approx(want)
    assert ece([1.0, 0.0], [1, 0]) == 0.0
    assert ece([0.7] * 10, [1] * 7 + [0] * 3, n_bins=15) == pytest.approx(0.0)
    assert ece(torch.tensor([0.25, 0.75]), torch.tensor([1, 1]), n_bins=1) == pytest.approx(0.5)


def test_ece_bad_input():
    with pytest.raises(ValueError):
        ece([0.1, 0.2], [1])
    with pytest.raises(ValueError):
        ece([1.2], [1])
    with pytest.raises(ValueError):
        ece([0.5], [2])


def test_reliability_table():
    t = reliability_table([0.2, 0.4, 0.6, 0.9], [0, 1, 1, 0], n_bins=4)
    assert t["bin_centers"] == [0.125, 0.375, 0.625, 0.875]
    assert t["counts"] == [1, 1, 1, 1]
    assert t["accuracy"] == [0.0, 1.0, 1.0, 0.0]
    assert t["confidence"] == pytest.approx([0.2, 0.4, 0.6, 0.9])
    t = reliability_table([0.9], [1], n_bins=2)
    assert t["accuracy"][0] is None and t["counts"] == [0, 1]


def test_roc_auc_hand_computed():
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert roc_auc([1, 2, 3], [0, 1, 1]) == 1.0
    assert roc_auc([3, 2, 1], [0, 1, 1]) == 0.0
    assert roc_auc([0.5, 0.5], [0, 1]) == 0.5  # tie counts one half
    assert roc_auc([0.1, 0.2], [1, 1]) is None  # one class absent
    assert roc_auc([0.1, np.nan, 0.3], [0, 1, 1]) == 1.0  # NaN pair dropped
    assert roc_auc([0.1, np.nan], [0, 1]) is None


def test_roc_auc_is_mann_whitney_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(5):
        s = rng.integers(0, 6, size=40).astype(float)  # many ties
        y = rng.integers(0, 2, size=40)
        pos, neg = s[y == 1], s[y == 0]
        u = sum((a > b) + 0.5 * (a == b) for a, b in itertools.product(pos, neg))
        assert roc_auc(s, y) == pytest.approx(u / (len(pos) * len(neg)))


def test_survival_monotone_and_temperatures():
    rng = np.random.default_rng(1)
    z = rng.normal(0, 3, size=(50, 6))
    a = survival(z)
    assert a.shape == (50, 6)
    assert np.all(np.diff(a, axis=1) <= 0) and np.all((a >= 0) & (a <= 1))
    a2 = survival(torch.tensor(z), np.full(6, 2.0))
    assert np.all(np.diff(a2, axis=1) <= 0)
    np.testing.assert_allclose(a2[:, 0], 1 / (1 + np.exp(-z[:, 0] / 2)))
    np.testing.assert_allclose(probs_to_logits(1 / (1 + np.exp(-z[:, :2] / 10))), z[:, :2] / 10, atol=1e-9)
    with pytest.raises(ValueError, match="> 0"):
        survival(z, np.array([1, 1, 0, 1, 1, 1.0]))
    with pytest.raises(ValueError, match=r"\[g\]"):
        survival(z, np.ones(5))
    with pytest.raises(ValueError, match=r"\[N, g\]"):
        survival(z[0])


def _synthetic(n=4000, g=5, scale=3.0, seed=0):
    """True per-position conditional logits, outcomes sampled sequentially, over-confident scores."""
    rng = np.random.default_rng(seed)
    true_logits = rng.normal(1.0, 1.2, size=(n, g)) - 0.2 * np.arange(g)  # [N, g]
    p = 1 / (1 + np.exp(-true_logits))
    ok = rng.random((n, g)) < p  # draft k accepted given all earlier were
    accepted_len = np.cumprod(ok, axis=1).sum(axis=1)  # [N] in 0..g
    return true_logits * scale, accepted_len


def test_sts_lowers_ece_on_overconfident_scores():
    z, acc = _synthetic()
    temps = fit_sequential_temperature_scaling(z, acc)
    assert temps.shape == (5,)
    assert temps[0] > 1.5 and np.all(temps > 1.0)  # over-confidence is undone (true T = 3)
    rep = calibration_report(z, acc, temps)
    for pos in rep["positions"]:
        assert pos["ece_after"] < pos["ece_before"]
        assert pos["ece_after"] < 0.05
        # a per-position monotone rescale keeps the ranking of the first position
    assert rep["positions"][0]["auc_after"] == pytest.approx(rep["positions"][0]["auc_before"])
    assert rep["pooled"]["ece_after"] < rep["pooled"]["ece_before"]
    assert len(rep["positions"][2]["reliability_after"]["counts"]) == 15
    assert sum(rep["positions"][2]["reliability_after"]["counts"]) == 4000


def test_sts_degenerate_and_bad_input():
    z = np.zeros((10, 2))  # sigmoid(0 / T) = 0.5 for every T: all grid points tie -> T = 1
    temps = fit_sequential_temperature_scaling(z, np.array([0, 1, 2, 2, 1, 0, 0, 2, 1, 2]))
    np.testing.assert_allclose(temps, [1.0, 1.0])
    z = np.full((10, 2), 20.0)  # saturated and always right: sharper (T < 1) is strictly better
    temps = fit_sequential_temperature_scaling(z, np.full(10, 2))
    assert np.all(temps < 1.0)
    with pytest.raises(ValueError, match="accepted_len"):
        fit_sequential_temperature_scaling(z, np.full(10, 3))
    with pytest.raises(ValueError, match="accepted_len"):
        fit_sequential_temperature_scaling(z, np.full(9, 1))
    with pytest.raises(ValueError, match="> 0"):
        fit_sequential_temperature_scaling(z, np.full(10, 1), grid=[0.0, 1.0])


def test_threshold_sweep_by_hand():
    surv = np.array([[0.9, 0.8, 0.3],
                     [0.6, 0.5, 0.4],
                     [0.95, 0.9, 0.85]])
    acc = np.array([3, 0, 2])
    np.testing.assert_array_equal(kept_lengths(surv, 0.7), [2, 0, 3])
    # non-monotone curve: the prefix stops at the first miss
    np.testing.assert_array_equal(kept_lengths(np.array([[0.9, 0.1, 0.9]]), 0.5), [1])
    rows = threshold_sweep(surv, acc, [0.0, 0.7, 1.0])
    # t = 0: keep 3,3,3; accepted 3,0,2
    assert rows[0]["drafts_kept"] == 3 and rows[0]["verified_tokens"] == 4
    assert rows[0]["accepted"] == pytest.approx(5 / 3)
    assert rows[0]["acceptance_per_verified"] == pytest.approx((4 + 1 + 3) / 12)
    # t = .7: keep 2,0,3 -> accepted min(3,2)=2, 0, min(2,3)=2
    assert rows[1]["drafts_kept"] == pytest.approx(5 / 3)
    assert rows[1]["verified_tokens"] == pytest.approx(8 / 3)
    assert rows[1]["accepted"] == pytest.approx(4 / 3)
    assert rows[1]["tokens_per_step"] == pytest.approx(7 / 3)
    assert rows[1]["acceptance_per_verified"] == pytest.approx(7 / 8)
    # t = 1: nothing kept; each step verifies the anchor only and emits one token
    assert rows[2]["verified_tokens"] == 1 and rows[2]["accepted"] == 0
    assert rows[2]["acceptance_per_verified"] == 1.0
