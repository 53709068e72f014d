"""One source of truth for the Trainer: configs/trainer holds every lightning.pytorch.Trainer argument (so any
`trainer.<key>=` override works the way Lightning users type it), callbacks and loggers are `_target_` groups."""
from __future__ import annotations

import inspect

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint, ProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from omegaconf import OmegaConf

from conftest import REPO, compose
from dspark.errors import ConfigError
from dspark.preflight import check_training_config
from dspark.training.callbacks import RichStepProgressBar, TQDMStepProgressBar
from dspark.training.trainer import build_loggers, make_trainer

FROM_GROUPS = {"callbacks", "logger", "plugins"}  # built from the callbacks / logger groups and the run


def _trainer(tmp_path, *overrides):
    return make_trainer(compose([f"run_dir={tmp_path}", *overrides]), [], [])


def test_trainer_group_lists_every_lightning_trainer_argument():
    keys = set(OmegaConf.load(REPO / "configs" / "trainer" / "default.yaml")) - {"_target_"}
    lightning_args = set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"} - FROM_GROUPS
    assert keys == lightning_args, (f"missing: {sorted(lightning_args - keys)}; "
                                    f"not Trainer arguments: {sorted(keys - lightning_args)}")


def test_trainer_keys_override_as_lightning_users_type_them(tmp_path):
    tr = _trainer(tmp_path, "trainer.max_steps=5", "trainer.accumulate_grad_batches=2", "trainer.val_check_interval=4",
                  "trainer.gradient_clip_val=0.5", "trainer.log_every_n_steps=3", "trainer.limit_val_batches=2")
    assert (tr.max_steps, tr.accumulate_grad_batches, tr.val_check_interval) == (5, 2, 4)
    assert (tr.gradient_clip_val, tr.log_every_n_steps, tr.limit_val_batches) == (0.5, 3, 2)
    assert check_training_config(compose(["trainer.max_steps=5"]), []).trainer["max_steps"] == 5
    for preset in ("gpu", "ddp", "deepspeed_zero2"):  # every preset keeps every key
        assert compose([f"trainer={preset}", "trainer.max_steps=5"]).trainer.max_steps == 5


@pytest.mark.parametrize("override,key", [("trainer.max_steps=-1", "trainer.max_steps"),
                                          ("trainer.use_distributed_sampler=true", "trainer.use_distributed_sampler")])
def test_trainer_values_the_run_cannot_honour_are_refused_by_key(tmp_path, override, key):
    cfg = compose([f"run_dir={tmp_path}", override])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_training_config(cfg, [])  # refused before any model loads (dspark.preflight)


def test_default_callbacks(tmp_path):
    tr = _trainer(tmp_path)
    ckpts = [c for c in tr.callbacks if isinstance(c, ModelCheckpoint)]
    best = [c for c in ckpts if c.monitor == "val/tau_prob"]
    assert len(best) == 1 and best[0].mode == "max" and best[0].save_top_k == 1
    assert all(c.dirpath == str(tmp_path / "checkpoints") for c in ckpts)
    assert any(c.save_last for c in ckpts)  # checkpoints/last.ckpt for resume=last
    assert any(isinstance(c, LearningRateMonitor) for c in tr.callbacks)
    assert not any(isinstance(c, EarlyStopping) for c in tr.callbacks)
    bars = [c for c in tr.callbacks if isinstance(c, ProgressBar)]
    assert len(bars) == 1 and isinstance(bars[0], (RichStepProgressBar, TQDMStepProgressBar))


def test_callback_group_options(tmp_path):
    es = [c for c in _trainer(tmp_path, "callbacks=early_stopping").callbacks if isinstance(c, EarlyStopping)]
    assert len(es) == 1 and es[0].monitor == "val/tau_prob" and es[0].mode == "max"
    tr = _trainer(tmp_path, "callbacks.lr_monitor=null", "trainer.enable_checkpointing=false",
                  "trainer.enable_progress_bar=false")
    assert not any(isinstance(c, (LearningRateMonitor, ModelCheckpoint, ProgressBar)) for c in tr.callbacks)
    with pytest.raises(ConfigError, match=r"callbacks\.bad: needs a _target_"):
        check_training_config(compose([f"run_dir={tmp_path}", "+callbacks.bad={patience: 3}"]), [])


def test_logger_groups(tmp_path):
    csv = build_loggers(compose([f"run_dir={tmp_path}"]))
    assert [type(x) for x in csv] == [CSVLogger] and csv[0].log_dir.startswith(str(tmp_path / "logs"))
    both = build_loggers(compose([f"run_dir={tmp_path}", "logger=tensorboard"]))
    assert [type(x) for x in both] == [CSVLogger, TensorBoardLogger]
    wandb = compose([f"run_dir={tmp_path}", "logger=wandb", "logger.wandb.entity=me", "logger.wandb.group=g",
                     "logger.wandb.tags=[a,b]"]).logger.wandb
    assert (wandb.entity, wandb.group, list(wandb.tags)) == ("me", "g", ["a", "b"])  # WandbLogger -> wandb.init
    try:
        import wandb as _  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"logger\.wandb: .*pip install dspark\[wandb\]"):
            check_training_config(compose([f"run_dir={tmp_path}", "logger=wandb"]), [])
