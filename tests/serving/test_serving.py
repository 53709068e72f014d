"""The project side of vLLM in the loop, without vLLM: comparison logic, load-audit verdicts, and the clear
errors when vLLM is missing (tests/serving/test_vllm_parity.py runs the real thing)."""
from __future__ import annotations

import sys

import pytest

from dspark.serving.audit import describe, judge
from dspark.serving.engine import VLLMUnavailable, VLLMWorker, vllm_python
from dspark.serving.parity import Request, VLLMRequest, al_z_score, classify, compare, request_order


def _req(conv, turn, tokens, steps, plain=None):
    return Request(conv, turn, [1, 2, 3], tokens, tokens if plain is None else plain, [a for a, _ in steps],
                   [d for _, d in steps])


def test_request_order_is_turn_major_like_eval():
    convs = [["a", "b"], ["c"], ["d", "e", "f"]]
    assert request_order(convs, True) == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (2, 2)]
    assert request_order(convs, False) == [(0, 0), (1, 0), (2, 0)]


def test_compare_identical_engines_is_parity_and_counts_like_vllm():
    reqs = [_req(0, 0, [5, 6, 7, 8], [(2, 3), (0, 3)]), _req(1, 0, [9, 9], [(1, 3)])]
    vl = [VLLMRequest([5, 6, 7, 8], "length", [2, 0], [3, 3]), VLLMRequest([9, 9], "stop", [1], [3])]
    engine = {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 3, "accepted_per_pos": [2, 1, 0]}
    rep = compare(reqs, vl, engine, 0.0)
    assert rep["parity"] and rep["steps_equal"] == "2/2" and rep["vllm_counters_consistent"]
    assert rep["eval"]["mean_acceptance_length"] == 2.0 == rep["vllm"]["mean_acceptance_length"]
    assert rep["eval"]["per_position_rate"] == [2 / 3, 1 / 3, 0.0]
    assert rep["outputs"] == {"vllm_equals_eval": "2/2", "eval_equals_plain": "2/2", "vllm_equals_plain": "2/2"}


def test_compare_flags_other_proposals_even_when_al_matches():
    # same tokens, same total acceptance, but step 0 / step 1 swapped: a draft proposing other tokens
    reqs = [_req(0, 0, [5, 6, 7, 8], [(2, 3), (0, 3)])]
    vl = [VLLMRequest([5, 6, 7, 8], "length", [0, 2], [3, 3])]
    rep = compare(reqs, vl, None, 0.0)
    assert rep["al_rel_diff"] == 0 and not rep["parity"]
    p = rep["per_request"][0]
    assert p["status"] == "proposals" and p["first_step_diff"] == 0 and not p["at_last_step"]
    assert any("proposes other tokens" in line for line in rep["explanation"])


def test_compare_reports_output_divergence_and_target_numerics():
    reqs = [_req(0, 0, [5, 6, 7], [(1, 2)])]
    vl = [VLLMRequest([5, 6, 9], "length", [1], [2], plain_token_ids=[5, 6, 9])]
    rep = compare(reqs, vl, None, 0.0)
    p = rep["per_request"][0]
    assert p["status"] == "output" and p["first_token_diff"] == 2 and p["target_numerics"]
    assert rep["outputs"]["vllm_plain_equals_plain"] == "0/1" and not rep["parity"]
    with pytest.raises(ValueError, match="1 eval.py requests but 0 vLLM outputs"):
        compare(reqs, [], None, 0.0)


def test_compare_at_t1_compares_rates_in_standard_errors():
    same = [_req(0, 0, [5, 6], [(1, 2), (0, 2), (2, 2), (1, 2)] * 5)]
    close = [VLLMRequest([7, 8], "length", [2, 0, 1, 1] * 5, [2] * 20)]  # same mean, other order and tokens
    rep = compare(same, close, None, 1.0)
    assert rep["parity"] and rep["al_z"] == 0.0 and "outputs" not in rep and rep["explanation"][0].startswith("T > 0")
    assert classify(same[0], close[0])["status"] == "output"
    far = [VLLMRequest([7, 8], "length", [0] * 40, [2] * 40)]  # never accepts: many standard errors away
    rep = compare(same, far, None, 1.0)
    assert not rep["parity"] and rep["al_z"] > 3
    assert al_z_score([1, 1], [1, 1]) == 0.0 and al_z_score([1], [0, 1]) is None
    assert abs(al_z_score([0, 2, 0, 2], [1, 1, 1, 1]) - 0.0) < 1e-12


def test_load_audit_verdicts(tmp_path):
    tensors = ["fc.weight", "hidden_norm.weight", "layers.0.self_attn.q_proj.weight"]
    ok = judge({"class": "DFlashQwen3ForCausalLM", "tensors": tensors, "skipped": [], "partial": {},
                "unloaded": ["model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding"]}, tmp_path)
    assert ok["ok"] and set(ok["expected_unloaded"]) == {"model.embed_tokens.weight", "lm_head.weight",
                                                          "model.mask_embedding"}
    assert "all 3 exported tensors loaded" in describe(ok)
    # an export that ships its own lm_head must have it loaded; a mask_embedding.pt must be read
    (tmp_path / "mask_embedding.pt").write_bytes(b"")
    bad = judge({"class": "X", "tensors": tensors + ["lm_head.weight"], "skipped": ["fc.bias", "t2d"],
                 "partial": {"model.layers.0.self_attn.qkv_proj.weight": 0.5},
                 "unloaded": ["model.hidden_norm.weight", "lm_head.weight", "model.mask_embedding"]}, tmp_path)
    assert not bad["ok"]
    assert bad["unloaded"] == ["model.hidden_norm.weight", "lm_head.weight", "model.mask_embedding"]
    text = describe(bad)
    # t2d is training-only (vLLM's dense loaders drop it): not a defect; any other skipped tensor is
    assert "hidden_norm" in text and "partly loaded" in text and "skipped: ['fc.bias']" in text


def test_missing_vllm_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(VLLMUnavailable, match=r"DSPARK_VLLM_PYTHON.*bash scripts/setup_vllm.sh"):
        vllm_python()
    # an interpreter without vllm (this one): the worker dies importing it, and the error says how to install
    with VLLMWorker(sys.executable, log_path=tmp_path / "w.log") as w:
        with pytest.raises(VLLMUnavailable, match="cannot import vllm: install it with `bash scripts/setup_vllm.sh`"):
            w.init(target=str(tmp_path), draft=None)


def test_serve_check_cli_without_vllm_is_one_line(tmp_path):
    import subprocess

    from conftest import REPO

    res = subprocess.run([sys.executable, "-m", "dspark.serve_check", f"run_dir={tmp_path}",
                          f"vllm_python={tmp_path / 'no' / 'python'}"], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().startswith("serve_check: error: vLLM interpreter") and "setup_vllm.sh" in res.stderr
