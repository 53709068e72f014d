"""`train.py` body: config -> target, draft, data -> Lightning fit -> checkpoint, metrics, exported draft."""
from __future__ import annotations

import json
import logging
import os
import resource
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from omegaconf import DictConfig, OmegaConf

from dspark import factory
from dspark.io import atomic_write_bytes, atomic_write_json, save_safetensors_atomic

log = logging.getLogger("dspark.train")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temp file and renames it: a crash never leaves a torn .ckpt."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        import io

        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        atomic_write_bytes(Path(path), buf.getvalue())


class Throughput(Callback):
    """Tokens/s, blocks/s and peak memory over the training steps (first `skip` steps excluded)."""

    def __init__(self, skip: int = 3):
        self.skip, self.t0, self.n = skip, None, 0
        self.tokens = self.blocks = 0
        self.elapsed = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.n += 1
        if self.n <= self.skip or self.t0 is None:
            return
        self.elapsed += time.perf_counter() - self.t0
        self.tokens += int(batch["attention_mask"].sum())
        self.blocks += int(batch["keep"].sum())

    def summary(self) -> dict:
        peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out = {"timed_steps": max(0, self.n - self.skip), "peak_rss_mb": round(peak_rss_mb, 1)}
        if self.elapsed > 0:
            out.update(tokens_per_s=round(self.tokens / self.elapsed, 1),
                       blocks_per_s=round(self.blocks / self.elapsed, 1),
                       s_per_step=round(self.elapsed / max(1, self.n - self.skip), 4))
        if torch.cuda.is_available():
            out["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        return out


def build_loggers(cfg: DictConfig, run_dir: Path):
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    loggers = []
    for kind in cfg.logger.kinds:
        if kind == "csv":
            loggers.append(CSVLogger(save_dir=str(run_dir), name="logs"))
        elif kind == "tensorboard":
            loggers.append(TensorBoardLogger(save_dir=str(run_dir), name="tb"))
        elif kind == "wandb":
            try:
                import wandb  # noqa: F401
            except ImportError as e:
                raise factory.ConfigError("logger.kinds: wandb needs `pip install dspark[wandb]`") from e
            from lightning.pytorch.loggers import WandbLogger

            w = cfg.logger.wandb
            if w.mode == "offline":
                os.environ.setdefault("WANDB_MODE", "offline")
            loggers.append(WandbLogger(project=w.project, name=w.name, save_dir=str(run_dir),
                                       offline=w.mode == "offline"))
        else:
            raise factory.ConfigError(f"logger.kinds: unknown logger {kind!r} (csv, tensorboard, wandb)")
    return loggers


def build_trainer(cfg: DictConfig, run_dir: Path, callbacks: list[Callback]) -> L.Trainer:
    t = OmegaConf.to_container(cfg.trainer, resolve=True)
    if str(t.get("strategy", "")).startswith("deepspeed"):
        try:
            import deepspeed  # noqa: F401
        except ImportError as e:
            raise factory.ConfigError("trainer.strategy: DeepSpeed needs `pip install dspark[deepspeed]`") from e
    tr = cfg.train
    ckpt = ModelCheckpoint(dirpath=str(run_dir / "checkpoints"), filename="step{step:07d}",
                           auto_insert_metric_name=False, every_n_train_steps=int(tr.ckpt_every_steps),
                           save_top_k=1, save_last=True)
    plugins = [] if str(t.get("strategy", "")).startswith("deepspeed") else [AtomicCheckpointIO()]
    return L.Trainer(
        **t,
        max_steps=int(tr.max_steps), max_epochs=-1,
        accumulate_grad_batches=int(tr.accumulate_grad_batches),
        val_check_interval=int(tr.val_every_steps) * int(tr.accumulate_grad_batches),
        check_val_every_n_epoch=None, num_sanity_val_steps=0, use_distributed_sampler=False,
        callbacks=[ckpt, LearningRateMonitor(logging_interval="step"), *callbacks],
        logger=build_loggers(cfg, run_dir), plugins=plugins, default_root_dir=str(run_dir),
    )


def resolve_resume(cfg: DictConfig, run_dir: Path) -> str | None:
    if cfg.resume in (None, "", False):
        return None
    path = run_dir / "checkpoints" / "last.ckpt" if cfg.resume == "last" else Path(str(cfg.resume))
    factory.require(path.is_file(), "resume", f"checkpoint {str(path)!r} does not exist")
    return str(path)


TARGET_FILE = "target.json"  # the target a draft was trained against: kind, path, FrozenTarget.fingerprint()


def export_draft(draft: torch.nn.Module, cfg: DictConfig, out_dir: Path) -> None:
    """Trained draft weights (safetensors, training names) + the resolved draft config."""
    state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    save_safetensors_atomic(state, out_dir / "model.safetensors")
    atomic_write_json(out_dir / "draft_config.json", OmegaConf.to_container(cfg.draft, resolve=True))


def run_training(cfg: DictConfig, callbacks: tuple[Callback, ...] = ()) -> dict:
    """Runs (or resumes) one training job; `callbacks` are extra Lightning callbacks (tests, tools)."""
    # Mid-run resume IS exact here: ChatDataModule checkpoints the batches consumed and its sampler
    # skips them (tests/test_train_e2e.py). Lightning cannot see that and warns otherwise.
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
    L.seed_everything(int(cfg.seed), workers=True)
    torch.set_float32_matmul_precision("high")
    run_dir = Path(str(cfg.run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = resolve_resume(cfg, run_dir)

    target = factory.build_target(cfg)
    draft = factory.build_draft(cfg, target)
    datamodule = factory.build_datamodule(cfg, target.tokenizer, target=target)
    module = factory.build_module(cfg, draft, target)
    throughput = Throughput()
    trainer = build_trainer(cfg, run_dir, [throughput, *callbacks])
    n_params = sum(p.numel() for p in draft.parameters())
    log.info("draft parameters: %d; run dir: %s", n_params, run_dir)

    summary_path = run_dir / "metrics.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if ckpt_path is None and cfg.validate_at_start:
        trainer.validate(module, datamodule=datamodule, verbose=False)
        summary["step0"] = dict(getattr(module, "last_val_metrics", {}))
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    if trainer.global_step % int(cfg.train.val_every_steps) != 0:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    summary.update(
        final=dict(getattr(module, "last_val_metrics", {})), global_step=trainer.global_step,
        draft_parameters=n_params, throughput=throughput.summary(), experiment=cfg.experiment_name,
    )
    if trainer.is_global_zero:
        export_draft(draft, cfg, run_dir / "draft")
        atomic_write_json(run_dir / "draft" / TARGET_FILE, {
            "kind": str(cfg.target.kind), "path": None if cfg.target.path is None else str(cfg.target.path),
            "fingerprint": target.fingerprint()})
        atomic_write_json(summary_path, summary)
        log.info("metrics: %s", json.dumps(summary))
    return summary
