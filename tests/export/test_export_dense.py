"""Dense exports: speculators-format round trip, reduced vocabulary (d2t / t2d) from token counts, the
verifier on both, and the `dense` CLI on a run against a tiny HF target."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FP32_CROSS_SHAPE_ATOL, assert_same_argmax, reseal

from dspark.export.dense import dense_config_from_folder, export_dense, import_dense, read_dense_config
from dspark.export.verify import verify_folder
from dspark.export.vocab import build_vocab_mapping, count_tokens, count_tokens_jsonl, reduce_dense_vocab
from dspark.models.block_draft import propose
from dspark.models.dspark_dense import DSparkDenseDraft
from test_export import _cli, _dense_cfg, _dense_draft, _logits, _randomise


# ---- speculators format ------------------------------------------------------------------------------
@pytest.mark.parametrize("markov_rank", [6, 0])
def test_speculators_round_trip(tmp_path, markov_rank):
    src = _dense_draft(markov_rank, seed=1)
    out = export_dense(src, tmp_path / "spec", dtype=torch.float32, fmt="speculators", verifier="/models/target")
    c = json.loads((out / "config.json").read_text())
    algo = "dspark" if markov_rank else "dflash"
    assert c["speculators_model_type"] == c["speculators_config"]["algorithm"] == algo
    assert c["aux_hidden_state_layer_ids"] == [1, 2]  # target_layer_ids [0, 1] + 1 (vLLM maps back with - 1)
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert c["speculators_config"]["verifier"]["name_or_path"] == "/models/target"
    assert c["transformer_layer_config"]["num_hidden_layers"] == 2 and c["mask_token_id"] == 49
    assert c["sample_from_anchor"] is bool(markov_rank)
    if markov_rank:
        assert c["markov_rank"] == 6 and c["enable_confidence_head"] and c["confidence_head_with_markov"]
    # what vLLM's update_dspark / update_dflash derive from it
    v = read_dense_config(out)
    assert v["dflash_config"]["target_layer_ids"] == [0, 1]
    assert v["architectures"] == ["Qwen3DSparkModel" if markov_rank else "DFlashDraftModel"]
    cfg = dense_config_from_folder(out)
    assert cfg == src.config and cfg.layout == ("anchor" if markov_rank else "mask")
    dst = _dense_draft(markov_rank, seed=2)
    assert not torch.equal(_logits(src), _logits(dst))
    import_dense(out, dst)
    assert torch.equal(_logits(src), _logits(dst))
    assert verify_folder(out).ok, verify_folder(out).problems


def test_verifier_on_speculators_configs(tmp_path):
    out = export_dense(_dense_draft(6), tmp_path / "spec", fmt="speculators")
    c = json.loads((out / "config.json").read_text())
    c["aux_hidden_state_layer_ids"] = [1, 2, 3]  # fc would be [H, 3H]: the stored [H, 2H] no longer fits
    (out / "config.json").write_text(json.dumps(c))
    reseal(out)  # hand-edited: only the layout checks should object
    assert verify_folder(out).problems == ["shape: fc.weight is [32, 64], expected [32, 96]"]
    del c["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    (out / "config.json").write_text(json.dumps(c))
    reseal(out)  # hand-edited: only the layout checks should object
    assert "speculative_tokens" in verify_folder(out).problems[0]


def test_vllm_confidence_head_defaults_are_checked(tmp_path):
    out = export_dense(_dense_draft(6), tmp_path / "d")
    c = json.loads((out / "config.json").read_text())
    c["confidence_head_with_markov"] = False  # vLLM would build Linear(H -> 1) and fail on [1, H + r]
    (out / "config.json").write_text(json.dumps(c))
    reseal(out)  # hand-edited: only the layout checks should object
    assert verify_folder(out).problems == ["shape: confidence_head.proj.weight is [1, 38], expected [1, 32]"]
    del c["enable_confidence_head"]  # vLLM's default is off: the stored head would be dropped silently
    (out / "config.json").write_text(json.dumps(c))
    reseal(out)  # hand-edited: only the layout checks should object
    assert sorted(verify_folder(out).problems) == [
        "unexpected: confidence_head.proj.bias [1] BF16 (no draft parameter)",
        "unexpected: confidence_head.proj.weight [1, 38] BF16 (no draft parameter)"]


def test_dflash_with_anchor_layout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="only runs with the 1\\+N 'mask' layout"):
        export_dense(DSparkDenseDraft(replace(_dense_cfg(0), layout="anchor")), tmp_path / "d")


# ---- reduced vocabulary --------------------------------------------------------------------------------
def test_vocab_mapping_matches_a_naive_ranking():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 7, 3, 9, 2])
    d2t, t2d = build_vocab_mapping(counts, 5)
    # naive: sort ids by (-count, id), take 5, sort ascending
    kept = sorted(sorted(range(10), key=lambda i: (-int(counts[i]), i))[:5])
    assert kept == [0, 2, 3, 6, 8]
    assert (torch.arange(5) + d2t).tolist() == kept and t2d.nonzero().flatten().tolist() == kept
    d2t, t2d = build_vocab_mapping(counts, 5, always=[5])
    assert (torch.arange(5) + d2t).tolist() == [2, 3, 5, 6, 8]  # 5 forced, then the 4 most frequent
    with pytest.raises(ValueError, match="draft_vocab_size must be in"):
        build_vocab_mapping(counts, 11)


def test_count_tokens_uses_the_loss_mask(tmp_path):
    rows = [{"input_ids": [1, 2, 2, 3], "loss_mask": [0, 1, 1, 0]}, {"input_ids": [4, 4]}]
    assert count_tokens(rows, 6).tolist() == [0, 0, 2, 0, 2, 0]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert count_tokens_jsonl(path, 6).tolist() == [0, 0, 2, 0, 2, 0]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        count_tokens([{"input_ids": [6]}], 6)
    with pytest.raises(ValueError, match="needs|tokenizer is needed"):
        count_tokens([{"messages": [{"role": "user", "content": "x"}]}], 6)


def _reduced(seed: int = 1):
    full = _dense_draft(6, seed=seed).eval()
    counts = torch.arange(50) % 7  # deterministic, ties broken by id
    d2t, t2d = build_vocab_mapping(counts, 20)
    return full, reduce_dense_vocab(full, d2t, t2d), t2d


def test_reduced_draft_logits_are_the_full_draft_at_kept_ids():
    full, small, t2d = _reduced()
    a, b = _logits(full), _logits(small)
    # the reduced head multiplies by a [20, H] matrix, the full one by [50, H]: float32 rounding may differ
    torch.testing.assert_close(b[..., t2d], a[..., t2d], rtol=1e-5, atol=FP32_CROSS_SHAPE_ATOL)
    assert torch.isneginf(b[..., ~t2d]).all()
    prev, h = torch.tensor([[[3, 7]]]), torch.randn(1, 1, 2, 32)
    bias_full, _ = full.markov_head(prev, h)
    bias_small, _ = small.markov_head(prev, h)
    torch.testing.assert_close(bias_small[..., t2d], bias_full[..., t2d], rtol=1e-5, atol=FP32_CROSS_SHAPE_ATOL)
    assert (bias_small[..., ~t2d] == 0).all()
    # and a real difference is caught: the kept rows shifted by one id
    shifted = torch.roll(t2d.nonzero().squeeze(-1), 1)
    assert not torch.allclose(bias_small[..., t2d], bias_full[..., shifted], atol=FP32_CROSS_SHAPE_ATOL)


def test_reduced_propose_drafts_only_kept_target_ids():
    full, small, t2d = _reduced()
    aux = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(3))
    kw = dict(num_drafts=3)
    assert full.config.mask_token_id == small.config.mask_token_id == 49 and full.config.layout == "anchor"
    p_full, p_small = propose(full, aux, 5, 6, **kw), propose(small, aux, 5, 6, **kw)
    assert t2d[p_small.tokens].all()  # target ids, all inside the draft vocabulary
    # at T=0 the reduced draft picks the argmax of the full draft's logits restricted to kept ids
    forced = propose(full, aux, 5, 6, forced_tokens=p_small.tokens, **kw)
    masked = forced.logits.masked_fill(~t2d, float("-inf"))
    assert_same_argmax(p_small.tokens, masked.argmax(-1), masked)
    assert p_small.q_probs[:, ~t2d].sum() == 0
    assert p_full.tokens.shape == p_small.tokens.shape


def test_a_reduced_draft_scores_alike_in_training_mode():
    """Reduced drafts train now (draft.draft_vocab_size; tests/training/test_draft_vocab_training.py): in training mode the
    draft's logits are the eval-mode ones (it was refused before), -inf outside its ids."""
    _, small, t2d = _reduced()
    small.eval()
    ref = _logits(small)
    small.train()
    got = _logits(small)
    assert torch.equal(got, ref) and torch.isinf(got[..., ~t2d]).all() and torch.isfinite(got[..., t2d]).all()


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_reduced_export_import_round_trip(tmp_path, fmt):
    full, small, t2d = _reduced()
    out = export_dense(small, tmp_path / fmt, dtype=torch.float32, fmt=fmt)
    tensors = load_file(str(out / "model.safetensors"))
    kept = t2d.nonzero().flatten()
    assert torch.equal(tensors["d2t"], kept - torch.arange(20)) and tensors["d2t"].dtype == torch.int64
    assert torch.equal(tensors["t2d"], t2d)
    assert torch.equal(tensors["lm_head.weight"], full._lm_head_weight[kept])
    assert tensors["markov_head.markov_w2.weight"].shape == (20, 6)
    assert tensors["markov_head.markov_w1.weight"].shape == (50, 6)
    assert verify_folder(out).ok, verify_folder(out).problems
    cfg = dense_config_from_folder(out)
    assert cfg.draft_vocab_size == 20
    dst = DSparkDenseDraft(cfg).eval()
    dst.share_target_weights(full._shared("embed_weight"), full._shared("lm_head_weight"))
    import_dense(out, dst)
    assert torch.equal(dst.d2t, small.d2t) and torch.equal(_logits(dst), _logits(small))
    # without t2d (vLLM does not need it) the mapping is rebuilt from d2t
    del tensors["t2d"]
    save_file(tensors, str(out / "model.safetensors"))
    reseal(out)  # hand-edited: only the layout checks should object
    assert verify_folder(out).ok
    dst2 = DSparkDenseDraft(cfg).eval()
    dst2.share_target_weights(full._shared("embed_weight"), full._shared("lm_head_weight"))
    assert torch.equal(import_dense(out, dst2).t2d, t2d)
    # a folder whose lm_head rows are not the target's would score differently: refused
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    save_file(tensors, str(out / "model.safetensors"))
    reseal(out)  # hand-edited: only the layout checks should object
    with pytest.raises(ValueError, match="not the shared target LM head"):
        import_dense(out, dst2)


