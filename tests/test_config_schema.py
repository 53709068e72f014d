"""The typed run config (dspark.schema, dspark.preflight, dspark.cli, dspark.training.resume): every key has one
owner; unknown keys (also `+`-added ones), wrong types and ranges fail in one line before any model loads; a resumed
run refuses a changed architecture and applies an allowed change for real."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TINY_RUN, compose
from dspark import schema
from dspark.errors import ConfigError
from dspark.preflight import check_training_config


def _train_cli(*args, cwd=REPO):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "train.py", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("args,message", [
    (["+train.lrr=1e-3"], "train.lrr: unknown key (did you mean train.lr?)"),
    (["trainer.max_stpes=5"], "trainer.max_stpes: unknown key (did you mean trainer.max_steps?)"),
    (["+trainer.max_stpes=5"], "trainer.max_stpes: unknown key (did you mean trainer.max_steps?)"),
    (["+draft.num_layer=2"], "draft.num_layer: unknown key (did you mean draft.num_layers?)"),
    (["experiment=dspark_v3"], "experiment=dspark_v3: no such option (configs/experiment/); did you mean "
                               "experiment=dspark_v4?"),
    (["train.lr=fast"], "train.lr: must be a number, got 'fast'"),
    (["data.source=csv"], "data.source: must be one of sharegpt, jsonl, regenerated, got 'csv'"),
    (["experiment=hyv4_mtp", "train.mtp_beta=-1"], "train.mtp_beta: must be > 0, got -1"),
    (["train.mtp_beta=0.5"], "train.mtp_beta: only another objective reads it"),
])
def test_the_command_line_fails_in_one_line_before_hydra_makes_a_run_dir(tmp_path, capsys, args, message):
    """In-process through train.py's own precheck (a subprocess per case costs ~20 s of imports under load; the
    real command line is run once by test_the_real_command_line_fails_in_one_line)."""
    sys.path.insert(0, str(REPO))
    try:
        import train
    finally:
        sys.path.remove(str(REPO))
    from dspark.cli import precheck

    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        precheck("config", "train.py", train._check, [*args, f"run_dir={run_dir}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [lines[0]] and lines[0].startswith("train.py: error: ") and message in lines[0], err
    assert not run_dir.exists()  # refused before Hydra created the run dir, before any model loaded


def test_the_real_command_line_fails_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    r = _train_cli("+train.lrr=1e-3", f"run_dir={run_dir}")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == ["train.py: error: train.lrr: unknown key (did you mean train.lr?)"], r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert not run_dir.exists()


def test_help_lists_groups_common_keys_and_examples():
    r = _train_cli("--help")
    assert r.returncode == 0
    for text in ("groups (group=option):", "experiment ", "dspark_v4", "train.lr", "trainer.max_steps",
                 "resume_override", "examples:"):
        assert text in r.stdout, text
    assert "Powered by Hydra" not in r.stdout


def test_every_yaml_key_of_every_experiment_is_in_the_schema():
    for exp in sorted(p.stem for p in (REPO / "configs" / "experiment").glob("*.yaml")):
        values = schema.check_run_keys(compose([f"experiment={exp}"]))
        assert values["experiment_name"] == exp


def test_a_value_of_the_wrong_type_or_range_names_its_key():
    cases = {"train.betas=[0.9]": "train.betas: must be two numbers", "data.limit=0": "data.limit: must be >= 1",
             "train.batch_size=2.5": "train.batch_size: must be an integer",
             "data.feature_cache_layout.encoding=int4": "data.feature_cache_layout.encoding: must be one of",
             "+callbacks.bad={patience: 3}": "callbacks.bad: needs a _target_",
             "+train.loss_weights.mse=1": "train.loss_weights: unknown keys ['mse']",
             "+draft.arch.hiden_size=8": "draft.arch.hiden_size: unknown key (did you mean draft.arch.hidden_size?)"}
    for override, message in cases.items():
        with pytest.raises(ConfigError) as e:
            schema.check_run_keys(compose([override]))
        assert message in str(e.value), (override, str(e.value))


def test_mtp_keys_are_checked_before_the_target_loads(monkeypatch):
    """(They were checked in MTPDraftModule.from_config, after the target had loaded.)"""
    import dspark.factory as factory

    monkeypatch.setattr(factory, "load_hf_target", lambda *a, **k: pytest.fail("the target loaded"))
    with pytest.raises(ConfigError, match=r"train\.mtp_loss_weights: unknown keys \['mse'\]"):
        check_training_config(compose(["experiment=dsv4_mtp", "+train.mtp_loss_weights.mse=1"]), [])
    with pytest.raises(ConfigError, match=r"data\.feature_cache: the cache stores no pre-hc_head stream"):
        check_training_config(compose(["experiment=dsv4_mtp", "data.feature_cache=auto"]), [])


# ---- resume -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    from dspark.training.run import run_training

    run_dir = tmp_path_factory.mktemp("resume") / "run"
    run_training(compose(TINY_RUN + [f"run_dir={run_dir}", "trainer.max_steps=2"]))
    return run_dir


@pytest.mark.parametrize("override,named", [
    ("draft.num_layers=2", "draft.num_layers: 1 in the checkpoint, 2 now"),
    ("train.lr=1e-4", "train.lr: 0.003 in the checkpoint, 0.0001 now); pass resume_override=[train.lr]"),
    ("seed=3", "seed: 0 in the checkpoint, 3 now): resume it with its own command: python train.py"),
])
def test_resume_refuses_a_changed_run_before_any_model_loads(finished_run, monkeypatch, override, named):
    import dspark.factory as factory
    from dspark.training.run import run_training

    monkeypatch.setattr(factory, "load_hf_target", lambda *a, **k: pytest.fail("the target loaded"))
    with pytest.raises(ConfigError, match="^resume: (the run config differs|this run was started with other)") as e:
        run_training(compose(TINY_RUN + [f"run_dir={finished_run}", "trainer.max_steps=2", "resume=last", override]))
    assert named in str(e.value)


@pytest.mark.parametrize("overrides,message", [
    (["trainer.max_steps=5"], r"^resume: this run finished at step 2 \(trainer.max_steps=2\); this config says "
                              r"trainer.max_steps=5.*resume_override=\[trainer.max_steps\] to train on to step 5$"),
    (["trainer.max_steps=1"], r"^resume: trainer.max_steps=1 is below the checkpoint's step 2"),
])
def test_a_finished_run_is_not_trained_on_unless_asked(finished_run, monkeypatch, overrides, message):
    import dspark.factory as factory
    from dspark.training.run import run_training

    monkeypatch.setattr(factory, "load_hf_target", lambda *a, **k: pytest.fail("the target loaded"))
    with pytest.raises(ConfigError, match=message):
        run_training(compose(TINY_RUN + [f"run_dir={finished_run}", "resume=last", *overrides]))


def test_resume_override_is_applied_to_the_restored_optimizer(finished_run):
    """A resume_override of train.lr reaches AdamW and the schedule restored from the checkpoint (without the
    rewrite, the checkpoint's base lr 3e-3 would keep running)."""
    from lightning.pytorch.callbacks import Callback

    from dspark.training.module import warmup_cosine
    from dspark.training.run import run_training

    seen = {}

    class Probe(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if "lr" not in seen:
                seen["step"] = trainer.global_step
                seen["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
                seen["base"] = trainer.lr_scheduler_configs[0].scheduler.base_lrs[0]

    run_training(compose(TINY_RUN + [f"run_dir={finished_run}", "trainer.max_steps=4", "resume=last",
                                     "resume_override=[train.lr,trainer.max_steps]", "train.lr=1e-4"]), callbacks=(Probe(),))
    assert seen["step"] == 2 and seen["base"] == pytest.approx(1e-4)
    # the finished 2-step schedule extended to 4 steps continues its decay from its floor (dspark.training.schedule)
    assert seen["lr"] == pytest.approx(1e-4 * warmup_cosine(2, 2, 0.04, 0.05)) == pytest.approx(1e-4 * 0.05)
    ckpt = torch.load(str(finished_run / "checkpoints" / "last.ckpt"), map_location="cpu", weights_only=True)
    assert ckpt["hyper_parameters"]["train"]["lr"] == pytest.approx(1e-4) and ckpt["global_step"] == 4


def test_resume_override_of_an_architecture_key_is_refused(finished_run):
    from dspark.training.run import run_training

    with pytest.raises(ConfigError, match=r"resume_override: \['draft.num_layers'\] cannot change on resume"):
        run_training(compose(TINY_RUN + [f"run_dir={finished_run}", "resume=last",
                                         "resume_override=[draft.num_layers]", "draft.num_layers=2"]))


def test_a_missing_regenerated_file_names_the_shipped_data_and_how_to_unpack_it():
    """experiment=dspark_smollm2 on a fresh clone: data/regenerated/ does not exist yet. The one-line error names the
    packed conversations the repository ships and the command that unpacks them (and the packed file is there)."""
    cfg = compose(["experiment=dspark_smollm2", "data.path=data/regenerated/nowhere.jsonl"])
    with pytest.raises(ConfigError, match="data.path") as err:
        check_training_config(cfg, [])
    text = str(err.value)
    assert "scripts/pack_regenerated.py unpack smollm2_sharegpt_5k" in text and "scripts/regenerate.py" in text
    assert (REPO / "benchmarks" / "data" / "smollm2_sharegpt_5k.jsonl.gz").is_file()
    assert "\n" not in text


def test_the_package_metadata_builds_without_a_license_deprecation(tmp_path):
    """pyproject's license is an SPDX string (a `{text = ...}` table makes setuptools print a deprecation warning on
    every install, three times in CI): building the metadata prints no license warning."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(tmp_path), str(REPO)],
                       capture_output=True, text=True, timeout=600)  # pip's isolated build, as install -e runs it
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "project.license" not in out and "License classifiers are deprecated" not in out, out[-2000:]
    assert list(tmp_path.glob("dspark-*.whl"))


@pytest.mark.parametrize("experiment", ["dspark_v4", "hyv4_mtp"])
def test_the_typed_run_config_holds_every_key_as_the_dictconfig_did(experiment):
    """schema.run_config: the typed sections read like the yaml (target / data / train typed, the objective's keys
    apart and typed by the draft's objective, the draft as its family's Config resolved against the target plus the
    warm-start keys), and `values()` gives back exactly the plain config the DictConfig resolves to with the draft
    group resolved (what checkpoints' hyper_parameters held before, so that an older run resumes against it); built
    from those values again, it is the same run config."""
    import dataclasses

    from omegaconf import OmegaConf

    from dspark.models import registry
    from dspark.training.modules import MODULES

    cfg = compose([f"experiment={experiment}", "run_dir=/tmp/unused", "train.lr=0.002",
                   "data.feature_cache_layout.encoding=fp8_e4m3"])
    run = schema.run_config(cfg)
    assert isinstance(run.target, schema.TargetKeys) and isinstance(run.data, schema.DataKeys)
    assert isinstance(run.train, schema.TrainKeys) and isinstance(run.data.feature_cache_layout, schema.CacheLayoutKeys)
    assert run.train.lr == 0.002 and run.data.feature_cache_layout.encoding == "fp8_e4m3"
    assert run.target.kind == cfg.target.kind and run.draft_family.kind == cfg.draft.kind
    assert isinstance(run.draft, registry.family(cfg.draft.kind).config)
    assert run.draft_start == schema.DraftStartKeys(init_from_target=cfg.draft.init_from_target)
    assert set(run.objective) == set(cfg.train) - set(schema.keys_of(schema.TrainKeys))
    keys_cls = MODULES[run.draft_family.objective].KEYS
    keys = schema.typed(keys_cls, run.objective)
    assert dataclasses.asdict(keys) == {k: OmegaConf.to_container(cfg.train, resolve=True)[k]
                                        for k in schema.keys_of(keys_cls)}
    plain = OmegaConf.to_container(cfg, resolve=True)
    group = plain.pop("draft")
    values = run.values()
    resolved = values.pop("draft")
    assert values == plain
    assert all(resolved[k] == v for k, v in group.items() if k != "arch" and v is not None)  # nulls resolved
    assert set(resolved) == {"kind", *registry.family(group["kind"]).group_keys, *schema.keys_of(schema.DraftStartKeys),
                             "arch"}
    again = schema.run_config(run.values())
    assert again == run and again.values() == run.values()  # the saved form round-trips
    assert schema.run_config(run) is run  # built once, then passed on as it is


def test_the_typed_run_config_refuses_what_the_schema_refuses():
    cfg = compose(["experiment=dspark_v4"])
    cfg.train.lr = "fast"
    with pytest.raises(ConfigError, match="train.lr"):
        schema.run_config(cfg)
