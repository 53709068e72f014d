"""`train.py` body: config -> target, draft, data -> Lightning fit -> checkpoint, metrics, exported draft."""
from __future__ import annotations

import json
import logging
import os
import time
import warnings
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO

from dspark import factory
from dspark.data.feature_cache_build import rows_before_target, target_loading
from dspark.data.feature_stream import producer_scope
from dspark.data.held_out import AUTO_HELD_OUT_MAX, held_out_count
from dspark.errors import ConfigError, require
from dspark.integrity import MANIFEST_NAME, check_file, check_manifest, remove_checked, sidecar_path, write_checked
from dspark.io import atomic_write_json
from dspark.preflight import check_training_config, command_line_overrides
from dspark.schema import RunConfig, TargetKeys
from dspark.targets.health import degenerate_warning
from dspark.targets.source import target_folder
from dspark.training import draft_dir
from dspark.training.build import build_datamodule, build_module
from dspark.training.cache_plan import feature_cache_plan
from dspark.training.callbacks import Throughput
from dspark.training.curves import write_curves
from dspark.training.data_plan import cached_rows, tiny_data_warning
from dspark.training.draft_vocab import install_draft_vocab
from dspark.training.rank_loss import rank_lost_error
from dspark.training.resume import (OVERRIDABLE, SHARDED_META, ResumeRefused, checkpoint_config, checkpoint_schedule,
                                    compare_on_resume, planned_steps, under)
from dspark.training.run_dir import claim_run_dir, is_launcher_process
from dspark.training.schedule import extension_line, resumed_schedule, saved_schedule
from dspark.training.sharding import gathered_draft_state
from dspark.warm_start import init_from
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


RESUME_RECORD = "resume.json"  # {"resume": the train.py command that resumes this run}, written at every start
CKPT_HINT = "resume from an earlier checkpoint (resume=<path to a stepNNNNNNN.ckpt>) or start a new run_dir"


class LogsFollowCheckpoints(Callback):
    """After a kill, the logs are never behind the checkpoint the run resumes from.

    Loggers are flushed whenever a checkpoint is saved (the CSV logger also writes every step). Lightning saves
    a step's checkpoint just BEFORE it logs that step's row, so the checkpoint carries that row
    (`dspark_log_row`: step + metrics) and a run resumed from it logs the row again first: a kill between the
    two loses nothing (a row written twice has the same values, and readers keep the later one).

    A resumed run also logs its steps where a run that never stopped would: Lightning's logging step
    (`_batches_that_stepped`, one per optimizer step) is set to the restored global step at the first batch. Lightning
    adds one on restart assuming the save came before the step's count, which is wrong for a checkpoint saved after a
    run's last validation: without this a finished run resumed logged every later row one step too high."""

    KEY = "dspark_log_row"

    def __init__(self):
        self._pending: dict | None = None
        self._restored = False

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        for logger in trainer.loggers:
            logger.save()
        metrics = trainer._logger_connector.metrics["log"]  # the row Lightning logs right after this save
        checkpoint[self.KEY] = {"step": int(trainer.fit_loop.epoch_loop._batches_that_stepped),
                                "metrics": {k: float(v) for k, v in metrics.items()}}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self._pending = checkpoint.get(self.KEY)
        self._restored = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._restored:  # after Lightning's restart bookkeeping (its loop reset), before anything logs this step
            self._restored = False
            trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step

    def on_train_start(self, trainer, pl_module):
        row, self._pending = self._pending, None
        if row and row["metrics"] and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(row["metrics"], step=row["step"])
                logger.save()


def build_trainer(run: RunConfig, callbacks: list[Callback]) -> L.Trainer:
    """run.trainer / callbacks / logger -> Trainer (dspark.training.trainer), with the atomic checkpoint IO."""
    strategy = str(run.trainer.get("strategy", ""))
    plugins = [] if strategy.startswith(("deepspeed", "fsdp2")) else [AtomicCheckpointIO()]  # (they write folders)
    return make_trainer(run, callbacks, plugins)


