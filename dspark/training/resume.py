"""What may change when a run resumes: the resolved config against the checkpoint's (`hyper_parameters`), compared
before any model loads.

  * free on resume (FREE): how long and how loudly the run goes on (trainer.max_steps, max_time, logging and
    validation cadence, callbacks, loggers, the run dir's own path);
  * changeable when named in `resume_override=[...]` (OVERRIDABLE): optimisation and loss settings; applied for real
    (the optimizer and schedule state restored from the checkpoint are rewritten, DraftLightningModule.
    on_load_checkpoint) and logged as changed;
  * everything else (the draft's architecture, the target, the data, the seed, batch and anchor counts, precision,
    devices): refused, naming each key with both values. Such a change is a new run.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from dspark.errors import ConfigError
from dspark.training.schedule import CHECKPOINT_KEY

log = logging.getLogger("dspark.resume")

SHARDED_META = "meta.pt"  # the run state in a sharded checkpoint folder (Lightning's ModelParallelStrategy)
FREE = ("resume", "resume_override", "run_dir", "experiment_name", "validate_at_start", "callbacks", "logger",
        "trainer.max_steps", "trainer.max_time", "trainer.log_every_n_steps", "trainer.val_check_interval",
        "trainer.limit_val_batches", "trainer.enable_progress_bar", "trainer.enable_model_summary",
        "trainer.default_root_dir", "trainer.num_sanity_val_steps")
OVERRIDABLE = ("trainer.max_steps", "train.lr", "train.weight_decay", "train.betas", "train.warmup_ratio", "train.min_lr_ratio",
               "train.decay_gamma", "train.loss_weights", "train.fused_loss", "train.mtp_beta", "train.mtp_loss_weights",
               "train.val_batch_size", "trainer.gradient_clip_val", "ops_backend")

# keys added after checkpoints were written, with the value that does what those runs did: a checkpoint without the
# key resumes as if it held that value (any other value is a change like any other)
ADDED_KEYS = {"data.feature_stream": False}


class ResumeRefused(ConfigError):
    """The run config differs from the checkpoint's in keys that cannot change on resume (`keys`)."""

    def __init__(self, message: str, refused: dict[str, tuple]):
        super().__init__(message)
        self.refused = refused  # key -> (checkpoint value, new value)


def _flat(d, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def checkpoint_config(path: Path) -> tuple[dict, int]:
    """(the resolved run config a checkpoint was written with, the step it holds); memory-mapped: the tensors are
    not read."""
    if Path(path).is_dir():  # a sharded checkpoint folder (trainer=fsdp2): the run state is in its meta.pt
        path = Path(path) / SHARDED_META
    ckpt = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    return dict(ckpt.get("hyper_parameters") or {}), int(ckpt.get("global_step") or 0)


def checkpoint_schedule(path: Path) -> dict:
    """The parts of a checkpoint its lr schedule is read from (dspark.training.schedule.saved_schedule): its schedule
    record and run config; memory-mapped: the tensors are not read."""
    if Path(path).is_dir():
        path = Path(path) / SHARDED_META
    ckpt = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    return {k: ckpt[k] for k in (CHECKPOINT_KEY, "hyper_parameters") if k in ckpt}


def planned_steps(then: dict, step: int, max_steps: int, asked: bool) -> str:
    """How far a resumed run goes, in one line for the console; ConfigError when a finished run would be trained on
    (and its draft/ replaced) without the user naming trainer.max_steps (`asked`: on the command line or in
    resume_override), or when max_steps is below the checkpoint's step."""
    planned = int((then.get("trainer") or {}).get("max_steps") or 0)
    if max_steps < step:
        raise ConfigError(f"resume: trainer.max_steps={max_steps} is below the checkpoint's step {step}: use "
                          f"trainer.max_steps={planned if planned >= step else step} or more")
    if step >= planned > 0 and max_steps > step and not asked:
        raise ConfigError(f"resume: this run finished at step {step} (trainer.max_steps={planned}); this config says "
                          f"trainer.max_steps={max_steps}, which would train it on and replace its draft/: pass "
                          f"trainer.max_steps={planned} to redo only its end-of-run steps, or "
                          f"resume_override=[trainer.max_steps] to train on to step {max_steps}")
    if max_steps > step:
        return f"resume: continuing from step {step} to {max_steps}"
    return f"resume: the run finished at step {step}; redoing only its end-of-run steps (draft/, metrics, curves)"


def compare_on_resume(now: dict, then: dict) -> dict[str, tuple]:
    """-> {key: (checkpoint value, new value)} of the overridden keys that changed; ConfigError naming every other
    changed key (both values) unless it is free on resume. `now`: the resolved config with the draft group resolved
    against the target (as the checkpoint holds it)."""
    if not then:
        raise ConfigError("resume: the checkpoint records no run config (written by another tool?): start a new run_dir")
    a, b = _flat(then), _flat(now)
    a.update({k: v for k, v in ADDED_KEYS.items() if k not in a and k in b})
    overrides = list(now.get("resume_override") or [])
    bad = [k for k in overrides if not under(k, OVERRIDABLE)]
    if bad:
        raise ConfigError(f"resume_override: {bad} cannot change on resume (allowed: {', '.join(OVERRIDABLE)}); "
                          "start a new run_dir")
    changed = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    refused = {k: v for k, v in changed.items() if not under(k, FREE) and not under(k, overrides)}
    if refused:
        what = "; ".join(f"{k}: {v[0]!r} in the checkpoint, {v[1]!r} now" for k, v in refused.items())
        hint = ("pass resume_override=[" + ",".join(k for k in refused if under(k, OVERRIDABLE)) + "] to change them"
                if all(under(k, OVERRIDABLE) for k in refused) else "that is a new run: choose another run_dir=")
        raise ResumeRefused(f"resume: the run config differs from the checkpoint's ({what}); {hint}", refused)
    applied = {k: v for k, v in changed.items() if under(k, overrides)}
    for k, (old, new) in applied.items():
        log.info("resume: %s changed from %r to %r (resume_override)", k, old, new)
    return applied


def rewrite_optimizer_state(checkpoint: dict, lr: float, weight_decay: float, betas, lr_multiplier) -> None:
    """The restored AdamW / LambdaLR state with this run's lr, weight decay and betas, so a resume_override of them
    takes effect at the first resumed step (`lr_multiplier(step)`: the schedule's factor)."""
    for sched in checkpoint.get("lr_schedulers") or []:
        if "base_lrs" in sched:
            sched["base_lrs"] = [lr] * len(sched["base_lrs"])
        step = int(sched.get("last_epoch", 0))
        sched["_last_lr"] = [lr * lr_multiplier(step)] * len(sched.get("_last_lr") or [0])
        for opt in checkpoint.get("optimizer_states") or []:
            for group in opt.get("param_groups", []):
                group.update(initial_lr=lr, lr=lr * lr_multiplier(step), weight_decay=weight_decay,
                             betas=tuple(betas))
