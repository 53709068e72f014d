"""The registry of draft families (dspark.models.registry): every family found, trained by a known objective and
served by an adapter; draft groups <-> configs; errors name the draft-group key."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from conftest import REPO
from dspark.errors import ConfigError
from dspark.export.adapter import family_adapters
from dspark.models import contract, registry
from dspark.training.modules import MODULES


def contract_problems(fam) -> list[str]:
    """What every registered family must meet (docs/design.md, "How to add a family")."""
    import dataclasses

    from dspark import schema

    problems = []
    if fam.draft.family_kind != fam.kind:
        problems.append("draft class does not carry its kind")
    if fam.objective not in MODULES:
        problems.append(f"objective {fam.objective!r} is not one of {sorted(MODULES)}")
    if fam.drafts_key not in fam.group_keys:
        problems.append(f"DRAFTS_KEY {fam.drafts_key!r} is not a group key")
    fields = {f.name for f in dataclasses.fields(fam.config)}
    if not set(fam.group_keys) <= fields:
        problems.append(f"group keys {sorted(set(fam.group_keys) - fields)} are not config fields")
    if set(fam.group_keys) & set(registry.NOT_CONFIG_KEYS):
        problems.append("a group key clashes with kind / init_from_target / arch")
    problems += contract.contract_problems(fam.config, fam.draft, fam.serving)  # its members
    if fam.default_target is not None and fam.default_target not in schema.TARGET_KINDS:
        problems.append(f"DEFAULT_TARGET {fam.default_target!r} is not a target kind")
    if not family_adapters(fam.kind) and not contract.optional(fam.config, "NOT_SERVED"):
        problems.append(f"no serving adapter in its record's serving module {fam.serving!r} (and no NOT_SERVED "
                        "reason)")
    return problems


def test_every_registered_family_meets_the_contract():
    fams = registry.families()
    assert fams, "no family registered"
    for kind, fam in fams.items():
        assert contract_problems(fam) == [], kind
    with pytest.raises(ConfigError, match="draft.kind: 'eagle2' is not one of"):
        registry.family("eagle2")


TOY = """
from dataclasses import dataclass
from typing import ClassVar

import torch.nn as nn

from dspark.models.common import DraftConfig, SharedTargetWeights
from dspark.models.mtp_common import ChainDraft
from dspark.models.registry import register


@dataclass(kw_only=True)
class ToyConfig(DraftConfig):
    GROUP_KEYS: ClassVar[tuple] = ("num_layers", "num_steps")
    DRAFTS_KEY: ClassVar[str] = "num_steps"
    DEFAULT_TARGET: ClassVar = "tiny_v4"
    NOT_SERVED: ClassVar[str] = "a test family"
    vllm_method: ClassVar[str] = "mtp"
    num_layers: int = 1
    num_steps: int = 2
    hidden_size: int = 0
    vocab_size: int = 0

    @property
    def block_size(self):
        return self.num_steps

    def validate(self):
        return self

    @classmethod
    def from_target_config(cls, hf_config, **keys):
        return cls(hidden_size=hf_config.hidden_size, vocab_size=hf_config.vocab_size, **keys)