def resolve_resume(resume: str | None, run_dir: Path) -> str | None:
    """The checkpoint `resume` (null | last | a path) names, checked against its checksum now, before any model loads;
    None for a fresh run, which refuses a run_dir that already holds another run's checkpoints or draft, and for
    resume=last on a run_dir that holds neither yet (a run stopped before its first checkpoint starts over, said in
    one line: its printed resume command works)."""
    used = [p.name for p in (run_dir / "checkpoints", run_dir / draft_dir.DRAFT_DIR)
            if p.is_dir() and any(not f.name.startswith(".") for f in p.iterdir())]
    if resume in (None, "", False):
        if is_launcher_process():
            require(not used, "run_dir",
                            f"{run_dir} already holds a run ({', '.join(used)}/): resume it with resume=last, "
                            "or choose another run_dir=")
        return None
    if resume == "last":
        if not used:  # stopped before its first checkpoint (e.g. a stream's producer killed before its first shard)
            if is_launcher_process():
                print_and_log(f"resume=last: {run_dir} holds no checkpoint yet (the run stopped before its first "
                              "one): starting it from the beginning")
            return None
        path = newest_checkpoint(run_dir / "checkpoints")
        require(path is not None, "resume", f"{run_dir / 'checkpoints'} holds no complete checkpoint to resume "
                                            "(resume=last)")
    else:
        path = Path(str(resume))
    if path.is_dir():  # a sharded checkpoint (trainer=fsdp2): one file per rank + the run state in meta.pt
        require(not (path / "latest").is_file(), "resume",
                f"{str(path)!r} is a DeepSpeed checkpoint folder (trainer=deepspeed_zero2|3), which dspark does not "
                "resume (its completeness cannot be checked here): for a run you may need to resume, train with "
                "trainer=fsdp2 (weights, gradients and AdamW sharded like ZeRO-3; crash-safe checkpoints)")
        if not sharded_complete(path):
            other = newest_checkpoint(path.parent)
            instead = f"resume from the newest complete one: resume={other}" if other else \
                "no other checkpoint beside it is complete: start a new run_dir"
            require(False, "resume", f"checkpoint folder {str(path)!r} is incomplete (no {MANIFEST_NAME}, the "
                                     f"completion record written when every rank's shard and {SHARDED_META} are "
                                     f"in: a write interrupted by a crash, or a copy); {instead}")
        check_manifest(path, hint=CKPT_HINT, since="the checkpoint was written")
        return str(path)
    require(path.is_file(), "resume", f"checkpoint {str(path)!r} does not exist")
    check_file(path, hint=CKPT_HINT)
    return str(path)


def sharded_complete(folder: Path) -> bool:
    """A sharded checkpoint folder is complete when its completion record (dspark.training.sharding) is there."""
    return (folder / MANIFEST_NAME).is_file() and (folder / SHARDED_META).is_file()


def newest_checkpoint(folder: Path) -> Path | None:
    """What resume=last resumes: the newest COMPLETE checkpoint, file or sharded folder, by the step it holds;
    last.ckpt on a tie (a kill between the two writes of one step leaves the step file newer, or last.ckpt not yet
    written). A sharded folder without its completion record is skipped with a warning; a last.ckpt file whose
    step cannot be read is still the one chosen, so its damage is reported rather than silently skipped. The
    choice is logged with its reason. None: no checkpoint."""
    if not folder.is_dir():
        return None
    last = folder / "last.ckpt"
    found: list[tuple[int, int, Path]] = []  # (step, 1 for last.ckpt, path)
    for path in [last, *sorted(p for p in folder.glob("step*.ckpt"))]:
        if path.is_dir() and not sharded_complete(path):
            log.warning("resume=last: %s has no completion record (%s): an interrupted write, skipped", path.name,
                        MANIFEST_NAME)
            continue
        if not path.exists():
            continue
        step = _saved_step(path)
        if step is None and path == last and path.is_file():
            return last  # unreadable: resuming from it reports the damage (checksum) instead of skipping it
        if step is not None:
            found.append((step, int(path == last), path))
    if not found:
        return None
    step, _, chosen = max(found)
    if chosen != last and any(path == last for *_, path in found):
        log.warning("resume=last: %s holds an older step than %s (step %d): resuming from that", last.name,
                    chosen.name, step)
    log.info("resume=last: %s (step %d, the newest complete checkpoint)", chosen.name, step)
    return chosen


def target_record(target: TargetKeys, fingerprint: str | None) -> dict:
    """draft/target.json: the target a draft was trained against (eval.py refuses other weights)."""
    return {"kind": str(target.kind), "path": None if target.path is None else str(target.path),
            "fingerprint": fingerprint}


def export_draft(draft: torch.nn.Module, group, target: TargetKeys, out_dir: Path,
                 fingerprint: str | None = None) -> None:
    """A complete, sealed draft/ folder in one call (what a finished run leaves behind): the draft of the draft group
    `group` (its warm-start keys are recorded; the sizes are the draft's), trained against the target of the target
    section `target`."""
    draft_dir.write_weights_and_config(draft, factory.resolved_group(draft, group), out_dir)
    draft_dir.seal(out_dir, target_record(target, fingerprint))


