"""Compact feature-cache layouts (dspark.data.feature_cache.CacheLayout): the fp8 e4m3 encoding's round-trip error,
scales and zero rows; the row-dropping layouts keep exactly the rows a block objective reads (training on them is
bitwise the training on the full cache); an MTP objective is refused them.

fp8 e4m3 round-trip bound: e4m3 has 3 mantissa bits, so a value in the normal range (|code| >= 2^-6) is rounded to
the nearest of 8 steps per binade: relative error <= 2^-4 (half a step of 2^-3). Below 2^-6 the codes are subnormal
with a fixed spacing of 2^-9, so the absolute error is <= 2^-10 in code units, i.e. 2^-10 * scale. Per element:
    |decode(encode(x)) - x| <= 2^-4 |x| + 2^-10 scale  (+ float32 rounding of the scale product, far below).
"""
from __future__ import annotations

import datasets
import pytest
import torch

from conftest import TINY_RUN, compose
from dspark.data.feature_cache import CacheLayout, FeatureCache, build_feature_cache, decode_fp8_rows, \
    encode_fp8_rows, last_anchor, teacher_positions
from dspark.factory import ConfigError
from dspark.targets.hf_target import FrozenTarget


def _bound(x, scale, groups):
    S, D = x.shape
    per_elem_scale = scale[..., None].expand(S, groups, D // groups).reshape(S, D)
    return 2.0 ** -4 * x.abs() + 2.0 ** -10 * per_elem_scale


def test_fp8_round_trip_within_the_e4m3_bound_and_not_better_than_3_bits():
    g = torch.Generator().manual_seed(0)
    # rows of very different magnitudes (1e-4 .. 1e4), heavy tails, per layer (4 groups of 16) another scale
    x = torch.randn(64, 64, generator=g) * torch.logspace(-4, 4, 64)[:, None]
    x = x * torch.tensor([1.0, 30.0, 0.01, 5.0]).repeat_interleave(16)[None, :]
    x[:, 3] *= 50  # an outlier column
    q, scale = encode_fp8_rows(x, groups=4)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 4) and scale.dtype == torch.float32
    y = decode_fp8_rows(q, scale)
    err = (y - x).abs()
    assert bool((err <= _bound(x, scale, 4) * (1 + 1e-6)).all()), (err / _bound(x, scale, 4)).max()
    # the bound is tight: 3 mantissa bits really are lost (a bf16 / fp16 encoding would be ~10x better)
    normal = (x.abs() / scale.repeat_interleave(16, dim=1)) >= 2.0 ** -6
    assert (err[normal] / x.abs()[normal]).max() > 2.0 ** -5
    # each group's largest magnitude is mapped onto 448 and comes back to within float32 rounding
    amax = x.reshape(64, 4, 16).abs().amax(-1)
    torch.testing.assert_close(y.reshape(64, 4, 16).abs().amax(-1), amax, rtol=1e-6, atol=0)


def test_per_layer_scales_keep_a_small_layer_next_to_a_large_one():
    x = torch.cat([torch.full((2, 8), 1e-3), torch.full((2, 8), 1e3)], dim=1)
    x[:, ::3] *= -1.7
    y = decode_fp8_rows(*encode_fp8_rows(x, groups=2))
    assert ((y - x).abs() <= 2.0 ** -4 * x.abs()).all()
    # one scale for the whole row: the small layer falls below e4m3's smallest subnormal and is lost
    y1 = decode_fp8_rows(*encode_fp8_rows(x, groups=1))
    assert (y1[:, :8] == 0).all()


