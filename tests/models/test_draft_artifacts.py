"""A run's draft/ folder is a self-contained artifact: its draft_config.json is complete (sizes, resolved mask
token, target layer ids; target.json: the target's identity), so load_draft rebuilds the draft without the target
and without Hydra; save_draft writes the same layout."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import compose
from dspark import factory
from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft
from dspark.pretrained import load_draft, save_draft
from dspark.training.run import export_draft


@pytest.mark.parametrize("experiment", ["dspark_v4", "dsv4_mtp", "hyv4_mtp"])
def test_run_draft_folder_reloads_without_the_target(tmp_path, experiment):
    cfg = compose([f"experiment={experiment}", "draft.num_layers=1"])
    target = factory.build_target(cfg.target, cfg.draft)
    draft = factory.build_draft(cfg.draft, target)
    export_draft(draft, cfg.draft, cfg.target, tmp_path)  # exactly what train.py writes at the end of a run
    saved = json.loads((tmp_path / "draft_config.json").read_text())
    if "mask_token_id" in saved:
        assert saved["mask_token_id"] == 4  # the tokenizer's <|mask|>, resolved (the group says null)
    assert saved["arch"]["hidden_size"] == target.hidden_size and saved["arch"]["vocab_size"] == target.vocab_size

    back, _ = load_draft(tmp_path)  # no target, no Hydra
    assert type(back) is type(draft) and back.config == draft.config
    want = draft.state_dict()
    assert set(back.state_dict()) == set(want)
    for k, v in back.state_dict().items():
        assert torch.equal(v, want[k]), k
    # the recorded group rebuilds the same draft against the target, too (eval.py / export do that)
    again = factory.build_draft(saved, target)
    assert again.config == draft.config


def test_save_draft_round_trip_keeps_the_targets_rope(tmp_path):
    cfg = DSparkDenseConfig(hidden_size=32, vocab_size=50, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            intermediate_size=48, block_size=3, mask_token_id=49, target_layer_ids=[0, 2],
                            markov_rank=4, max_position_embeddings=65536,
                            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192})
    draft = DSparkDenseDraft(cfg)
    identity = {"kind": "hf", "path": "meta-llama/Llama-3.1-8B-Instruct", "fingerprint": "abc"}
    save_draft(draft, tmp_path, target=identity)
    back, target = load_draft(tmp_path)
    assert back.config == cfg and target == identity
    assert all(torch.equal(v, draft.state_dict()[k]) for k, v in back.state_dict().items())


def test_a_folder_without_resolved_sizes_is_refused_clearly(tmp_path):
    from dspark.integrity import write_manifest

    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "draft_config.json").write_text(json.dumps(  # what a run wrote before the sizes were recorded
        {"kind": "dspark_v4", "num_layers": 1, "block_size": 4, "mask_token_id": None, "target_layer_ids": [1],
         "markov_rank": 8, "markov_head_type": "vanilla", "sliding_window": 64, "layout": "anchor", "arch": {}}))
    (tmp_path / "target.json").write_text(json.dumps({"kind": "tiny_v4", "path": None, "fingerprint": None}))
    write_manifest(tmp_path)
    with pytest.raises(ValueError, match="mask_token_id is null"):
        load_draft(tmp_path)
    with pytest.raises(FileNotFoundError, match="no draft_config.json"):
        load_draft(tmp_path / "nowhere")