def _saved_step(path: Path) -> int | None:
    """The global_step a checkpoint file (or sharded folder: its meta.pt) holds (tensors memory-mapped, not read),
    None if unreadable."""
    if path.is_dir():
        path = path / SHARDED_META
    try:
        return int(torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except Exception:  # noqa: BLE001 (not a checkpoint this run can read: left alone)
        return None


def link_same_step_checkpoints(trainer: L.Trainer) -> list[Path]:
    """A run whose last step is also a step-checkpoint step and its best validation (every short run) ends with
    up to three files of one training state: last.ckpt, stepNNNNNNN.ckpt, best-stepNNNNNNN-tau....ckpt. Those
    holding the same step as last.ckpt become hard links to it: one file on disk, every name kept (resume=last,
    resume=<that file> and the best checkpoint still load; each name keeps its checksum file). Only with the
    atomic checkpoint IO, which replaces a file by renaming, so a later save never writes through a link.
    Returns the names linked."""
    if not trainer.is_global_zero or not isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO):
        return []
    linked = []
    step = int(trainer.global_step)
    for last in {Path(cb.last_model_path) for cb in trainer.checkpoint_callbacks if cb.last_model_path}:
        if not last.is_file() or _saved_step(last) != step:
            continue
        digest = json.loads(sidecar_path(last).read_text())["accept"][0]
        for other in sorted(last.parent.glob("*.ckpt")):
            if other == last or not other.is_file() or os.path.samefile(other, last) or _saved_step(other) != step:
                continue
            old = json.loads(sidecar_path(other).read_text())["accept"][:1] if sidecar_path(other).is_file() else []
            atomic_write_json(sidecar_path(other), {"file": other.name, "accept": [digest, *old]})  # both, meanwhile
            tmp = other.with_name(f".{other.name}.link.tmp")
            tmp.unlink(missing_ok=True)
            try:
                os.link(last, tmp)
            except OSError:  # a file system without hard links: keep the copy
                atomic_write_json(sidecar_path(other), {"file": other.name, "accept": old or [digest]})
                continue
            os.replace(tmp, other)
            atomic_write_json(sidecar_path(other), {"file": other.name, "accept": [digest]})
            linked.append(other)
    if linked:
        log.info("checkpoints of the last step: %s are hard links to last.ckpt (one file on disk)",
                 ", ".join(p.name for p in linked))
    return linked