def test_verifier_on_reduced_sets(tmp_path):
    _, small, _ = _reduced()
    out = export_dense(small, tmp_path / "r")
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["d2t"]
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1].contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    reseal(out)  # hand-edited: only the layout checks should object
    assert verify_folder(out).problems == ["missing: d2t [20] I64", "shape: lm_head.weight is [19, 32], expected [20, 32]"]


# ---- CLI on a training run against a tiny HF (Llama) target ---------------------------------------------
def test_cli_dense_reduced_speculators_export(tmp_path):
    from conftest import tiny_dense_dspark_run

    _, target, draft, _ = tiny_dense_dspark_run(tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"input_ids": [i, i + 1, 7], "loss_mask": [0, 1, 1]}) for i in range(30)))
    out = tmp_path / "out"
    res = _cli("dense", "--run-dir", str(tmp_path / "run"),  # the target comes from run/draft/target.json
               "--out", str(out), "--format", "speculators", "--draft-vocab-size", "16", "--vocab-counts", str(rows))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "draft vocabulary: 16 of 50 ids cover" in res.stdout and res.stdout.strip().splitlines()[-2].startswith("OK")
    assert res.stdout.strip().splitlines()[-1].startswith("next: vllm serve <target> --speculative-config")
    c = json.loads((out / "config.json").read_text())
    assert c["speculators_model_type"] == "dspark" and c["draft_vocab_size"] == 16
    kept = (torch.arange(16) + load_file(str(out / "model.safetensors"))["d2t"]).tolist()
    assert 7 in kept and kept == sorted(kept)
    back = DSparkDenseDraft(dense_config_from_folder(out)).eval()
    back.share_target_weights(target.embed_weight, target.lm_head_weight)
    import_dense(out, back)
    full = _logits(draft.eval())
    small = _logits(back)
    assert torch.allclose(small[..., kept], full[..., kept].to(small.dtype), atol=0.05, rtol=0.05)  # bf16 export


