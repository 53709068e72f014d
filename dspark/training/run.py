"""`train.py` body: config -> target, draft, data -> Lightning fit -> checkpoint, metrics, exported draft."""
from __future__ import annotations

import json
import logging
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from omegaconf import DictConfig, OmegaConf

from dspark import factory
from dspark.integrity import check_file, remove_checked, write_checked
from dspark.io import atomic_write_json
from dspark.training import draft_dir
from dspark.training.callbacks import Throughput
from dspark.training.run_dir import claim_run_dir, is_launcher_process
from dspark.training.trainer import make_trainer

log = logging.getLogger("dspark.train")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Each checkpoint is written to a temp file and renamed (a crash never leaves a torn .ckpt), with a
    `<ckpt>.sha256.json` beside it; loading checks it and unpickles with weights_only=True whatever the
    environment says (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD), so a damaged or foreign file is refused, never run."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        import io

        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        write_checked(Path(path), buf.getbuffer())

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        check_file(Path(path), hint=CKPT_HINT)
        return torch.load(str(path), map_location=map_location or "cpu", weights_only=True)

    def remove_checkpoint(self, path) -> None:
        remove_checked(Path(path))


CKPT_HINT = "resume from an earlier checkpoint (resume=<path to a stepNNNNNNN.ckpt>) or start a new run_dir"


class LogsFollowCheckpoints(Callback):
    """After a kill, the logs are never behind the checkpoint the run resumes from.

    Loggers are flushed whenever a checkpoint is saved (the CSV logger also writes every step). Lightning saves
    a step's checkpoint just BEFORE it logs that step's row, so the checkpoint carries that row
    (`dspark_log_row`: step + metrics) and a run resumed from it logs the row again first: a kill between the
    two loses nothing (a row written twice has the same values, and readers keep the later one)."""

    KEY = "dspark_log_row"

    def __init__(self):
        self._pending: dict | None = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        for logger in trainer.loggers:
            logger.save()
        metrics = trainer._logger_connector.metrics["log"]  # the row Lightning logs right after this save
        checkpoint[self.KEY] = {"step": int(trainer.fit_loop.epoch_loop._batches_that_stepped),
                                "metrics": {k: float(v) for k, v in metrics.items()}}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self._pending = checkpoint.get(self.KEY)

    def on_train_start(self, trainer, pl_module):
        row, self._pending = self._pending, None
        if row and row["metrics"] and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(row["metrics"], step=row["step"])
                logger.save()


def build_trainer(cfg: DictConfig, run_dir: Path, callbacks: list[Callback]) -> L.Trainer:
    """cfg.trainer / callbacks / logger -> Trainer (dspark.training.trainer), with the atomic checkpoint IO."""
    t = OmegaConf.to_container(cfg.trainer, resolve=True)
    plugins = [] if str(t.get("strategy", "")).startswith("deepspeed") else [AtomicCheckpointIO()]
    return make_trainer(cfg, callbacks, plugins)


def resolve_resume(cfg: DictConfig, run_dir: Path) -> str | None:
    """The checkpoint to resume from (checked against its checksum now, before any model loads), or None for a
    fresh run; a fresh run refuses a run_dir that already holds another run's checkpoints or draft."""
    if cfg.resume in (None, "", False):
        if is_launcher_process():
            used = [p.name for p in (run_dir / "checkpoints", run_dir / draft_dir.DRAFT_DIR)
                    if p.is_dir() and any(not f.name.startswith(".") for f in p.iterdir())]
            factory.require(not used, "run_dir",
                            f"{run_dir} already holds a run ({', '.join(used)}/): resume it with resume=last, "
                            "or choose another run_dir=")
        return None
    path = run_dir / "checkpoints" / "last.ckpt" if cfg.resume == "last" else Path(str(cfg.resume))
    factory.require(path.is_file(), "resume", f"checkpoint {str(path)!r} does not exist")
    check_file(path, hint=CKPT_HINT)
    return str(path)


def target_record(cfg: DictConfig, fingerprint: str | None) -> dict:
    """draft/target.json: the target a draft was trained against (eval.py refuses other weights)."""
    return {"kind": str(cfg.target.kind), "path": None if cfg.target.path is None else str(cfg.target.path),
            "fingerprint": fingerprint}