def print_and_log(text: str) -> None:
    """Prints `text` and writes it to the run's log file too (the file handlers Hydra's job logging put on the
    root logger: <run_dir>/train.log), not a second time to the console."""
    print(text, flush=True)
    record = log.makeRecord(log.name, logging.INFO, __file__, 0, text, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def resume_command(experiment_name: str, run_dir: Path) -> str:
    """The train.py command that resumes this run when pasted: the run's own command-line overrides (its experiment
    first; `experiment=<experiment_name>` when no command line is known and that experiment exists), its run_dir,
    resume=last."""
    import shlex

    keep = [o for o in command_line_overrides() if o.split("=", 1)[0].lstrip("+~") not in ("run_dir", "resume")]
    if not any(o.startswith("experiment=") for o in keep):
        if (Path(__file__).resolve().parents[2] / "configs" / "experiment" / f"{experiment_name}.yaml").is_file():
            keep.insert(0, f"experiment={experiment_name}")
    return "python train.py " + " ".join(shlex.quote(o) for o in [*keep, f"run_dir={run_dir}", "resume=last"])


def final_report(summary: dict, run_dir: Path, seconds: float, pictures: list[Path] | tuple = (),
                 resume: str | None = None, tokenizer=None) -> str:
    """The run's last console lines: where the outputs are and what the held-out result was, in words (with a
    warning when the target is degenerate: dspark.targets.health)."""
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
    warning = degenerate_warning(summary.get("target_health"), tokenizer, what="tau_prob")
    if warning:
        lines.append(f"  {warning}")
    lines += [f"  trained draft:  {run_dir / draft_dir.DRAFT_DIR}/ (weights, config, target record, checksums)",
              f"  checkpoints:    {run_dir / 'checkpoints'}/last.ckpt (resume: "
              f"{resume or f'python train.py run_dir={run_dir} resume=last'})",
              f"  metrics:        {run_dir / 'metrics.json'}, logs under {run_dir / 'logs'}/"]
    lines += [f"  picture:        {p} (train loss, lr and held-out tau_prob by step)" for p in pictures]
    lines.append(f"  next:           python eval.py run_dir={run_dir}")
    return "\n".join(lines)


def run_training(cfg, callbacks: tuple[Callback, ...] = ()) -> dict:
    """Runs (or resumes) one training job; `callbacks` are extra Lightning callbacks (tests, tools).

    Order of safety: every config check before any model loads; one run per run_dir (lock); the trained
    draft is written right after fit, before anything that could still fail (target fingerprint, metrics), and
    `resume=last` on a finished run only redoes those end-of-run steps. `cfg`: Hydra's DictConfig, checked
    (dspark.preflight) and typed (dspark.schema.RunConfig) here, once; everything below reads the typed sections."""
    run = check_training_config(cfg)  # never changed below: the held-out count makes a new RunConfig (with_held_out)
    run_dir = Path(run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with claim_run_dir(run_dir):
        ckpt_path = resolve_resume(run.resume, run_dir)
        if ckpt_path is not None:
            plan, then = check_resumed_config(run, Path(ckpt_path), run_dir)
            if is_launcher_process():  # once per job, not once per rank
                print_and_log(plan)
            if run.data.val_examples == "auto":  # a resumed run keeps its own held-out split
                run = with_held_out(run, (then.get("data") or {}).get("val_examples", "auto"))
        if is_launcher_process():
            atomic_write_json(run_dir / RESUME_RECORD, {"resume": resume_command(run.experiment_name, run_dir)})
        return _train(run, run_dir, ckpt_path, callbacks)


def check_resumed_config(run: RunConfig, ckpt: Path, run_dir: Path) -> tuple[str, dict]:
    """The run config (its draft group resolved against the target, as checkpoints hold it) against the
    checkpoint's, before any model loads (dspark.training.resume) -> (the one line that says
    how far the resumed run goes, the checkpoint's run config). A refused config names the command this run was last
    started with (run_dir/resume.json), when it has one: a resume that forgot the experiment or an override is one
    line."""
    then, step = checkpoint_config(ckpt)
    now = run.values()
    if now["data"].get("val_examples") == "auto":  # auto keeps the run's own split (choose_held_out)
        now["data"] = {**now["data"], "val_examples": (then.get("data") or {}).get("val_examples", "auto")}
    try:
        compare_on_resume(now, then)
    except ResumeRefused as e:
        record = run_dir / RESUME_RECORD
        own = json.loads(record.read_text()).get("resume") if record.is_file() else None
        if own is None or all(under(k, OVERRIDABLE) for k in e.refused):
            raise
        was, is_ = then.get("experiment_name"), now.get("experiment_name")
        shown = "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in list(e.refused.items())[:3])
        other = (f"was made with experiment={was}, not {is_}" if was != is_ else
                 f"was started with other settings ({shown}{'; ...' if len(e.refused) > 3 else ''})")
        raise ConfigError(f"resume: this run {other}: resume it with its own command: {own} (or choose another "
                          "run_dir= for a new run)") from None
    named = [o.split("=", 1)[0].lstrip("+~") for o in command_line_overrides()]
    asked = "trainer.max_steps" in named or "trainer.max_steps" in run.resume_override
    max_steps = int(run.trainer["max_steps"])
    plan = planned_steps(then, step, max_steps, asked)
    if max_steps > step:  # another trainer.max_steps: what the lr does from here (dspark.training.schedule)
        saved = checkpoint_schedule(ckpt)
        before = saved_schedule(saved)
        schedule = resumed_schedule(saved, step, max_steps, run.train.warmup_ratio, run.train.min_lr_ratio)
        plan += extension_line(schedule, before.max_steps if before else None, step, float(run.train.lr))
    return plan, then


def _train(run: RunConfig, run_dir: Path, ckpt_path: str | None, callbacks) -> dict:
    # Mid-run resume IS exact here: ChatDataModule checkpoints the batches consumed and its sampler
    # skips them (tests/test_train_e2e.py). Lightning cannot see that and warns otherwise.
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
    t0 = time.perf_counter()
    L.seed_everything(run.seed, workers=True)
    torch.set_float32_matmul_precision("high")
    # the rows come first (tokenizer only): the held-out split is checked against them before any model loads, and
    # with data.feature_cache a complete cache (a hit) loads only the target's head
    dataset = rows_before_target(run.data, target_folder(run.target), factory.build_dataset)
    run = with_held_out(run, choose_held_out(run.data.val_examples, len(dataset)))  # saved in every checkpoint
    tiny = tiny_data_warning(run, len(dataset) - run.data.val_examples, run.data.val_examples)
    if tiny and is_launcher_process():
        print_and_log(tiny)
    plan = feature_cache_plan(run)  # data.feature_cache: decided once, read by the target's loading and the build
    start = run.draft_start
    target = factory.build_target(run.target, run.draft,
                                  target_loading(plan, run.copies_target, dataset, cached_rows(run, dataset)))
    draft = factory.build_draft(run.draft, target, start)
    if start.init_from and ckpt_path is None:  # a warm start (a resumed run restores its checkpoint)
        init_from(draft, str(start.init_from), target,  # a draft of another target: refused unless asked
                  any_target=start.init_from_any_target)
    datamodule = build_datamodule(run, target.tokenizer, dataset=dataset, target=target, plan=plan)
    install_draft_vocab(draft, datamodule.train_rows, target.tokenizer)  # draft.arch.draft_vocab_size
    with producer_scope(datamodule.features):  # data.feature_stream: its producer finishes (or stops on an error)
        return _fit(run, run_dir, ckpt_path, callbacks, target, draft, datamodule, t0)


def with_held_out(run: RunConfig, val_examples: int | str) -> RunConfig:
    """A copy of `run` holding out `val_examples` conversations (`run` itself unchanged)."""
    return replace(run, data=replace(run.data, val_examples=val_examples))


def choose_held_out(val_examples: int | str, n: int) -> int:
    """data.val_examples as the number of held-out conversations of the `n` usable ones (auto: a tenth, at most
    64; a resumed run has its checkpoint's count by now, run_training), said in one line when auto holds out fewer
    than 64."""
    count = held_out_count(val_examples, n)
    if val_examples == "auto" and count < AUTO_HELD_OUT_MAX and is_launcher_process():
        print_and_log(f"data.val_examples=auto: {count} of {n} usable conversations held out for validation (a "
                      f"tenth; {AUTO_HELD_OUT_MAX} on larger data)")
    return count


def _fit(run: RunConfig, run_dir: Path, ckpt_path: str | None, callbacks, target, draft, datamodule,
         t0: float) -> dict:
    module = build_module(run, draft, target)
    throughput = Throughput()
    trainer = build_trainer(run, [throughput, LogsFollowCheckpoints(), *callbacks])
    n_params = sum(p.numel() for p in draft.parameters())
    log.info("draft parameters: %d; run dir: %s", n_params, run_dir)

    summary_path = run_dir / "metrics.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if ckpt_path is None and run.validate_at_start:
        trainer.validate(module, datamodule=datamodule, verbose=False)
        summary["step0"] = dict(getattr(module, "last_val_metrics", {}))
        if trainer.is_global_zero:
            atomic_write_json(summary_path, summary)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    except Exception as err:  # noqa: BLE001 (a rank that died: one line, dspark.training.rank_loss)
        lost = rank_lost_error(err, trainer, resume_command(run.experiment_name, run_dir))
        if lost is None:
            raise
        raise lost from None
    link_same_step_checkpoints(trainer)
    out = run_dir / draft_dir.DRAFT_DIR
    full = gathered_draft_state(draft, trainer.is_global_zero)  # FSDP2 / ZeRO-3 shards (a collective: every rank)
    if trainer.is_global_zero:  # the trained weights first: nothing below can lose them
        draft_dir.write_weights_and_config(draft, run.draft_group(), out, state=full)
    validated_last = trainer.global_step * trainer.accumulate_grad_batches % trainer.val_check_batch == 0
    if not validated_last or not getattr(module, "last_val_metrics", None):
        trainer.validate(module, datamodule=datamodule, verbose=False)
    summary.update(
        final=dict(getattr(module, "last_val_metrics", {})), global_step=trainer.global_step,
        draft_parameters=n_params, throughput=throughput.merged(summary.get("throughput"), trainer.global_step),
        experiment=run.experiment_name,
        target_health=getattr(module, "target_health", None),
    )
    if trainer.is_global_zero:
        draft_dir.seal(out, target_record(run.target, target.fingerprint()))
        atomic_write_json(summary_path, summary)
        for logger in trainer.loggers:
            logger.save()
        curves = write_curves(run_dir, title=f"{run.experiment_name}: {run_dir.name}")
        print_and_log(final_report(summary, run_dir, time.perf_counter() - t0, [curves] if curves else [],
                                   resume=resume_command(run.experiment_name, run_dir), tokenizer=target.tokenizer))
    return summary
