"""DeepSeek-V4 MTP draft: the layer against a direct transcription (transformers' V4 decoder layer and
HyperHead for the block), chain drafting vs teacher-forced training, serving names, target capture,
and greedy speculative decoding == plain greedy decoding."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_v4_config
from dspark.export.dsv4_mtp import from_serving_names, to_serving_names
from dspark.models.dsv4_mtp import DSV4MTPConfig, DSV4MTPDraft, causal_window_mask
from dspark.models.mtp_common import chain_propose
from dspark.models.v4_names import draft_layer_to_hf_state
from dspark.targets.hf_target import FrozenTarget, TargetFeatures

V, H, HC, WINDOW = 50, 16, 2, 4


def _hf_cfg(**kw):
    cfg = tiny_v4_config(sliding_window=WINDOW, **kw)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def _randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g).to(p.dtype)
            if name.endswith("norm.weight") or name.endswith("_scale"):
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith(("attn_sink", "gate.bias", "_base")):
                p.copy_(noise)
            else:
                p.copy_(0.4 * noise)


def _draft(seed=0, num_layers=1, **kw):
    hf_cfg = _hf_cfg()
    draft = DSV4MTPDraft(DSV4MTPConfig.from_target_config(hf_cfg, num_layers=num_layers, **kw))
    _randomise(draft, seed)
    g = torch.Generator().manual_seed(seed + 100)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    draft.share_target_weights(embed, head)
    return hf_cfg, draft, embed, head


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _direct_step(hf_cfg, layer, embed, ids, hidden, pos):
    """Direct transcription of one MTP layer: masked embedding, enorm/hnorm, e_proj/h_proj, the block as
    transformers' DeepseekV4DecoderLayer with a sliding causal mask."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4RotaryEmbedding

    e = embed[ids] * (pos != 0).unsqueeze(-1)  # [B, S, H], zero at position 0
    x = _rms(hidden, layer.hnorm.weight) @ layer.h_proj.weight.t() \
        + (_rms(e, layer.enorm.weight) @ layer.e_proj.weight.t()).unsqueeze(2)  # [B, S, hc, H]
    hf_layer = DeepseekV4DecoderLayer(hf_cfg, 0)
    hf_layer.load_state_dict(draft_layer_to_hf_state(layer.block.state_dict()), strict=True)
    s = ids.shape[1]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    visible = ((j <= i) & (j > i - WINDOW)).expand(ids.shape[0], s, s)
    rope = DeepseekV4RotaryEmbedding(hf_cfg)
    pe = {kind: rope(x, pos, layer_type=kind) for kind in ("main", "compress")}
    additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    return hf_layer(x, position_embeddings=pe, position_ids=pos, attention_mask=additive[:, None])


def _direct_logits(hf_cfg, layer, head, x):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    hh = DeepseekV4HyperHead(hf_cfg)
    hh.hc_fn.data.copy_(layer.hc_head_fn)
    hh.hc_base.data.copy_(layer.hc_head_base)
    hh.hc_scale.data.copy_(layer.hc_head_scale)
    return _rms(hh(x), layer.norm.weight) @ head.t()