def test_zero_rows_and_extremes_decode_without_nan():
    x = torch.zeros(4, 12)
    x[1, 5] = 3.0  # one nonzero element
    x[2] = torch.tensor([1e30, -1e30, 1e-30] * 4)  # fp32 extremes
    x[3, :6] = 0.0
    x[3, 6:] = -2.5  # second group only
    q, scale = encode_fp8_rows(x, groups=2)
    assert scale[0].tolist() == [0.0, 0.0] and scale[3, 0] == 0.0
    y = decode_fp8_rows(q, scale)
    assert torch.isfinite(y).all()
    assert torch.equal(y[0], x[0]) and torch.equal(y[3], x[3]) and y[1, 5] == 3.0
    assert ((y[2] - x[2]).abs() <= _bound(x, scale, 2)[2] * (1 + 1e-6)).all()


def test_layout_values_are_checked():
    with pytest.raises(ValueError, match="encoding='fp4'"):
        CacheLayout(encoding="fp4")
    with pytest.raises(ValueError, match=r"unknown keys \['rows'\]"):
        CacheLayout.from_dict({"rows": "all"})


def _tiny_llama_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1)
    return FrozenTarget(LlamaForCausalLM(cfg).eval(), [0, 2])


def test_row_dropping_layout_keeps_exactly_the_rows_blocks_read(tmp_path):
    target = _tiny_llama_target()
    g = torch.Generator().manual_seed(3)
    lengths = [12, 9, 15, 6]
    masks = [[0] * 4 + [1] * 5 + [0] * 3, [0] * 3 + [1] * 6, [0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0], [0] * 6]
    rows = datasets.Dataset.from_dict({"input_ids": [torch.randint(2, 50, (n,), generator=g).tolist() for n in lengths],
                                       "loss_mask": masks})
    full = FeatureCache(build_feature_cache(target, rows, tmp_path / "full", dtype=torch.float32, shard_size=3))
    lay = CacheLayout(teacher_rows="assistant", context_rows="anchored")
    small = FeatureCache(build_feature_cache(target, rows, tmp_path / "small", dtype=torch.float32, shard_size=3,
                                             layout=lay))
    assert small.meta["format"] == 3 and small.meta["layout"] == lay.as_dict() and small.nbytes < full.nbytes
    assert small.meta["key"] != full.meta["key"]  # another layout is another cache
    for i, lm in enumerate(masks):
        (a0, f0), (a1, f1) = full.get(i), small.get(i)
        assert a1.shape == a0.shape and f1.shape == f0.shape
        n_ctx = last_anchor(torch.tensor(lm))
        teach = set(teacher_positions(torch.tensor(lm)).tolist())
        assert teach == {p for p in range(len(lm) - 1) if lm[p + 1]}
        for p in range(len(lm)):
            assert torch.equal(a1[p], a0[p] if p < n_ctx else torch.zeros_like(a0[p])), (i, p)
            assert torch.equal(f1[p], f0[p] if p in teach else torch.zeros_like(f0[p])), (i, p)
    assert last_anchor(torch.tensor(masks[0])) == 7 and last_anchor(torch.tensor(masks[3])) == 0
    # the same rows in fp8 (example 3 keeps no row at all): decoded within the e4m3 bound of the kept rows
    lay8 = CacheLayout(encoding="fp8_e4m3", teacher_rows="assistant", context_rows="anchored")
    small8 = FeatureCache(build_feature_cache(target, rows, tmp_path / "small8", dtype=torch.float32, shard_size=3,
                                              layout=lay8))
    for i in range(len(masks)):
        (a1, f1), (a8, f8) = small.get(i), small8.get(i)
        assert bool((a8[a1 == 0] == 0).all()) and bool((f8[f1 == 0] == 0).all())  # dropped rows stay zero
        # every row's scale is <= the tensor's amax / 448, so this bound holds row by row
        for x8, x in ((a8, a1), (f8, f1)):
            assert bool(((x8 - x).abs() <= 2.0 ** -4 * x.abs() + 2.0 ** -10 * x.abs().amax() / 448 + 1e-12).all())
    assert small8.get(3)[0].abs().sum() == 0 and small8.get(3)[1].abs().sum() == 0
    # reusing the folder with another layout is refused naming it
    with pytest.raises(ValueError, match="another layout"):
        build_feature_cache(target, rows, tmp_path / "small", dtype=torch.float32, shard_size=3)


