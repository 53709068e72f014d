"""The registry of draft families (dspark.models.registry): every family found, trained by a known objective and
served by an adapter; draft groups <-> configs; errors name the draft-group key."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from conftest import REPO
from dspark.errors import ConfigError
from dspark.export.adapter import adapters
from dspark.models import registry
from dspark.training.modules import MODULES


def test_every_family_registers_itself_with_an_objective_and_a_serving_adapter():
    fams = registry.families()
    assert set(fams) == {"dspark_v4", "dspark_dense", "dsv4_mtp", "hyv4_mtp"}
    served = {cls.kind for cls in adapters()}
    for kind, fam in fams.items():
        assert fam.draft.family_kind == kind and fam.objective in MODULES, kind
        assert kind in served, f"{kind} has no serving adapter"
        assert fam.config.DRAFTS_KEY in fam.group_keys, kind
    with pytest.raises(ConfigError, match="draft.kind: 'eagle3' is not one of"):
        registry.family("eagle3")


@pytest.mark.parametrize("name", ["dspark_v4_flash", "dspark_v4_pro"])
def test_a_draft_group_and_its_config_round_trip(name):
    group = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "draft" / f"{name}.yaml"))
    cfg = registry.config_from_group(group)
    back = registry.resolved_group(cfg, "dspark_v4", group)
    assert registry.config_from_group(back) == cfg
    assert back["layout"] == "anchor" and "layout" not in back["arch"] and "hidden_size" in back["arch"]
    with pytest.raises(ConfigError, match=r"draft\.arch: \['block_size'\] belong at the draft level"):
        registry.config_values({**group, "arch": {**group["arch"], "block_size": 3}})


def test_config_errors_name_the_group_key_or_the_arch_key():
    from transformers import AutoConfig

    from dspark.targets.tiny_v4 import TINY_V4_DIR

    hf = AutoConfig.from_pretrained(str(TINY_V4_DIR))
    group = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "draft" / "dspark_v4_tiny.yaml"))
    group["mask_token_id"] = 4
    assert registry.build_config(group, hf).layout == "anchor"
    with pytest.raises(ConfigError, match=r"^draft\.layout: DSparkV4Config\.layout must be one of"):
        registry.build_config({**group, "layout": "causal"}, hf)
    with pytest.raises(ConfigError, match=r"^draft\.arch\.o_groups: "):
        registry.build_config({**group, "arch": {"o_groups": 3}}, hf)
    with pytest.raises(ConfigError, match=r"^draft\.kind: dspark_dense needs a dense target"):
        registry.build_config({**group, "kind": "dspark_dense"}, hf)
