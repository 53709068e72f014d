"""The family contract (dspark.models.contract): every registered family meets it; a family lacking a required member
is refused when it registers, in one line naming the family and the member; its serving module is checked where the
adapters are collected; a test's family and adapter register for a while and leave nothing behind."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch.nn as nn

from dspark.export import adapter as ad
from dspark.models import contract, registry
from dspark.models.common import DraftConfig, SharedTargetWeights
from dspark.models.contract import CONFIG_MEMBERS, DRAFT_MEMBERS, FamilyContractError
from dspark.models.mtp_common import ChainDraft


def toy_config(without: str | None = None, **extra) -> type:
    """A config class meeting the contract, less the member `without`."""
    namespace = {
        "GROUP_KEYS": ("num_layers", "num_steps"), "DRAFTS_KEY": "num_steps", "DEFAULT_TARGET": None,
        "vllm_method": "mtp", "block_size": property(lambda self: self.num_steps),
        "validate": lambda self: self,
        "from_dict": classmethod(lambda cls, values: cls(**values).validate()),
        "from_target_config": classmethod(lambda cls, hf_config, **keys: cls(**keys).validate()),
        **extra,
    }
    namespace.pop(without, None)
    return dataclasses.make_dataclass("ToyContractConfig", [("num_layers", int, 1), ("num_steps", int, 2)],
                                      namespace=namespace, kw_only=True)


def toy_draft(without: str | None = None) -> type:
    """A draft class meeting the contract, less the member `without`."""
    namespace = {"__init__": lambda self, config: (nn.Module.__init__(self), setattr(self, "config", config))[0],
                 "share_target_weights": lambda self, embed_weight, lm_head_weight: None,
                 "propose_batch": lambda self, feats, tokens, **kw: [],
                 "new_cache": lambda self: None}
    namespace.pop(without, None)
    return type("ToyContractDraft", (nn.Module,), namespace)


def record(kind: str = "toy_contract", config: type | None = None, draft: type | None = None,
           serving: str | None = "dspark.export.dense") -> registry.Family:
    return registry.Family(kind=kind, draft=draft or toy_draft(), config=config or toy_config(), objective="mtp",
                           serving=serving)


def test_every_registered_family_meets_the_contract():
    fams = registry.families()
    assert fams
    for kind, fam in fams.items():
        assert contract.contract_problems(fam.config, fam.draft, fam.serving) == [], kind
        assert ad.family_adapters(kind), kind  # its serving module exists and registers its adapter
    assert set(CONFIG_MEMBERS) == {"GROUP_KEYS", "DRAFTS_KEY", "DEFAULT_TARGET", "vllm_method", "block_size",
                                   "validate", "from_dict", "from_target_config"}  # docs/design.md's list
    assert set(DRAFT_MEMBERS) == {"share_target_weights", "propose_batch", "new_cache"}


def test_a_built_config_and_draft_are_instances_of_the_protocols():
    from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft

    cfg = DSparkDenseConfig(num_layers=1, block_size=4, mask_token_id=3, target_layer_ids=[0], hidden_size=16,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
                            vocab_size=64)
    assert isinstance(cfg, contract.FamilyConfig)
    assert isinstance(DSparkDenseDraft(cfg), contract.FamilyDraft)
    assert not isinstance(object(), contract.FamilyConfig)


@pytest.mark.parametrize("member", CONFIG_MEMBERS)
def test_a_config_lacking_a_required_member_is_refused_in_one_line(member):
    before = registry.kinds()
    with pytest.raises(FamilyContractError) as e:
        registry.register("toy_contract", config=toy_config(without=member), objective="mtp",
                          serving="dspark.export.dense")(toy_draft())
    msg = str(e.value)
    assert "\n" not in msg and "'toy_contract'" in msg and msg.endswith(f"config ToyContractConfig lacks {member}")
    assert registry.kinds() == before


@pytest.mark.parametrize("member", DRAFT_MEMBERS)
def test_a_draft_lacking_a_required_member_is_refused_in_one_line(member):
    draft = toy_draft(without=member)
    with pytest.raises(FamilyContractError) as e:
        registry.register_family(record(draft=draft))
    msg = str(e.value)
    assert "\n" not in msg and "'toy_contract'" in msg and msg.endswith(f"draft ToyContractDraft lacks {member}")
    assert "toy_contract" not in registry.kinds() and "family_kind" not in vars(draft)


def test_a_record_breaking_the_contract_otherwise_is_refused():
    plain = type("PlainConfig", (), {name: None for name in CONFIG_MEMBERS})
    with pytest.raises(FamilyContractError, match=r"'toy_contract' .*config PlainConfig is not a dataclass$"):
        registry.register_family(record(config=plain))
    with pytest.raises(FamilyContractError, match=r"draft 'ToyContractDraft' is not a torch.nn.Module class$"):
        registry.register_family(record(draft=type("ToyContractDraft", (), {n: None for n in DRAFT_MEMBERS})))
    with pytest.raises(FamilyContractError, match="serving is None and config ToyContractConfig gives no NOT_SERVED"):
        registry.register_family(record(serving=None))
    with pytest.raises(FamilyContractError, match=r"serving 'dspark/export/dense\.py' is not a module name$"):
        registry.register_family(record(serving="dspark/export/dense.py"))
    with registry.temporary_family(record(config=toy_config(NOT_SERVED="a test family"), serving=None)) as fam:
        assert registry.family("toy_contract") is fam and ad.adapters()  # no serving module: nothing to collect


def test_a_serving_module_is_checked_where_adapters_are_collected():
    with registry.temporary_family(record(serving="dspark.export.no_such_module")):
        with pytest.raises(FamilyContractError, match=r"^draft family 'toy_contract' breaks the family contract: its "
                                                      r"serving module 'dspark.export.no_such_module' does not exist$"):
            ad.adapters()
    with registry.temporary_family(record(serving="dspark.export.dense")):  # a module serving other kinds only
        with pytest.raises(FamilyContractError, match=r"serving module 'dspark.export.dense' registers no serving "
                                                      r"adapter of kind 'toy_contract'$"):
            ad.family_adapters("toy_contract")
    assert ad.adapters()  # the family gone: the shipped ones collect again


def test_a_temporary_family_and_adapter_come_and_go_cleanly():
    from dspark.export.dense import DenseAdapter

    class ToyConfig(toy_config()):
        pass

    class ToyDraft(ChainDraft, SharedTargetWeights, nn.Module):
        family_kind = "inherited"  # a kind its class had before: restored on exit

    class ToyAdapter(DenseAdapter):
        kind, cli, what = "toy_contract", "toy_contract", "toy"

    kinds, shipped = registry.kinds(), ad.adapters()
    toy = registry.Family(kind="toy_contract", draft=ToyDraft, config=ToyConfig, objective="mtp",
                          serving="dspark.export.dense")
    with ad.temporary_adapter(ToyAdapter), registry.temporary_family(toy) as fam:
        assert registry.kinds() == (*kinds, "toy_contract") and registry.family("toy_contract") is fam
        assert ToyDraft.family_kind == "toy_contract" and ad.family_adapters("toy_contract") == [ToyAdapter]
        assert ad.adapters() == [*shipped, ToyAdapter]  # after the shipped ones
        with pytest.raises(ValueError, match="'toy_contract' is registered already"):
            with registry.temporary_family(toy):
                pass
        with pytest.raises(ValueError, match="ToyAdapter is registered already"):
            with ad.temporary_adapter(ToyAdapter):
                pass
    assert registry.kinds() == kinds and ad.adapters() == shipped and ToyDraft.family_kind == "inherited"
    with registry.temporary_family(registry.Family(kind="toy_contract", draft=toy_draft(), config=DraftConfigToy,
                                                   objective="mtp", serving=None)) as fam:
        draft = fam.draft
        assert draft.family_kind == "toy_contract"
    assert "family_kind" not in vars(draft)  # a kind it did not have before: none after
    with pytest.raises(ValueError, match="'dspark_dense' is registered already"):
        with registry.temporary_family(registry.Family(kind="dspark_dense", draft=toy_draft(), config=toy_config(),
                                                       objective="block", serving="dspark.export.dense")):
            pass
    assert registry.family("dspark_dense").draft.__name__ == "DSparkDenseDraft"


@dataclasses.dataclass(kw_only=True)
class DraftConfigToy(DraftConfig):
    """A config meeting the contract through DraftConfig (from_dict), as the shipped ones do."""

    GROUP_KEYS: ClassVar[tuple[str, ...]] = ("num_steps",)
    DRAFTS_KEY: ClassVar[str] = "num_steps"
    DEFAULT_TARGET: ClassVar[str | None] = None
    NOT_SERVED: ClassVar[str] = "a test family"
    vllm_method: ClassVar[str] = "mtp"
    num_steps: int = 1

    @property
    def block_size(self) -> int:
        return self.num_steps

    def validate(self) -> DraftConfigToy:
        return self

    @classmethod
    def from_target_config(cls, hf_config, **keys) -> DraftConfigToy:
        return cls(**keys).validate()
