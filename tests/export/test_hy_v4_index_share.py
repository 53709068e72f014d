"""HY V4 MTP and two vLLM 0.33.0 settings that change what it serves: `index_share_for_mtp_iteration` (chain steps
>= 1 reuse step 0's indexer top-k; dspark re-runs the indexer every step, so the merge refuses the key and the
verifier flags it) and `enable_lm_head_fp32` (the head in float32 by default: dspark.ops.lm_head, for the draft's
logits and the target's)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import compose, reseal
from transformers import HYV4Config, LlamaConfig

from dspark.ops.lm_head import lm_head_logits, vllm_head_fp32


@pytest.fixture(scope="module")
def hy_run():
    from dspark import factory

    cfg = compose(["experiment=hyv4_mtp"])
    target = factory.build_target(cfg.target, cfg.draft)
    return target, factory.build_draft(cfg.draft, target)


# ---- index_share_for_mtp_iteration ---------------------------------------------------------------------
def test_merge_refuses_index_share_and_verify_flags_it(hy_run, tmp_path):
    from dspark.export.hy_v4_mtp import INDEX_SHARE_KEY
    from dspark.export.mtp import merge_mtp_into_target
    from dspark.export.verify import verify_folder
    from dspark.targets.tiny_hy_v4 import TINY_HY_V4_DIR

    target, draft = hy_run
    assert draft.config.use_indexer  # the tiny HY V4 target's MTP layer is indexed (layer_types padded)
    shared = tmp_path / "shared"
    shutil.copytree(TINY_HY_V4_DIR, shared)
    config = json.loads((shared / "config.json").read_text())
    (shared / "config.json").write_text(json.dumps({**config, INDEX_SHARE_KEY: True}))
    with pytest.raises(ValueError, match=r"merge: index_share_for_mtp_iteration: true with an indexed"):
        merge_mtp_into_target(draft, shared, tmp_path / "refused", dtype=torch.float32)
    assert not (tmp_path / "refused").exists()
    # false (or absent) merges; the verifier notes how to serve it
    (shared / "config.json").write_text(json.dumps({**config, INDEX_SHARE_KEY: False}))
    out = merge_mtp_into_target(draft, shared, tmp_path / "merged", dtype=torch.float32)
    report = verify_folder(out)
    assert not report.problems
    assert any(INDEX_SHARE_KEY in n for n in report.notes)
    # a merged folder whose config.json turns it on (hand-edited) is a serving problem naming the key
    merged = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**merged, INDEX_SHARE_KEY: True}))
    reseal(out)
    problems = verify_folder(out).problems
    assert len(problems) == 1 and problems[0].startswith(f"serving: {INDEX_SHARE_KEY}: true")


def test_index_share_without_an_indexer_is_not_refused():
    from dspark.export.hy_v4_mtp import index_share_problem

    assert index_share_problem({"index_share_for_mtp_iteration": True}, sparse=False) is None
    assert index_share_problem({"index_share_for_mtp_iteration": False}, sparse=True) is None
    assert index_share_problem({}, sparse=True) is None
    assert "index_share_for_mtp_iteration" in index_share_problem({"index_share_for_mtp_iteration": True}, sparse=True)


# ---- enable_lm_head_fp32 -----------------------------------------------------------------------------
def test_head_dtype_rule_follows_vllm():
    assert vllm_head_fp32(HYV4Config()) is True  # HYV4Config enable_lm_head_fp32 defaults to True (hy_v4.py:120)
    assert vllm_head_fp32(HYV4Config(enable_lm_head_fp32=False)) is False
    assert vllm_head_fp32(HYV4Config(head_dtype="model")) is False  # a pinned head_dtype wins (hy_v4.py:167)
    assert vllm_head_fp32(LlamaConfig()) is False  # generation models: the model dtype (config/model.py:2535-2540)
    assert vllm_head_fp32(LlamaConfig(head_dtype="float32")) is True


def _bf16_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(50, 16, generator=g) * 0.5).bfloat16()
    h = torch.randn(3, 16, generator=g).bfloat16()
    return h, w, F.linear(h.float(), w.float())  # the float32 reference: bf16 operands, float32 products / sums


def test_lm_head_logits_fp32_is_the_float32_product_not_the_bf16_one():
    h, w, ref = _bf16_case()
    fp32 = lm_head_logits(h, w, True)
    assert fp32.dtype == torch.float32
    torch.testing.assert_close(fp32, ref, rtol=0, atol=1e-5)  # same products, float32 sums in another order
    bf16 = lm_head_logits(h, w, False)
    assert bf16.dtype == torch.bfloat16
    assert (bf16.float() - ref).abs().max() > 1e-3  # bf16 output rounding (8 bits of mantissa): the test can fail


def test_hy_draft_and_target_logits_in_fp32(hy_run):
    import copy

    from dspark.targets.hf_target import FrozenTarget

    target, draft = hy_run
    assert draft.config.lm_head_fp32 and target.head_fp32
    t16 = FrozenTarget(copy.deepcopy(target.model).bfloat16(), target.layer_ids, require_aux=False)
    assert t16.lm_head_weight.dtype == torch.bfloat16 and t16.head_fp32
    h = torch.randn(2, 5, t16.hidden_size).bfloat16()
    w = t16.lm_head_weight
    ref = F.linear(h.float(), w.float())
    got = t16.logits_from_final(h)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    d16 = copy.deepcopy(draft)
    d16.share_target_weights(t16.embed_weight, t16.lm_head_weight)
    out = d16.logits(h, 0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
    d16.config.lm_head_fp32 = False  # a target config with enable_lm_head_fp32: false -> the model dtype
    assert d16.logits(h, 0).dtype == torch.bfloat16