@torch.no_grad()
def test_two_steps_match_direct_transcription():
    hf_cfg, draft, embed, head = _draft(seed=1, num_layers=2)
    b, s = 2, 9
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (b, s), generator=g)
    h0 = torch.randn(b, s, HC, H, generator=g)  # the target's pre-hc_head stream
    pos = torch.arange(s).expand(b, s)
    x1 = draft.step(ids, h0, pos, 0)
    ref1 = _direct_step(hf_cfg, draft.layers[0], embed, ids, h0, pos)
    torch.testing.assert_close(x1, ref1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(draft.logits(x1, 0), _direct_logits(hf_cfg, draft.layers[0], head, ref1),
                               atol=1e-4, rtol=1e-5)
    # step 1 reuses layer 1 % 2 on step 0's output, positions + 1 (no row at position 0 any more)
    x2 = draft.step(ids, x1, pos + 1, 1)
    ref2 = _direct_step(hf_cfg, draft.layers[1], embed, ids, ref1, pos + 1)
    torch.testing.assert_close(x2, ref2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(draft.logits(x2, 1), _direct_logits(hf_cfg, draft.layers[1], head, ref2),
                               atol=1e-4, rtol=1e-5)
    # step 2 wraps to layer 0; the first-position embedding mask is real
    torch.testing.assert_close(draft.step(ids, x2, pos + 2, 2), _direct_step(hf_cfg, draft.layers[0], embed, ids, x2,
                                                                                pos + 2), atol=1e-5, rtol=1e-5)
    draft.config.mask_first_embedding = False
    assert (draft.step(ids, h0, pos, 0) - x1)[:, 0].abs().max() > 1e-4


def test_causal_window_mask_by_hand():
    m = causal_window_mask(torch.tensor([[0, 1, 2, 3]]), 2)[0].int()
    assert m.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


def test_serving_names_roundtrip_and_official_names():
    _, draft, _, _ = _draft(seed=2, num_layers=2)
    state = draft.state_dict()
    serving = to_serving_names(state)
    for name in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn",
                 "hc_head_base", "hc_head_scale", "attn.wq_a.weight", "attn.wkv.weight", "attn.attn_sink",
                 "attn_norm.weight", "ffn_norm.weight", "hc_attn_fn", "hc_ffn_scale", "ffn.gate.weight",
                 "ffn.gate.bias", "ffn.experts.1.w3.weight", "ffn.shared_experts.w2.weight"):
        for i in (0, 1):
            assert f"mtp.{i}.{name}" in serving, name
    assert len(serving) == len(state) and all(k.startswith(("mtp.0.", "mtp.1.")) for k in serving)
    back = from_serving_names({**serving, "mtp.0.emb.tok_emb.weight": torch.zeros(1), "mtp.0.head.weight": torch.zeros(1)})
    assert set(back) == set(state) and all(torch.equal(back[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="layers.0.weird"):
        to_serving_names({"layers.0.weird": torch.zeros(1)})
    with pytest.raises(ValueError, match="model.layers"):
        from_serving_names({"model.layers.0.x": torch.zeros(1)})


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="num_steps"):
        DSV4MTPConfig.from_target_config(_hf_cfg(), num_steps=0)
    with pytest.raises(ValueError, match="DSV4MTPConfig.o_groups"):
        DSV4MTPConfig.from_target_config(_hf_cfg(), o_groups=3)
    with pytest.raises(ValueError, match="unknown keys"):
        DSV4MTPConfig.from_target_config(_hf_cfg(), block_size=4)
    _, draft, _, _ = _draft()
    with pytest.raises(ValueError, match="pre_head"):
        draft.context_hidden(TargetFeatures(aux=torch.zeros(1, 3, 0), final=torch.zeros(1, 3, H)))


def _target(seed=3, vocab=V):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(_hf_cfg(vocab_size=vocab))
    return FrozenTarget(model, [], require_aux=False)


@torch.no_grad()
def test_target_captures_pre_head_stream_only_when_asked():
    target = _target()
    ids = torch.randint(0, V, (2, 7))
    plain = target.features(ids)
    assert plain.pre_head is None and plain.aux.shape == (2, 7, 0)
    feats = target.features(ids, pre_head=True)
    assert feats.pre_head.shape == (2, 7, HC, H)
    base = target.model.model
    torch.testing.assert_close(base.norm(base.hc_head(feats.pre_head)), feats.final)  # it is the pre-hc_head stream
    torch.testing.assert_close(feats.final, plain.final)
    p = feats.prefix(3)
    assert p.pre_head.shape == (2, 3, HC, H) and p.final.shape == (2, 3, H) and plain.prefix(3).pre_head is None
    with pytest.raises(ValueError, match="target_layer_ids"):
        FrozenTarget(target.model, [])


@torch.no_grad()
def test_chain_propose_equals_teacher_forced_rows():
    """Proposal logits of step k == the training chain's step-k logits at row a-1 on [tokens, y_0..y_{K-2}]:
    training and eval run the same (served) recursion."""
    from dspark.training.mtp_objectives import recursive_forward

    target = _target(seed=4)
    _, draft, _, _ = _draft(seed=5, num_layers=1)
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    tokens = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(1))
    a, K = tokens.numel() - 1, 3
    feats_ctx = target.features(tokens[:a].unsqueeze(0), pre_head=True)
    prop = chain_propose(draft, feats_ctx, tokens, num_drafts=K)
    assert prop.tokens.shape == (K,) and prop.q_probs.shape == (K, V)
    seq = torch.cat([tokens, prop.tokens]).unsqueeze(0)  # [1, a + 1 + K]
    feats = target.features(seq, pre_head=True)
    steps = recursive_forward(draft, draft.context_hidden(feats), seq, torch.ones_like(seq), feats.final, K)
    for k, st in enumerate(steps):
        row = (st.rows[:, 1] == a - 1).nonzero()[0, 0]
        torch.testing.assert_close(st.logits[row], prop.logits[k], atol=1e-4, rtol=1e-5)
        assert int(st.labels[row]) == int(prop.tokens[k])  # greedy: the draft is its own label here


@torch.no_grad()
def test_greedy_speculative_decoding_equals_plain_decoding():
    from dspark.evaluation.speculative import speculative_generate, target_generate

    target = _target(seed=8, vocab=6)  # a tiny vocabulary so that random drafts are sometimes accepted
    target.capture_pre_head = True
    hf_cfg = _hf_cfg(vocab_size=6)
    draft = DSV4MTPDraft(DSV4MTPConfig.from_target_config(hf_cfg, num_layers=1, num_steps=3))
    _randomise(draft, 8)
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    accepted = rejected = 0
    for seed in range(3):
        prompt = torch.randint(0, 6, (5,), generator=torch.Generator().manual_seed(seed))
        ref = target_generate(target, prompt, 12)
        out, stats = speculative_generate(target, draft, prompt, max_new_tokens=12, num_drafts=3)
        assert out.tolist() == ref.tolist()
        assert all(s.num_drafts == 3 for s in stats)
        accepted += sum(s.num_accepted for s in stats)
        rejected += sum(s.num_accepted < s.num_drafts for s in stats)
    assert accepted > 0 and rejected > 0  # both the accepted-draft and the correction paths were exercised


@torch.no_grad()
def test_init_from_target_copies_last_layer_head_and_norm():
    from dspark.models.v4_names import hf_layer_to_draft_state

    target = _target(seed=9)
    _randomise(target.model, 9)
    _, draft, _, _ = _draft(seed=10, num_layers=2)
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    draft.init_from_target(target.model)
    base = target.model.model
    ref = hf_layer_to_draft_state(base.layers[-1].state_dict())
    for layer in draft.layers:
        for k, v in layer.block.state_dict().items():
            assert torch.equal(v, ref[k]), k
        assert torch.equal(layer.hc_head_fn, base.hc_head.hc_fn) and torch.equal(layer.norm.weight, base.norm.weight)
    # with the target's own block, hc_head and norm, a step over the target's pre-hc_head stream is that
    # layer applied once more; its logits use the same head stack as the target
    ids = torch.randint(0, V, (1, 6))
    feats = target.features(ids, pre_head=True)
    x = draft.step(ids, draft.context_hidden(feats), torch.arange(6).unsqueeze(0), 0)
    assert x.shape == feats.pre_head.shape
    torch.testing.assert_close(draft.logits(feats.pre_head, 0), target.logits_from_final(feats.final))