def export_draft(draft: torch.nn.Module, cfg: DictConfig, out_dir: Path, fingerprint: str | None = None) -> None:
    """A complete, sealed draft/ folder in one call (what a finished run leaves behind)."""
    draft_dir.write_weights_and_config(draft, OmegaConf.to_container(cfg.draft, resolve=True), out_dir)
    draft_dir.seal(out_dir, target_record(cfg, fingerprint))


def final_report(summary: dict, run_dir: Path, seconds: float) -> str:
    """The run's last console lines: where the outputs are and what the held-out result was, in words."""
    final, step0 = summary.get("final", {}), summary.get("step0", {})
    lines = [f"dspark: training finished at step {summary.get('global_step')} in {seconds:.0f} s."]
    tau = final.get("val/tau_prob")
    if tau is not None:
        before = step0.get("val/tau_prob")
        was = f" (before training: {before:.3f})" if before is not None else ""
        lines.append(f"  held-out expected acceptance length tau_prob = {tau:.3f}{was}, "
                     f"incl. the bonus token; per-position agreement: "
                     + ", ".join(f"{k.removeprefix('val/agree_')}: {v:.2f}" for k, v in sorted(final.items())
                                 if k.startswith("val/agree_")))
    lines += [f"  trained draft:  {run_dir / draft_dir.DRAFT_DIR}/ (weights, config, target record, checksums)",
              f"  checkpoints:    {run_dir / 'checkpoints'}/last.ckpt (resume: run_dir={run_dir} resume=last)",
              f"  metrics:        {run_dir / 'metrics.json'}, logs under {run_dir / 'logs'}/",
              f"  next:           python eval.py run_dir={run_dir}"]
    return "\n".join(lines)


def run_training(cfg: DictConfig, callbacks: tuple[Callback, ...] = ()) -> dict:
    """Runs (or resumes) one training job; `callbacks` are extra Lightning callbacks (tests, tools).

    Order of safety: every config check before any model loads; one run per run_dir (lock); the trained
    draft is written right after fit, before anything that could still fail (target fingerprint, metrics), and
    `resume=last` on a finished run only redoes those end-of-run steps."""
    from dspark.preflight import check_training_config

    check_training_config(cfg)
    run_dir = Path(str(cfg.run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    with claim_run_dir(run_dir):
        ckpt_path = resolve_resume(cfg, run_dir)
        return _train(cfg, run_dir, ckpt_path, callbacks)


def _train(cfg: DictConfig, run_dir: Path, ckpt_path: str | None, callbacks) -> dict:
    # Mid-run resume IS exact here: ChatDataModule checkpoints the batches consumed and its sampler
    # skips them (tests/test_train_e2e.py). Lightning cannot see that and warns otherwise.
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
    t0 = time.perf_counter()
    L.seed_everything(int(cfg.seed), workers=True)
    torch.set_float32_matmul_precision("high")
    target = factory.build_target(cfg)
    draft = factory.build_draft(cfg, target)
    datamodule = factory.build_datamodule(cfg, target.tokenizer, target=target)
    module = factory.build_module(cfg, draft, target)
    throughput = Throughput()
    trainer = build_trainer(cfg, run_dir, [throughput, LogsFollowCheckpoints(), *callbacks])
    n_params = sum(p.numel() for p in draft.parameters())
    log.info("draft parameters: %d; run dir: %s", n_params, run_dir)

    summary_path = run_dir / "metrics.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if ckpt_path is None and cfg.validate_at_start:
        trainer.validate(module, datamodule=datamodule, verbose=False)
        summary["step0"] = dict(getattr(module, "last_val_metrics", {}))
        if trainer.is_global_zero:
            atomic_write_json(summary_path, summary)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    out = run_dir / draft_dir.DRAFT_DIR
    if trainer.is_global_zero:  # the trained weights first: nothing below can lose them
        draft_dir.write_weights_and_config(draft, OmegaConf.to_container(cfg.draft, resolve=True), out)
    validated_last = trainer.global_step * trainer.accumulate_grad_batches % trainer.val_check_batch == 0
    if not validated_last or not getattr(module, "last_val_metrics", None):
        trainer.validate(module, datamodule=datamodule, verbose=False)
    summary.update(
        final=dict(getattr(module, "last_val_metrics", {})), global_step=trainer.global_step,
        draft_parameters=n_params, throughput=throughput.summary(), experiment=cfg.experiment_name,
    )
    if trainer.is_global_zero:
        draft_dir.seal(out, target_record(cfg, target.fingerprint()))
        atomic_write_json(summary_path, summary)
        print(final_report(summary, run_dir, time.perf_counter() - t0), flush=True)
    return summary