def test_training_on_row_dropped_cache_is_bitwise_the_full_cache_and_fp8_is_close(tmp_path):
    from test_train_e2e import train_losses

    from dspark.training.run import run_training

    common = TINY_RUN + ["trainer.max_steps=4", "trainer.val_check_interval=4", "data.feature_cache=auto",
                         "data.feature_cache_dtype=float32"]
    runs = {
        "full": [],
        "rows": ["data.feature_cache_layout.teacher_rows=assistant", "data.feature_cache_layout.context_rows=anchored"],
        "fp8": ["data.feature_cache_layout.encoding=fp8_e4m3"],
    }
    out = {}
    for name, extra in runs.items():
        s = run_training(compose(common + extra + [f"run_dir={tmp_path / name}"]))
        out[name] = (train_losses(tmp_path / name), s["final"])
    (full, vf), (rows, vr), (fp8, v8) = out["full"], out["rows"], out["fp8"]
    assert sorted(full) == sorted(rows) == sorted(fp8) == [0, 1, 2, 3]
    assert rows == full and vr == vf  # bitwise: the dropped rows are never read
    rel = max(abs(fp8[s] - full[s]) / abs(full[s]) for s in full)
    assert 0 < rel < 2e-2, rel  # fp8 changes the numbers (it is an encoding), a little
    assert v8["val/tau_prob"] == pytest.approx(vf["val/tau_prob"], rel=2e-2)


def test_mtp_objective_refuses_row_dropping_layouts():
    from dspark.preflight import check_data
    from dspark.schema import run_config

    cfg = compose(["experiment=hyv4_mtp", "data.feature_cache=auto", "data.feature_cache_layout.teacher_rows=assistant"])
    with pytest.raises(ConfigError, match=r"data\.feature_cache_layout: .*'mtp' objective"):
        check_data(run_config(cfg))
    check_data(run_config(compose(["experiment=hyv4_mtp", "data.feature_cache=auto",
                                   "data.feature_cache_layout.encoding=fp8_e4m3"])))  # an encoding drops no row


def test_converting_a_float32_cache_equals_building_the_layout(tmp_path):
    from safetensors.torch import load_file

    from dspark.data.feature_cache import convert_feature_cache, shard_name

    target = _tiny_llama_target()
    g = torch.Generator().manual_seed(4)
    lengths = [7, 11, 5]
    rows = datasets.Dataset.from_dict({"input_ids": [torch.randint(2, 50, (n,), generator=g).tolist() for n in lengths],
                                       "loss_mask": [[0] * 2 + [1] * (n - 2) for n in lengths]})
    src = build_feature_cache(target, rows, tmp_path / "f32", dtype=torch.float32, shard_size=2)
    for name, layout, dtype in (("bf16", CacheLayout(), torch.bfloat16),
                                ("fp8rows", CacheLayout(encoding="fp8_e4m3", teacher_rows="assistant"), torch.bfloat16)):
        built = build_feature_cache(target, rows, tmp_path / f"built_{name}", dtype=dtype, shard_size=2, layout=layout)
        conv = convert_feature_cache(src, rows, tmp_path / f"conv_{name}", layout=layout, dtype=dtype)
        a, b = FeatureCache(built), FeatureCache(conv)
        assert a.meta["key"] == b.meta["key"] and b.meta["producer"] == "hf+convert"
        for k in range(a.meta["num_shards"]):
            x, y = load_file(built / shard_name(k)), load_file(conv / shard_name(k))
            assert x.keys() == y.keys() and all(torch.equal(x[n].view(torch.uint8) if x[n].dtype == torch.float8_e4m3fn
                                                            else x[n], y[n].view(torch.uint8) if y[n].dtype ==
                                                            torch.float8_e4m3fn else y[n]) for n in x), (name, k)