@register("toy_mtp", config=ToyConfig, objective="mtp")
class ToyDraft(ChainDraft, SharedTargetWeights, nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
"""


def test_a_new_family_is_one_file_and_meets_the_contract(tmp_path, monkeypatch):
    """One new module in a folder of dspark.models' package path: the registry finds it, it meets the contract, and
    its draft group is checked by the schema (unknown keys refused) and built against a target config, with no other
    edit."""
    import dspark.models as models
    from transformers import AutoConfig

    from conftest import compose
    from dspark import schema
    from dspark.targets.tiny_v4 import TINY_V4_DIR

    (tmp_path / "toy_family.py").write_text(TOY)
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(tmp_path)])
    monkeypatch.setattr(registry, "_discovered", False)
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    monkeypatch.syspath_prepend(str(tmp_path))
    fam = registry.family("toy_mtp")
    assert contract_problems(fam) == []
    cfg = compose(["experiment=dsv4_mtp"])
    group = {"kind": "toy_mtp", "num_layers": 1, "num_steps": 3, "init_from_target": False, "arch": {}}
    cfg.draft = group
    schema.check_run_keys(cfg)
    built = registry.build_config(group, AutoConfig.from_pretrained(str(TINY_V4_DIR)))
    assert built.block_size == 3 and built.hidden_size > 0
    cfg.draft = {**group, "num_step": 3}
    with pytest.raises(ConfigError, match=r"draft\.num_step: unknown key \(did you mean draft\.num_steps\?\)"):
        schema.check_run_keys(cfg)


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


def _target_configs(tmp_path) -> dict:
    """{name: (HF config, tokenizer)} of every target architecture the project ships a config for: the tiny
    DeepSeek-V4 / V4.1 / HY V4 folders and a Llama (SmolLM2's architecture: the tiny dense target)."""
    from transformers import AutoConfig

    from dspark.targets import register_v41
    from dspark.targets.tiny_llama import build_tiny_llama

    register_v41()  # tiny_v41's model_type
    assets = REPO / "dspark" / "assets"
    folders = {name: assets / name for name in ("tiny_v4", "tiny_v41", "tiny_hy_v4")}
    folders["tiny_llama"] = build_tiny_llama(tmp_path / "llama")
    from transformers import AutoTokenizer

    return {name: (AutoConfig.from_pretrained(str(f), local_files_only=True),
                   AutoTokenizer.from_pretrained(str(f), local_files_only=True)) for name, f in folders.items()}


def test_a_draft_against_a_target_of_another_architecture_is_one_config_error(tmp_path):
    """Every shipped draft group against every shipped target architecture: the draft config builds, or the build
    stops with one ConfigError line naming the draft key (never an AttributeError from deep inside a family)."""
    import yaml

    groups = {p.stem: yaml.safe_load(p.read_text()) for p in sorted((REPO / "configs" / "draft").glob("*.yaml"))}
    refused = built = 0
    targets = _target_configs(tmp_path)
    for tname, (hf, tokenizer) in targets.items():
        for gname, group in groups.items():
            try:
                registry.build_config(group, hf, tokenizer)
                built += 1
            except ConfigError as e:
                assert str(e).startswith("draft.") and "\n" not in str(e), (gname, tname, str(e))
                refused += 1
    assert built and refused  # both outcomes occur: a real matrix, not all one way
    with pytest.raises(ConfigError, match=r"^draft\.kind: dspark_v41 drafts cannot be built against this target "
                                          r"\(model_type 'hy_v4'"):
        registry.build_config(groups["dspark_v41"], *targets["tiny_hy_v4"])


def test_an_adapter_declared_in_a_test_file_gets_its_export_subcommand(capsys):
    """The export command line is built from the registered serving adapters (issue 36): a format declared here
    alone, with no edit to dspark/export/__main__.py, is a `python -m dspark.export` subcommand with its own options."""
    import pytest as _pytest

    from dspark.export import adapter as ad
    from dspark.export.__main__ import main as export_main

    class ToyAdapter(ad.ServingAdapter):
        kind, cli, format, what = "toy_kind", "toy", "toy-format", "toy"
        cli_help = "export a toy draft"

        @classmethod
        def add_cli_args(cls, p) -> None:
            p.add_argument("--toy-knob", type=int, default=3, help="a toy option")

    with ad.temporary_adapter(ToyAdapter):  # after the real ones
        assert ad.cli_commands()["toy"] is ToyAdapter and ad.cli_kinds("toy") == {"toy_kind"}
        with _pytest.raises(SystemExit) as e:
            export_main(["toy", "--help"])
        assert e.value.code == 0 and "--toy-knob" in capsys.readouterr().out
        with _pytest.raises(SystemExit):
            export_main(["--help"])
        assert "export a toy draft" in capsys.readouterr().out
    assert "toy" not in ad.cli_commands()
