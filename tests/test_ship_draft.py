"""scripts/ship_draft.py: a run's draft/ folder shipped with bf16 weights, re-sealed, loadable as any run's."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import REPO

from dspark.integrity import IntegrityError
from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft
from dspark.pretrained import load_draft, save_draft

spec = importlib.util.spec_from_file_location("ship_draft", REPO / "scripts" / "ship_draft.py")
shipper = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shipper)

IDENTITY = {"kind": "smollm2", "path": None, "fingerprint": "f" * 64}


def trained_run(tmp_path):
    cfg = DSparkDenseConfig(hidden_size=32, vocab_size=50, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            intermediate_size=48, block_size=3, mask_token_id=49, target_layer_ids=[0, 2],
                            markov_rank=4, draft_vocab_size=20)
    torch.manual_seed(0)
    draft = DSparkDenseDraft(cfg)
    with torch.no_grad():
        for p in draft.parameters():  # values that bf16 cannot hold exactly
            p.add_(torch.randn_like(p) * 1e-3)
    save_draft(draft, tmp_path / "run" / "draft", target=IDENTITY)
    return draft


def test_shipped_weights_are_the_runs_rounded_to_bf16_and_the_folder_loads(tmp_path):
    draft = trained_run(tmp_path)
    dst = shipper.ship(tmp_path / "run", tmp_path / "shipped")
    back, target = load_draft(dst)  # its own manifest checks out
    assert target == IDENTITY and back.config == draft.config
    raw = shipper.draft_dir.load_state(dst)
    want = draft.state_dict()
    assert set(raw) == set(want)
    rounded = 0
    for k, v in raw.items():
        if want[k].is_floating_point():
            assert v.dtype == torch.bfloat16, k
            assert torch.equal(v, want[k].to(torch.bfloat16)), k
            rounded += int(not torch.equal(v.float(), want[k]))
        else:
            assert torch.equal(v, want[k]), k  # the vocabulary maps are copied as they are
    assert rounded > 0  # the cast did something: the loaded draft is the rounded one
    for k, v in back.state_dict().items():
        assert torch.equal(v, raw[k].to(v.dtype)), k
    assert json.loads((dst / "draft_config.json").read_text()) == json.loads(
        (tmp_path / "run" / "draft" / "draft_config.json").read_text())


def test_a_damaged_run_and_an_oversized_draft_are_refused(tmp_path):
    trained_run(tmp_path)
    with pytest.raises(SystemExit, match="over --max-mb"):
        shipper.ship(tmp_path / "run", tmp_path / "shipped", max_mb=0.01)
    weights = tmp_path / "run" / "draft" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-9] ^= 0xFF  # one byte of the last tensor flipped, the size unchanged
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        shipper.ship(tmp_path / "run", tmp_path / "again")
