"""Dense DSpark/DFlash draft: one layer vs transformers' Qwen3DecoderLayer, context split, heads."""
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft


def small_cfg(**kw):
    base = dict(hidden_size=32, vocab_size=50, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, intermediate_size=48, rms_norm_eps=1e-6, block_size=3,
                mask_token_id=49, target_layer_ids=[0, 1], markov_rank=6)
    base.update(kw)
    return DSparkDenseConfig(**base)


def test_layer_matches_transformers_qwen3_layer():
    torch.manual_seed(0)
    cfg = small_cfg()
    draft = DSparkDenseDraft(cfg)
    for p in draft.parameters():  # non-trivial norms too
        torch.nn.init.normal_(p, std=0.3) if p.dim() == 1 else None
    hf_cfg = Qwen3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, vocab_size=50, rms_norm_eps=1e-6, num_hidden_layers=1)
    hf_cfg._attn_implementation = "eager"
    ref = Qwen3DecoderLayer(hf_cfg, 0).eval()
    missing = ref.load_state_dict(draft.layers[0].state_dict(), strict=True)
    assert not missing.missing_keys
    B, T = 2, 6
    x = torch.randn(B, T, 32)
    pos = torch.arange(T).expand(B, T)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool)).expand(B, T, T)
    empty = (torch.zeros(B, 2, 0, 8), torch.zeros(B, 2, 0, 8))
    ours = draft.layers[0](x, pos, empty, causal)
    cos_sin = Qwen3RotaryEmbedding(hf_cfg)(x, pos)
    add_mask = torch.zeros(B, 1, T, T).masked_fill(~causal[:, None], float("-inf"))
    theirs = ref(x, attention_mask=add_mask, position_ids=pos, position_embeddings=cos_sin)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_context_kv_equals_attending_over_concatenation():
    """Block queries over [context kv ; block] == the layer's own kv of the same inputs at those positions."""
    torch.manual_seed(1)
    draft = DSparkDenseDraft(small_cfg())
    attn = draft.layers[0].self_attn
    B, S, T = 1, 5, 3
    ctx_x, blk_x = torch.randn(B, S, 32), torch.randn(B, T, 32)
    ctx_pos, blk_pos = torch.arange(S)[None], torch.arange(S, S + T)[None]
    mask = torch.ones(B, T, S + T, dtype=torch.bool)
    out = attn(blk_x, blk_pos, attn.kv(ctx_x, ctx_pos), mask)
    # same thing with the context given as part of one sequence whose first S queries are discarded
    full_x = torch.cat([ctx_x, blk_x], 1)
    full_pos = torch.arange(S + T)[None]
    full_mask = torch.ones(B, S + T, S + T, dtype=torch.bool)
    empty = (torch.zeros(B, 2, 0, 8), torch.zeros(B, 2, 0, 8))
    ref = attn(full_x, full_pos, empty, full_mask)[:, S:]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_dflash_has_no_heads_and_names_match_serving():
    d = DSparkDenseDraft(small_cfg(markov_rank=0))
    assert d.markov_head is None and d.confidence_head is None
    names = set(DSparkDenseDraft(small_cfg()).state_dict())
    for n in ("fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
              "layers.0.self_attn.k_norm.weight", "layers.0.mlp.down_proj.weight",
              "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
              "confidence_head.proj.weight", "confidence_head.proj.bias"):
        assert n in names
    assert not any("embed" in n or "lm_head" in n for n in names)
    shared = DSparkDenseDraft(small_cfg())
    tied = torch.nn.Parameter(torch.randn(50, 32))  # a tied embedding / LM head, as SmolLM2 ships
    shared.share_target_weights(tied, tied)
    assert set(shared.state_dict()) == names
    assert all(p is not tied for p in shared.parameters())


def test_bad_config_names_the_key():
    import pytest
    with pytest.raises(ValueError, match="num_key_value_heads"):
        small_cfg(num_key_value_heads=3).validate()
    with pytest.raises(ValueError, match="mask_token_id"):
        small_cfg(mask_token_id=50).validate()
