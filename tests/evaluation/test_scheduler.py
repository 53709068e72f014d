"""Hardware-aware prefix scheduler (paper Alg. 1): brute-force optimality, fixed length, SPS tables."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from dspark.evaluation.scheduler import (
    SPSTable,
    best_fixed_length,
    evaluate_lengths,
    fixed_length_objective,
    profile_sps,
    schedule_prefix,
    simulate,
)


def _random_survival(rng, r, g):
    c = rng.uniform(0.05, 1.0, size=(r, g))
    return np.cumprod(c, axis=1)  # [R, g] non-increasing rows


def _brute_force(a, sps):
    r, g = a.shape
    best = max(
        (evaluate_lengths(a, ls, sps) for ls in itertools.product(range(g + 1), repeat=r)),
        key=lambda s: s.objective,
    )
    return best


SPS_CURVES = {
    "linear": lambda b: 100.0 - 4.0 * b,  # B <= 12 here, stays > 0
    "inverse": lambda b: 1000.0 / (5.0 + b),
    "steep": lambda b: 1000.0 / (1.0 + b) ** 1.5,
    "flat_then_drop": SPSTable([1, 6, 8, 12], [50.0, 50.0, 20.0, 10.0]),
    "step": lambda b: 10.0 if b <= 7 else 6.0,
}


@pytest.mark.parametrize("name", sorted(SPS_CURVES))
def test_greedy_matches_brute_force(name):
    sps = SPS_CURVES[name]
    rng = np.random.default_rng(sorted(SPS_CURVES).index(name))  # str hash() is salted per process
    for _ in range(30):
        a = _random_survival(rng, 3, 3)
        want = _brute_force(a, sps)
        got = schedule_prefix(a, sps)  # patience None: full scan
        assert got.objective == pytest.approx(want.objective, rel=1e-12)
        assert got.batch == int((1 + got.lengths).sum())
        assert got.tau == pytest.approx(3 + sum(a[r, : got.lengths[r]].sum() for r in range(3)))
        big = schedule_prefix(a, sps, patience=9)  # patience >= R*g is a full scan
        assert big.objective == pytest.approx(want.objective, rel=1e-12)


def test_prefix_constraint_and_order():
    a = np.array([[0.9, 0.85, 0.1],
                  [0.5, 0.45, 0.4]])
    # free throughput up to B = 5 tokens, then nothing: exactly 3 drafts fit; best three prefix-feasible
    # picks are (0,0) .9, (0,1) .85, (1,0) .5
    sps = SPSTable([1, 5, 6], [1.0, 1.0, 1e-6])
    s = schedule_prefix(a, sps)
    assert s.lengths.tolist() == [2, 1] and s.batch == 5
    assert s.tau == pytest.approx(2 + 0.9 + 0.85 + 0.5)
    # constant SPS: verify everything
    s = schedule_prefix(a, lambda b: 1.0)
    assert s.lengths.tolist() == [3, 3] and s.admissions == 6
    # max_batch caps B
    s = schedule_prefix(a, lambda b: 1.0, max_batch=4)
    assert s.batch == 4 and s.lengths.tolist() == [2, 0]


def test_early_stop_can_miss_the_optimum():
    # SPS drops at B = 2 then is flat: objective 1.0 (B=1), 0.95 (B=2), 1.4 (B=3), 1.85 (B=4)
    a = np.array([[0.9, 0.9, 0.9]])
    sps = SPSTable([1, 2, 4], [1.0, 0.5, 0.5])
    short = schedule_prefix(a, sps, patience=1)
    assert short.lengths.tolist() == [0] and short.objective == pytest.approx(1.0)
    assert short.admissions == 1
    full = schedule_prefix(a, sps, patience=3)
    assert full.lengths.tolist() == [3] and full.objective == pytest.approx(3.7 * 0.5)


def test_fixed_length_by_hand():
    a = torch.tensor([[0.8, 0.4, 0.2],
                      [0.6, 0.3, 0.0]])
    sps = lambda b: 12.0 / b  # noqa: E731
    s = fixed_length_objective(a, 2, sps)
    assert s.batch == 6 and s.lengths.tolist() == [2, 2]
    assert s.tau == pytest.approx(1 + 0.8 + 0.4 + 1 + 0.6 + 0.3)
    assert s.sps == pytest.approx(2.0) and s.objective == pytest.approx(4.1 * 2.0)
    s0 = fixed_length_objective(a, 0, sps)
    assert s0.batch == 2 and s0.tau == 2 and s0.objective == pytest.approx(12.0)
    # 12 / B makes tau / B decide: L = 0 (tau / B = 1) wins
    assert best_fixed_length(a, sps).lengths.tolist() == [0, 0]
    sps2 = lambda b: 20.0 - b  # noqa: E731
    # objectives L=0..3: 2*18=36, 3.4*16=54.4, 4.1*14=57.4, 4.3*12=51.6
    best = best_fixed_length(a, sps2)
    assert best.lengths.tolist() == [2, 2] and best.objective == pytest.approx(57.4)
    with pytest.raises(ValueError):
        fixed_length_objective(a, 4, sps)
    # greedy order .8, .6, .4, .3, .2 (B = 2 is L=0 above):
    # B=3 2.8*17=47.6, B=4 3.4*16=54.4, B=5 3.8*15=57, B=6 4.1*14=57.4, B=7 4.3*13=55.9
    sched = schedule_prefix(a, sps2)
    assert sched.lengths.tolist() == [2, 2] and sched.objective == pytest.approx(57.4)


def test_sps_table_interpolation(tmp_path):
    t = SPSTable([1, 4, 8], [100.0, 70.0, 30.0])
    assert t(1) == 100.0 and t(4) == 70.0
    assert t(2) == pytest.approx(90.0)
    assert t(6) == pytest.approx(50.0)
    assert t(0.5) == 100.0 and t(100) == 30.0  # held, not extrapolated
    p = tmp_path / "sps.json"
    t.save(p)
    assert json.loads(p.read_text()) == {"batch_sizes": [1.0, 4.0, 8.0], "sps": [100.0, 70.0, 30.0]}
    assert SPSTable.load(p)(6) == pytest.approx(50.0)
    s = schedule_prefix(np.array([[0.9]]), t.to_dict())  # dict accepted too
    assert s.lengths.tolist() == [1]  # 1.9 * 90 > 1 * 100
    with pytest.raises(ValueError, match="increasing"):
        SPSTable([1, 1], [1.0, 2.0])
    with pytest.raises(ValueError, match="> 0"):
        SPSTable([1, 2], [1.0, 0.0])
    with pytest.raises(ValueError, match="equal-length"):
        SPSTable([1, 2], [1.0])


def test_bad_input():
    with pytest.raises(ValueError, match=r"\[R, g\]"):
        schedule_prefix(np.array([0.5, 0.4]), lambda b: 1.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        schedule_prefix(np.array([[1.5]]), lambda b: 1.0)
    with pytest.raises(ValueError, match="patience"):
        schedule_prefix(np.array([[0.5]]), lambda b: 1.0, patience=0)
    with pytest.raises(ValueError, match="SPS"):
        schedule_prefix(np.array([[0.5]]), lambda b: -1.0)
    with pytest.raises(ValueError, match="lengths"):
        evaluate_lengths(np.array([[0.5]]), [2], lambda b: 1.0)


def test_profile_sps_and_simulate():
    calls = []
    t = profile_sps(lambda b: calls.append(b), [4, 1, 2], warmup=1, repeats=2)
    assert t.batch_sizes.tolist() == [1.0, 2.0, 4.0] and np.all(t.sps > 0)
    assert calls == [1, 1, 1, 2, 2, 2, 4, 4, 4]
    rng = np.random.default_rng(3)
    steps = [_random_survival(rng, 4, 5) for _ in range(6)]
    sps = lambda b: 1000.0 / (8.0 + b)  # noqa: E731
    out = simulate(steps, sps)
    assert set(out["fixed"]) == set(range(6))
    assert out["speedup_vs_best_fixed"] >= 1.0 - 1e-12
    # per step tau * SPS is maximised, so time-weighted tokens/s also beats every fixed length
    for row in out["fixed"].values():
        assert out["scheduler"]["tokens_per_s"] >= row["tokens_per_s"] - 1e-9
