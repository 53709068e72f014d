"""The run's own Lightning callbacks: throughput over the timed steps, a progress bar that counts optimizer
steps, the last step's train metrics and lr logged whatever log_every_n_steps says, a one-line model summary, and
one print per Lightning log line under Hydra."""
from __future__ import annotations

import copy
import logging
import resource
import time

import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelSummary, RichProgressBar, TQDMProgressBar

from dspark.training import flops


class Throughput(Callback):
    """Tokens/s, blocks/s and peak memory over the training steps (first `skip` steps excluded), and the step's FLOPs,
    loss tokens per second and MFU against an LM-head GEMM's peak measured in this process at the end of training
    (same dtype as the trainer's precision, same thread count).

    A dense block draft's FLOPs are counted from each timed batch's shapes (dspark.training.flops). Any other draft's
    (EAGLE-3, MTP heads, V4 / DFlash2 / XPress block drafts) by torch's FlopCounterMode on one more training step,
    run after training on the last timed batch with a copy of the draft (one process only): a counter around a real
    step changes its numerics (measured: the default run's tau_prob moved in the 3rd decimal), so no step of the run
    is counted, and the run's draft, gradients and random state are left as they were. Its achieved FLOP/s are that
    step's FLOPs per token times the timed tokens/s."""

    def __init__(self, skip: int = 3, peak_budget_s: float = 1.0):
        self.skip, self.t0, self.n = skip, None, 0
        self.tokens = self.blocks = 0
        self.elapsed = 0.0
        self.peak_budget_s = peak_budget_s
        self.flops: dict[str, int] = {}  # part -> sum over the counted steps
        self.flop_steps = self.loss_tokens = self.flop_tokens = 0  # counted steps, their loss tokens and tokens
        self.sample: dict | None = None  # the last timed batch of a draft counted by replay
        self.peak: dict | None = None
        self.start_step = 0

    def on_train_start(self, trainer, pl_module):
        self.start_step = int(trainer.global_step)  # a resumed run's segment starts at its checkpoint's step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.n += 1
        if self.n <= self.skip or self.t0 is None:
            return
        self.elapsed += time.perf_counter() - self.t0
        self.tokens += int(batch["attention_mask"].sum())
        self.blocks += int(batch["keep"].sum())
        if not flops.is_dense_block_module(pl_module):
            self.sample = batch  # counted once, after training (replay_flops)
            return
        parts, shapes = flops.module_step_flops(pl_module, batch, self._optimizer_share(trainer))
        self._add(parts, shapes.loss_rows, batch)  # after the clock stopped: not part of the step's time

    @staticmethod
    def _optimizer_share(trainer) -> float:
        return 1.0 / max(1, trainer.accumulate_grad_batches)  # the optimizer runs once per accumulated batches

    def _add(self, parts: dict[str, int], loss_tokens: int, batch) -> None:
        for k, v in parts.items():
            self.flops[k] = self.flops.get(k, 0) + v
        self.flop_steps += 1
        self.loss_tokens += int(loss_tokens)
        self.flop_tokens += int(batch["attention_mask"].sum())

    def replay_flops(self, trainer, pl_module) -> None:
        """FlopCounterMode over one more training step (forward and the parameters' gradients) on the last timed batch,
        with a copy of the draft (the target's shared weights not copied) and the random state forked: the run's own
        draft, its .grad and the random streams are untouched."""
        from torch.utils.flop_counter import FlopCounterMode

        batch, draft = self.sample, pl_module.draft
        shared = [t for t in (getattr(pl_module.target, "embed_weight", None),
                              getattr(pl_module.target, "lm_head_weight", None)) if t is not None]
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        try:
            pl_module.draft = copy.deepcopy(draft, memo={id(t): t for t in shared})
            params = [p for p in pl_module.draft.parameters() if p.requires_grad]
            with torch.random.fork_rng(devices=devices), FlopCounterMode(display=False) as counter:
                with trainer.precision_plugin.forward_context():
                    loss = pl_module.training_losses(batch)["loss"]
                torch.autograd.grad(loss, params, allow_unused=True)
        finally:
            pl_module.draft = draft
        parts = flops.counted_step_flops(pl_module, counter.get_total_flops(), self._optimizer_share(trainer))
        self._add(parts, flops.step_loss_tokens(pl_module, batch), batch)

    def on_train_end(self, trainer, pl_module):
        log = logging.getLogger("dspark.train")
        if self.sample is not None and trainer.world_size == 1:
            try:  # a measurement: it never fails the run it measures (the draft is written after fit)
                self.replay_flops(trainer, pl_module)
            except Exception as e:  # noqa: BLE001
                log.warning("throughput: no FLOP count (%s: %s)", type(e).__name__, e)
        self.sample = None
        if not (self.flop_steps and trainer.is_global_zero):
            return
        try:
            self.peak = self.measure_peak(trainer, pl_module)
        except Exception as e:  # noqa: BLE001
            log.warning("throughput: no GEMM peak, so no mfu (%s: %s)", type(e).__name__, e)

    def measure_peak(self, trainer, pl_module) -> dict:
        """The GEMM peak (dspark.training.flops.gemm_peak) at the draft's LM-head shape and the trainer's precision."""
        cfg = pl_module.draft.config
        vocab = int(getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size)
        return flops.gemm_peak(int(cfg.hidden_size), vocab, flops.precision_dtype(trainer.precision),
                               device=pl_module.device, budget_s=self.peak_budget_s)

    def flop_summary(self) -> dict:
        """flops_per_step (mean by part), flop_counted_steps, loss_tokens_per_step / _per_s, achieved_gflops, mfu,
        gemm_peak_*, threads; {} when nothing was counted or timed. Achieved FLOP/s = the counted steps' FLOPs per
        token x the timed tokens/s (for a dense block draft the counted steps are the timed ones)."""
        if not self.flop_steps or self.elapsed <= 0 or not self.flop_tokens:
            return {}
        per_step = {k: round(v / self.flop_steps) for k, v in self.flops.items()}
        tokens_per_s = self.tokens / self.elapsed
        achieved = self.flops["total"] / self.flop_tokens * tokens_per_s  # FLOP/s
        out = {"flops_per_step": per_step, "flop_counted_steps": self.flop_steps,
               "loss_tokens_per_step": round(self.loss_tokens / self.flop_steps, 1),
               "loss_tokens_per_s": round(self.loss_tokens / self.flop_tokens * tokens_per_s, 1),
               "achieved_gflops": round(achieved / 1e9, 3)}
        if self.peak is not None:
            out.update(mfu=round(achieved / (self.peak["gflops"] * 1e9), 6), gemm_peak_gflops=self.peak["gflops"],
                       gemm_peak_dtype=self.peak["dtype"], gemm_peak_shape=self.peak["shape"],
                       threads=self.peak["threads"])
        return out

    def merged(self, previous: dict | None, end_step: int) -> dict:
        """metrics.json's `throughput` after this segment of the run (steps start_step..end_step), given the one it
        held (`previous`). Each segment keeps its own figures, never averaged: segments may run on other machines,
        thread counts or batch shapes, and MFU is against each one's own GEMM peak. A segment that timed no step (a
        finished run resumed only for its end-of-run steps, or a resume of a few steps) leaves `previous` as it was;
        one that did becomes `throughput` (with `steps`: [first, last]) and the earlier segments that timed steps go
        to its `earlier` list, oldest first."""
        now = {**self.summary(), "steps": [self.start_step, int(end_step)]}
        previous = dict(previous or {})
        if not now["timed_steps"]:
            return previous or now
        earlier = previous.pop("earlier", [])
        if previous.get("timed_steps"):
            earlier.append(previous)
        return {**now, "earlier": earlier} if earlier else now

    def summary(self) -> dict:
        peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out = {"timed_steps": max(0, self.n - self.skip), "peak_rss_mb": round(peak_rss_mb, 1)}
        if self.elapsed > 0:
            out.update(tokens_per_s=round(self.tokens / self.elapsed, 1),
                       blocks_per_s=round(self.blocks / self.elapsed, 1),
                       s_per_step=round(self.elapsed / max(1, self.n - self.skip), 4))
        out.update(self.flop_summary())
        if torch.cuda.is_available():
            out["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        return out


class LogLastStep(Callback):
    """Lightning logs the train metrics (and LearningRateMonitor the lr) every trainer.log_every_n_steps steps, so a
    run whose length is not a multiple of it (trainer.max_steps=5 with the default 10) ends with its last train loss
    and lr nowhere. This logs them at the last step, at the step and with the keys Lightning would use, when
    Lightning does not."""

    def __init__(self):
        self._lr: dict | None = None

    @staticmethod
    def _last_step_unlogged(trainer) -> bool:
        step = trainer.fit_loop.epoch_loop._batches_that_stepped + 1  # the optimizer step under way, 1-based
        return (trainer.max_steps > 0 and step == trainer.max_steps and trainer.log_every_n_steps > 0
                and not trainer._logger_connector.should_update_logs)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._lr = None
        if not trainer.loggers or not self._last_step_unlogged(trainer):
            return
        for cb in trainer.callbacks:  # the lr of this step, as the monitor reads it before the step
            if isinstance(cb, LearningRateMonitor) and cb.logging_interval != "epoch":
                self._lr = cb._extract_stats(trainer, "step" if cb.logging_interval is None else "any")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step < trainer.max_steps or not trainer.loggers or not self._last_step_unlogged(trainer):
            return  # not the last optimizer step (or its accumulation is not done), or Lightning logs it
        connector = trainer._logger_connector
        metrics = dict(connector.metrics["log"])
        if self._lr:
            metrics.update(self._lr)
        if metrics:
            connector.log_metrics(metrics)  # step = the step Lightning logs this batch's row at; adds `epoch`
        self._lr = None


class OneLineModelSummary(ModelSummary):
    """Lightning's model summary as one log line (it also reaches train.log): its table shows a FLOPs column and a
    "Total FLOPs: 0" line that nothing here measures."""

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops=0, **summarize_kwargs) -> None:
        from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

        columns = dict(summary_data)
        parts = [f"{n} ({t}, {p})" for n, t, p in zip(columns.get("Name", []), columns.get("Type", []),
                                                      columns.get("Params", []))]
        logging.getLogger("dspark.train").info(
            "model: %s; draft parameters: %s trainable, %s frozen (the frozen target is not part of the model: it is "
            "never trained or checkpointed); %.1f MB", ", ".join(parts) or "-",
            get_human_readable_count(int(trainable_parameters)).strip(),
            get_human_readable_count(int(total_parameters - trainable_parameters)).strip(), model_size)