@pytest.mark.parametrize("kind,tensor", [("gated", "gate_proj"), ("rnn", "joint_proj")])
def test_non_vanilla_markov_heads_are_refused_for_vllm_and_round_trip_otherwise(tmp_path, kind, tensor):
    from dataclasses import replace

    def make(seed):
        d = DSparkDenseDraft(replace(_dense_cfg(6), markov_head_type=kind))
        _randomise(d, seed)
        g = torch.Generator().manual_seed(100)
        d.share_target_weights(torch.randn(50, 32, generator=g), torch.randn(50, 32, generator=g))
        return d

    src = make(1)
    with pytest.raises(ValueError, match=f"markov_head_type '{kind}'.*{tensor}"):
        export_dense(src, tmp_path / "refused", dtype=torch.float32)  # vLLM format: refused, naming the key
    assert not (tmp_path / "refused").exists()
    for fmt, kw in (("vllm", {"for_vllm": False}), ("speculators", {})):  # the documented ways to write it anyway
        out = export_dense(src, tmp_path / f"{kind}-{fmt}", dtype=torch.float32, fmt=fmt, **kw)
        dst = import_dense(out, make(2))
        prev, h = torch.tensor([[[3, 7, 9]]]), torch.randn(1, 1, 3, 32)
        assert torch.equal(src.markov_head(prev, h)[0], dst.markov_head(prev, h)[0])
        report = verify_folder(out)
        assert report.ok, report.problems  # marked dspark_not_for_vllm: the serving rule becomes a note ...
        assert len(report.notes) == 1 and report.notes[0].startswith(f"serving: markov head type '{kind}'")
        assert tensor in report.notes[0]
        c = json.loads((out / "config.json").read_text())
        del c["dspark_not_for_vllm"]  # ... and a problem without the marker
        (out / "config.json").write_text(json.dumps(c))
        reseal(out)  # hand-edited: only the layout checks should object
        problems = verify_folder(out).problems
        assert len(problems) == 1 and problems[0].startswith(f"serving: markov head type '{kind}'")


def test_export_target_defaults_to_the_runs_target_json(tmp_path):
    from dspark.export.__main__ import resolve_target
    import argparse

    run = tmp_path / "run"
    (run / "draft").mkdir(parents=True)

    def args(**kw):
        return argparse.Namespace(**{"cmd": "dense", "run_dir": run, "target": None, "target_path": None, **kw})

    assert resolve_target(args()) == ("smollm2", None)  # an older run without target.json: the format default
    (run / "draft" / "target.json").write_text(json.dumps({"kind": "hf", "path": "/models/t", "fingerprint": "x"}))
    assert resolve_target(args()) == ("hf", "/models/t")
    assert resolve_target(args(target_path="/other")) == ("hf", "/other")
    assert resolve_target(args(target="smollm2")) == ("smollm2", None)  # told otherwise
