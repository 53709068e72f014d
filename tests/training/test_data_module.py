"""Resumable batch order, deterministic anchors, padding collate, LR schedule."""
import math

import pytest
import torch

from dspark.training.data_module import AnchoredExamples, ResumableBatchSampler, collate
from dspark.training.module import warmup_cosine


def test_sampler_covers_each_pass_once_and_resumes_exactly():
    s = ResumableBatchSampler(num_examples=10, batch_size=3, total_batches=7, seed=1)
    full = list(s)
    assert len(full) == 7 and len(s) == 7
    first_pass = [i for b in full[:3] for (p, i) in b]
    assert all(p == 0 for b in full[:3] for (p, _) in b)
    assert len(set(first_pass)) == 9  # 3 batches x 3, no repeats, last example dropped
    assert full[3][0][0] == 1  # second pass starts at batch 3 with a new permutation
    r = ResumableBatchSampler(10, 3, 7, seed=1)
    r.start = 4
    assert list(r) == full[4:]
    assert list(r) == full  # start applies to one iteration only


def test_sampler_ranks_split_the_global_batch():
    one = list(ResumableBatchSampler(12, 4, 3, seed=0))
    r0 = list(ResumableBatchSampler(12, 2, 3, seed=0, rank=0, world_size=2))
    r1 = list(ResumableBatchSampler(12, 2, 3, seed=0, rank=1, world_size=2))
    for b, x, y in zip(one, r0, r1):
        assert b == x + y


def _padded_tokens(batches, lengths) -> int:
    return sum(len(b) * max(int(lengths[i]) for _, i in b) for b in batches)


def test_length_grouped_batches_cover_each_pass_pad_less_and_resume_exactly():
    n, bs = 200, 4
    lengths = torch.randint(10, 500, (n,), generator=torch.Generator().manual_seed(0))
    steps = 3 * (n // bs)  # three passes
    grouped = list(ResumableBatchSampler(n, bs, steps, seed=5, lengths=lengths))
    plain = list(ResumableBatchSampler(n, bs, steps, seed=5))
    per_pass = n // bs
    for p in range(3):
        ids = sorted(i for b in grouped[p * per_pass:(p + 1) * per_pass] for (q, i) in b if q == p)
        assert ids == list(range(n))  # every example once per pass
    assert _padded_tokens(grouped, lengths) < 0.8 * _padded_tokens(plain, lengths)
    assert grouped[:per_pass] != grouped[per_pass:2 * per_pass]  # passes differ
    r = ResumableBatchSampler(n, bs, steps, seed=5, lengths=lengths)
    r.start = 57
    assert list(r) == grouped[57:]
    # ranks still split each global batch
    r0 = list(ResumableBatchSampler(n, bs // 2, steps, seed=5, rank=0, world_size=2, lengths=lengths))
    r1 = list(ResumableBatchSampler(n, bs // 2, steps, seed=5, rank=1, world_size=2, lengths=lengths))
    assert all(b == x + y for b, x, y in zip(grouped, r0, r1))
    with pytest.raises(ValueError, match="lengths must be"):
        ResumableBatchSampler(n, bs, steps, seed=5, lengths=lengths[:-1])


def test_sampler_rejects_too_little_data():
    with pytest.raises(ValueError, match="batch_size"):
        ResumableBatchSampler(3, 4, 10, seed=0)


def test_anchors_deterministic_per_pass_and_index():
    rows = [{"input_ids": list(range(20)), "loss_mask": [0] * 4 + [1] * 16}]
    ds = AnchoredExamples(rows, num_anchors=4, seed=0)
    a = ds[(0, 0)]["anchors"]
    assert torch.equal(a, ds[(0, 0)]["anchors"])
    assert any(not torch.equal(a, ds[(p, 0)]["anchors"]) for p in range(1, 5))
    assert (a >= 4).all() and (a <= 18).all()


def test_collate_pads_right():
    items = [
        {"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([0, 1, 1]),
         "anchors": torch.tensor([1]), "keep": torch.tensor([True])},
        {"input_ids": torch.tensor([8]), "loss_mask": torch.tensor([1]),
         "anchors": torch.tensor([0]), "keep": torch.tensor([False])},
    ]
    b = collate(items, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]


def test_warmup_cosine_schedule():
    vals = [warmup_cosine(s, 100, 0.1, 0.0) for s in range(101)]
    assert vals[0] == pytest.approx(0.1) and vals[9] == pytest.approx(1.0)
    assert vals[10] == pytest.approx(1.0)
    assert vals[55] == pytest.approx(0.5 * (1 + math.cos(math.pi * 45 / 90)))
    assert vals[100] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(vals[10:], vals[11:]))
