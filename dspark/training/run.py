"""`train.py` body: config -> target, draft, data -> Lightning fit -> checkpoint, metrics, exported draft."""
from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from omegaconf import DictConfig, OmegaConf

from dspark import factory
from dspark.io import atomic_write_bytes, atomic_write_json, save_safetensors_atomic
from dspark.training.callbacks import Throughput
from dspark.training.trainer import make_trainer

log = logging.getLogger("dspark.train")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temp file and renames it: a crash never leaves a torn .ckpt."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        import io

        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        atomic_write_bytes(Path(path), buf.getvalue())


def build_trainer(cfg: DictConfig, run_dir: Path, callbacks: list[Callback]) -> L.Trainer:
    """cfg.trainer / callbacks / logger -> Trainer (dspark.training.trainer), with the atomic checkpoint IO."""
    t = OmegaConf.to_container(cfg.trainer, resolve=True)
    plugins = [] if str(t.get("strategy", "")).startswith("deepspeed") else [AtomicCheckpointIO()]
    return make_trainer(cfg, callbacks, plugins)


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
    if trainer.global_step * trainer.accumulate_grad_batches % trainer.val_check_batch != 0:
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
