"""The Lightning Trainer from the config: `trainer` (every Trainer argument), `callbacks` and `logger` (groups of
`_target_` nodes, instantiated by Hydra). Nothing here adds or renames a Trainer argument."""
from __future__ import annotations

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from dspark.factory import ConfigError, require
from dspark.training.callbacks import step_progress_bar


def instantiate_group(cfg: DictConfig, group: str) -> list:
    """One object per non-null `<group>.<name>` node (a `_target_` and its keyword arguments), in order."""
    node = cfg.get(group)
    if node is None:
        return []
    require(OmegaConf.is_dict(node), group, "must map names to {_target_: ..., ...} nodes")
    out = []
    for name, spec in node.items():
        key = f"{group}.{name}"
        if spec is None:
            continue
        require(OmegaConf.is_dict(spec) and "_target_" in spec, key, "needs a _target_ (a class path) or null")
        if str(spec._target_).endswith("WandbLogger"):
            import importlib.util

            require(importlib.util.find_spec("wandb") is not None, key, "W&B needs `pip install dspark[wandb]`")
        try:
            out.append(instantiate(spec, _convert_="all"))
        except InstantiationException as e:
            raise ConfigError(f"{key}: {e}") from e
    return out


def build_loggers(cfg: DictConfig) -> list:
    return instantiate_group(cfg, "logger")


def make_trainer(cfg: DictConfig, callbacks: list[Callback], plugins: list) -> Trainer:
    """Trainer(**cfg.trainer) with the callbacks group + `callbacks` (the run's own), the logger group and
    `plugins`. The progress bar counts steps (callbacks.step_progress_bar) when trainer.enable_progress_bar."""
    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer_cls = get_class(kwargs.pop("_target_", "lightning.pytorch.Trainer"))
    if str(kwargs.get("strategy", "")).startswith("deepspeed"):
        try:
            import deepspeed  # noqa: F401
        except ImportError as e:
            raise ConfigError("trainer.strategy: DeepSpeed needs `pip install dspark[deepspeed]`") from e
    require(not kwargs.get("use_distributed_sampler"), "trainer.use_distributed_sampler",
            "must stay false: ChatDataModule shards, shuffles and resumes its own batches")
    cbs = [*instantiate_group(cfg, "callbacks"), *callbacks]
    if kwargs.get("enable_checkpointing") is False:  # Lightning refuses a ModelCheckpoint then
        cbs = [c for c in cbs if not isinstance(c, ModelCheckpoint)]
    if kwargs.get("enable_progress_bar", True) is not False:
        cbs.append(step_progress_bar())
    return trainer_cls(**kwargs, callbacks=cbs, logger=build_loggers(cfg), plugins=plugins)