class _StepCount:
    """Lightning's bars count the batches of an epoch and label them "Epoch e/max_epochs-1" ("Epoch 0/-2" for a
    run bounded by max_steps) and show the logger version as v_num. This one shows optimizer steps done out of
    trainer.max_steps (right after a resume too) and no v_num."""

    @property
    def total_train_batches(self):
        return self.trainer.max_steps

    def _get_train_description(self, current_epoch: int) -> str:
        return "Training steps"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # the base bars draw batch_idx + 1: hand them the step count instead
        super().on_train_batch_end(trainer, pl_module, outputs, batch, trainer.global_step - 1)

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


class RichStepProgressBar(_StepCount, RichProgressBar):
    pass


class TQDMStepProgressBar(_StepCount, TQDMProgressBar):
    def on_train_epoch_start(self, trainer, *args):
        super().on_train_epoch_start(trainer, *args)  # labels the bar "Epoch e": relabel
        self.train_progress_bar.set_description(self._get_train_description(trainer.current_epoch))


def step_progress_bar() -> Callback:
    """The bar Lightning would pick (rich when installed, else tqdm), counting steps."""
    from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE

    return RichStepProgressBar() if _RICH_AVAILABLE else TQDMStepProgressBar()


def print_lightning_logs_once() -> None:
    """The `lightning` package logs through its own console handler and also propagates to the root logger;
    under Hydra (whose job logging owns the root logger and the run's log file) every line printed twice.
    With a root handler present, Lightning's own console handler goes and the lines print once, via Hydra."""
    if not logging.getLogger().hasHandlers():
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            if type(h) is logging.StreamHandler:
                lg.removeHandler(h)
        lg.propagate = True
