"""What the entry points (train.py, eval.py) keep off the console: third-party lines that tell a user nothing about
their run. Filters are installed in this process only, on the named loggers and messages; nothing else is muted."""
from __future__ import annotations

import logging
import warnings

# Lightning's advertising lines (logged by its rank_zero helpers at INFO).
LIGHTNING_TIP_PREFIX = "💡 Tip:"
LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
# Warnings about code that is not ours, or about what the run already handles.
QUIET_WARNINGS = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # torch 2.13 about Lightning's own _pytree.py
    # Lightning would log no train row before log_every_n_steps; callbacks.LogLastStep logs the last step
    r"The number of training batches \(\d+\) is smaller than the logging interval",
    # Lightning's size estimate under bf16-mixed; callbacks.OneLineModelSummary prints the parameter counts itself
    r"Precision bf16-mixed is not supported by the model summary",
)


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LIGHTNING_TIP_PREFIX)


def quiet_console() -> None:
    """Lightning's tips, the deprecation warnings above, and the weight-loading / dataset-saving progress bars of
    transformers and datasets. Idempotent."""
    for name in LIGHTNING_LOGGERS:
        lg = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in lg.filters):
            lg.addFilter(_DropTips())
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights: 100%|..." on every model load
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    try:
        from datasets.utils import logging as ds_logging

        ds_logging.disable_progress_bar()  # "Saving the dataset (1/1 shards)" when the chat dataset is cached
    except ImportError:  # pragma: no cover - data extra
        pass
