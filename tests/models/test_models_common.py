"""dspark.models.common: config_from_dict and the SharedTargetWeights mixin, on a toy config / module."""

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from dspark.models.common import SharedTargetWeights, config_from_dict


@dataclass(kw_only=True)
class ToyConfig:
    vocab_size: int
    hidden_size: int
    depth: int = 2
    ids: list[int] = field(default_factory=list)


class Toy(SharedTargetWeights, nn.Module):
    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config = config
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self._embed_weight = self._lm_head_weight = None


def test_config_from_dict_fills_defaults_and_names_bad_keys():
    cfg = config_from_dict(ToyConfig, {"vocab_size": 5, "hidden_size": 3})
    assert cfg == ToyConfig(vocab_size=5, hidden_size=3, depth=2, ids=[])
    with pytest.raises(ValueError, match=r"ToyConfig: unknown keys \['bogus'\]"):
        config_from_dict(ToyConfig, {"vocab_size": 5, "hidden_size": 3, "bogus": 1})
    # a key with a default_factory is not required; one without any default is
    with pytest.raises(ValueError, match=r"ToyConfig: missing keys \['hidden_size'\]"):
        config_from_dict(ToyConfig, {"vocab_size": 5})


def test_shared_target_weights_are_detached_outside_the_module_tree():
    toy = Toy(ToyConfig(vocab_size=5, hidden_size=3))
    with pytest.raises(RuntimeError, match="Toy: call share_target_weights"):
        toy._shared("embed_weight")
    emb = torch.randn(5, 3, requires_grad=True)
    head = torch.randn(5, 3)
    with pytest.raises(ValueError, match=r"lm_head_weight must be \[5, 3\], got \(3, 5\)"):
        toy.share_target_weights(emb, head.t())
    toy.share_target_weights(emb, head)
    assert torch.equal(toy._shared("embed_weight"), emb) and not toy._shared("embed_weight").requires_grad
    assert toy._shared("lm_head_weight") is not None
    assert set(toy.state_dict()) == {"proj.weight", "proj.bias"}
    assert len(list(toy.parameters())) == 2
