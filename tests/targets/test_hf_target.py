"""FrozenTarget: hooks capture the configured layer outputs (hc averaged), teacher rows, validation."""
import pytest
import torch
from conftest import tiny_v4_config
from transformers import DeepseekV4ForCausalLM, LlamaConfig, LlamaForCausalLM

from dspark.targets.hf_target import FrozenTarget


def tiny_v4():
    torch.manual_seed(0)
    cfg = tiny_v4_config()
    return DeepseekV4ForCausalLM(cfg).eval()


def test_v4_hooks_average_hc_copies_and_match_hidden_states():
    model = tiny_v4()
    ids = torch.randint(0, 50, (2, 7))
    t = FrozenTarget(model, [0, 1])
    f = t.features(ids)
    ref = model(ids, output_hidden_states=True).hidden_states  # [in, out0, out1, final]
    assert f.aux.shape == (2, 7, 32)
    torch.testing.assert_close(f.aux[..., :16], ref[1].mean(-2))
    torch.testing.assert_close(f.aux[..., 16:], ref[2].mean(-2))
    torch.testing.assert_close(t.logits_from_final(f.final), model(ids).logits)
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_last_layer_is_captured_pre_norm():
    model = tiny_v4()
    ids = torch.randint(0, 50, (1, 5))
    f = FrozenTarget(model, [2]).features(ids)
    # the last layer's output is NOT the final hidden (final = norm(hc_head(.)))
    assert f.aux.shape == (1, 5, 16)
    assert not torch.allclose(f.aux, f.final)


def test_dense_target_layers_and_padding():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 40, (2, 6))
    t = FrozenTarget(model, [0, 2])
    f = t.features(ids, torch.ones_like(ids))
    hs = model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(f.aux[..., :16], hs[1])
    assert t.embed_weight.shape == (40, 16) and t.lm_head_weight.shape == (40, 16)


@pytest.mark.parametrize("ids", [[3], [-1], []])
def test_bad_layer_ids_fail_fast_naming_the_key(ids):
    with pytest.raises(ValueError, match="target_layer_ids"):
        FrozenTarget(tiny_v4(), ids)


def test_the_kv_cache_reaches_the_model_under_the_name_its_forward_declares():
    """transformers 5.24 renamed `past_key_values` to `cache`; an undeclared name would vanish into **kwargs and
    every cached forward would silently start from an empty cache."""
    from torch import nn

    from dspark.targets.hf_target import _cache_kwarg

    class New(nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Old(nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class Neither(nn.Module):
        def forward(self, input_ids=None, **kwargs): ...

    assert _cache_kwarg(New()) == "cache" and _cache_kwarg(Old()) == "past_key_values"
    with pytest.raises(TypeError, match="neither `cache` nor `past_key_values`"):
        _cache_kwarg(Neither())
