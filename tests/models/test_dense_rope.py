"""Dense drafts rotate with the TARGET's positions: transformers' rope initialisation from the target config (llama3
scaling of Llama 3.1, YaRN with its attention factor, ...), checked against the target model's own rotary module at
long positions, and exported as the target's rope settings."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from dspark.export.dense import dense_config_json, dense_config_from_folder, export_dense
from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft, rope

SIZES = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
LLAMA31 = (LlamaConfig, LlamaForCausalLM, dict(max_position_embeddings=131072, rope_parameters={
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}))
YARN = (Qwen3Config, Qwen3ForCausalLM, dict(max_position_embeddings=131072, rope_parameters={
    "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768}))
POSITIONS = torch.tensor([[0, 1, 7, 1000, 9000, 40000, 100000]])


def _target_and_draft(spec):
    config_cls, model_cls, extra = spec
    torch.manual_seed(0)
    target = model_cls(config_cls(**SIZES, **extra)).eval()
    cfg = DSparkDenseConfig.from_target_config(target.config, block_size=4, mask_token_id=3, target_layer_ids=[0, 1],
                                           markov_rank=0)
    return target, DSparkDenseDraft(cfg)


@pytest.mark.parametrize("spec", [LLAMA31, YARN], ids=["llama3.1", "yarn"])
def test_draft_rotary_equals_the_targets(spec):
    target, draft = _target_and_draft(spec)
    x = torch.zeros(1, dtype=torch.float32)
    cos_t, sin_t = target.model.rotary_emb(x, POSITIONS)  # the target model's own rotary embedding
    cos_d, sin_d = draft.rotary_emb(x, POSITIONS)  # one angle per pair: the target's [.., D] = both halves of it
    torch.testing.assert_close(torch.cat([cos_d, cos_d], -1), cos_t, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([sin_d, sin_d], -1), sin_t, rtol=0, atol=0)
    q = torch.randn(1, 4, POSITIONS.shape[1], 16)  # [B, heads, T, D]
    want, _ = apply_rotary_pos_emb(q, q, cos_t, sin_t)
    torch.testing.assert_close(rope(q, POSITIONS, draft.rotary_emb), want, rtol=1e-6, atol=1e-6)
    # the check can fail: the unscaled rope of the same theta rotates these positions differently
    plain = DSparkDenseDraft(DSparkDenseConfig(**{**draft.config.__dict__, "rope_parameters": {
        "rope_type": "default", "rope_theta": draft.config.rope_parameters["rope_theta"]}}))
    assert not torch.allclose(plain.rotary_emb(x, POSITIONS)[0], cos_t[..., :8], atol=1e-3)


@pytest.mark.parametrize("spec", [LLAMA31, YARN], ids=["llama3.1", "yarn"])
def test_export_writes_the_targets_rope_settings(spec, tmp_path):
    target, draft = _target_and_draft(spec)
    want = {k: v for k, v in target.config.rope_parameters.items()}
    got = dense_config_json(draft.config)  # a DFlash draft: the 1+N mask layout
    assert got["rope_parameters"] == want and got["rope_parameters"]["rope_type"] != "default"
    assert got["max_position_embeddings"] == target.config.max_position_embeddings
    export_dense(draft, tmp_path, dtype=torch.float32)
    back = dense_config_from_folder(tmp_path)  # the exported folder rebuilds the same positions
    assert back.rope_parameters == want and back.max_position_embeddings == target.config.max_position_embeddings


def test_nested_or_partial_rope_is_refused():
    base = dict(hidden_size=16, vocab_size=10, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                intermediate_size=8, block_size=2, mask_token_id=1, target_layer_ids=[0])
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        DSparkDenseConfig(**base, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.5}).validate()
    with pytest.raises(ValueError, match="rope_parameters"):
        DSparkDenseConfig(**base, rope_parameters={"full": {"rope_type": "default", "rope_theta": 1e4}}).validate()
