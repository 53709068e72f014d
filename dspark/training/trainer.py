"""The Lightning Trainer from the config: `trainer` (every Trainer argument), `callbacks` and `logger` (groups of
`_target_` nodes, instantiated by Hydra). Nothing here adds or renames a Trainer argument; one value is added to
`precision`: `auto` = what the machine computes fastest (bf16-mixed on a GPU, and on CPUs with AMX / AVX512-BF16;
32-true on other CPUs, where bf16 is emulated), said in one line at the start (:func:`resolve_precision`)."""
from __future__ import annotations

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ModelSummary

import logging

import torch

import dspark.training.sharding  # noqa: F401  (registers the "fsdp2" strategies with Lightning)
from dspark.cpu import fast_cpu_dtype
from dspark.errors import ConfigError
from dspark.schema import RunConfig, run_config
from dspark.training.callbacks import LogLastStep, OneLineModelSummary, step_progress_bar


logger = logging.getLogger(__name__)


def resolve_precision(precision, accelerator) -> tuple[str, str]:
    """``(precision, why)``: ``auto`` resolved for the accelerator at hand, any other value as given."""
    if str(precision) != "auto":
        return precision, "trainer.precision"
    on_gpu = str(accelerator) in ("gpu", "cuda") or (str(accelerator) == "auto" and torch.cuda.is_available())
    if on_gpu:
        return "bf16-mixed", "a GPU"
    choice = fast_cpu_dtype()
    return choice.precision, choice.reason


def instantiate_group(nodes: dict | None, group: str) -> list:
    """One object per non-null `<group>.<name>` node (a `_target_` and its keyword arguments), in order (the nodes'
    shape is checked by dspark.schema before any model loads)."""
    out = []
    for name, spec in (nodes or {}).items():
        if spec is None:
            continue
        try:
            out.append(instantiate(spec, _convert_="all"))
        except InstantiationException as e:
            raise ConfigError(f"{group}.{name}: {e}") from e
    return out


def build_loggers(run: RunConfig) -> list:
    return instantiate_group(run_config(run).logger, "logger")


def make_trainer(run: RunConfig, callbacks: list[Callback], plugins: list) -> Trainer:
    """Trainer(**run.trainer) with the callbacks group + `callbacks` (the run's own), the logger group and
    `plugins`. The progress bar counts steps (callbacks.step_progress_bar) when trainer.enable_progress_bar; the
    model summary is one log line (callbacks.OneLineModelSummary) unless trainer.enable_model_summary is set; the
    last step's train metrics and lr are logged even when log_every_n_steps does not divide max_steps."""
    run = run_config(run)
    kwargs = dict(run.trainer)
    if str(kwargs.get("precision")) == "auto":
        kwargs["precision"], why = resolve_precision("auto", kwargs.get("accelerator", "auto"))
        logger.info("trainer.precision=auto: %s (%s)", kwargs["precision"], why)
    trainer_cls = get_class(kwargs.pop("_target_", "lightning.pytorch.Trainer"))
    cbs = [*callbacks, *instantiate_group(run.callbacks, "callbacks")]  # the run's own first: they fix the logging step
    if kwargs.get("enable_checkpointing") is False:  # Lightning refuses a ModelCheckpoint then
        cbs = [c for c in cbs if not isinstance(c, ModelCheckpoint)]
    if kwargs.get("enable_progress_bar", True) is not False:
        cbs.append(step_progress_bar())
    if kwargs.get("enable_model_summary") is None and not kwargs.get("barebones"):
        if not any(isinstance(c, ModelSummary) for c in cbs):  # Lightning's default table, as one line, no FLOPs
            cbs.append(OneLineModelSummary())
        kwargs["enable_model_summary"] = False  # (True would log that a summary callback is there already)
    cbs.append(LogLastStep())  # the last step's train loss and lr, whatever log_every_n_steps says
    return trainer_cls(**kwargs, callbacks=cbs, logger=build_loggers(run), plugins=plugins)
