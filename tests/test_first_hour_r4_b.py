"""What the first hour tripped on, round 4 (issue 51, items 3-7): the resume hint of a run stopped before its first
checkpoint, a resumed finished run's throughput, an extended run's learning rate, a short run's feature cache and a
tiny data set's warning."""
from __future__ import annotations

import json

import lightning as L
import pytest

from conftest import TINY_RUN, compose
from dspark.training.run import run_training


def _run(run_dir, *more):
    return compose(TINY_RUN + [f"run_dir={run_dir}", *more])


class StopAtStart(L.Callback):
    """A run killed before its first step (and so before its first checkpoint)."""

    def on_train_start(self, trainer, pl_module):
        raise RuntimeError("stopped before the first step")


class LrProbe(L.Callback):
    """step -> the lr the optimizer steps with at that step."""

    def __init__(self):
        self.lr: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lr[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


# ---- 3. resume=last before the first checkpoint starts the run -------------------------------------------
def test_resume_last_before_any_checkpoint_starts_the_run_from_the_beginning(tmp_path, capsys):
    """The hint a run stopped before its first checkpoint prints (e.g. its feature producer killed before its first
    shard) is resume.json's command, resume=last: it starts the run from step 0, saying so in one line."""
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="stopped before the first step"):
        run_training(_run(run, "trainer.max_steps=2"), callbacks=(StopAtStart(),))
    assert "resume=last" in json.loads((run / "resume.json").read_text())["resume"]
    assert not any((run / "checkpoints").glob("*.ckpt")) if (run / "checkpoints").is_dir() else True
    capsys.readouterr()
    summary = run_training(_run(run, "trainer.max_steps=2", "resume=last"))
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "holds no checkpoint yet" in ln]
    assert len(lines) == 1 and "starting it from the beginning" in lines[0], out[-2000:]
    assert summary["global_step"] == 2 and (run / "draft" / "model.safetensors").is_file()


def test_resume_last_on_a_run_dir_with_only_unreadable_checkpoints_is_still_refused(tmp_path):
    """Starting over is only for a run dir that holds no checkpoint at all: a checkpoints/ folder with something in
    it that is not a complete checkpoint is refused, as before (nothing there is overwritten)."""
    from dspark.errors import ConfigError

    run = tmp_path / "run"
    (run / "checkpoints" / "step0000002.ckpt").mkdir(parents=True)  # a sharded folder without its completion record
    with pytest.raises(ConfigError, match="holds no complete checkpoint to resume"):
        run_training(_run(run, "trainer.max_steps=2", "resume=last"))


# ---- 4. a resumed finished run keeps its throughput; an extension records its own -------------------------
def test_resuming_a_finished_run_keeps_its_throughput_and_an_extension_records_its_own(tmp_path):
    run = tmp_path / "run"
    common = ["trainer.val_check_interval=4", "callbacks.last_checkpoint.every_n_train_steps=4"]
    run_training(_run(run, "trainer.max_steps=4", *common))
    first = json.loads((run / "metrics.json").read_text())["throughput"]
    assert first["timed_steps"] == 1 and first["tokens_per_s"] > 0 and "flops_per_step" in first
    assert first["steps"] == [0, 4] and "earlier" not in first
    run_training(_run(run, "trainer.max_steps=4", "resume=last", *common))  # redoes only the end-of-run steps
    assert json.loads((run / "metrics.json").read_text())["throughput"] == first
    run_training(_run(run, "trainer.max_steps=8", "resume=last", "resume_override=[trainer.max_steps]", *common))
    now = json.loads((run / "metrics.json").read_text())["throughput"]
    assert now["steps"] == [4, 8] and now["timed_steps"] == 1 and now["tokens_per_s"] > 0  # this segment's
    assert now["earlier"] == [first]  # the training's own figures, kept


# ---- 5. an extended run continues its lr decay -----------------------------------------------------------
def test_extending_a_finished_run_continues_the_lr_decay_without_a_jump(tmp_path, capsys):
    """4 -> 8 steps: the lr at the resume step is no higher than at the step before (the finished schedule's floor)
    and decays on to the floor at the new end; the resume line says so."""
    from dspark.training.module import warmup_cosine

    run, before, after = tmp_path / "run", LrProbe(), LrProbe()
    run_training(_run(run, "trainer.max_steps=4"), callbacks=(before,))
    lr, floor = 3e-3, 0.05  # configs/config.yaml train.lr, train.min_lr_ratio
    assert before.lr[3] == pytest.approx(lr * warmup_cosine(3, 4, 0.04, floor))
    capsys.readouterr()
    run_training(_run(run, "trainer.max_steps=8", "resume=last", "resume_override=[trainer.max_steps]"),
                 callbacks=(after,))
    out = capsys.readouterr().out
    assert sorted(after.lr) == [4, 5, 6, 7]
    assert after.lr[4] <= before.lr[3]  # no jump up at the resume step
    assert all(after.lr[s + 1] <= after.lr[s] + 1e-12 for s in (4, 5, 6))
    assert min(after.lr.values()) >= lr * floor - 1e-12
    line = next(ln for ln in out.splitlines() if ln.startswith("resume: continuing from step 4 to 8"))
    assert "learning rate continues its decay" in line and "no re-warm" in line, line


def test_an_extension_s_schedule_is_a_function_of_the_resume_point_and_the_new_end():
    """The schedule after an extension: from the multiplier the old schedule had at the resume step, a cosine to
    min_lr_ratio at the new max_steps; resumed again with the same max_steps it is the same schedule (exact resume);
    an extension during warmup keeps the plain schedule of the new length."""
    from dspark.training.schedule import LrSchedule, warmup_cosine

    old = LrSchedule(max_steps=300, warmup_ratio=0.04, min_lr_ratio=0.05)
    new = old.extended(300, 600)
    assert new.multiplier(300) == pytest.approx(old.multiplier(300)) == pytest.approx(0.05)
    assert new.multiplier(450) == pytest.approx(0.05) and new.multiplier(600) == pytest.approx(0.05)
    mid = LrSchedule(max_steps=300, warmup_ratio=0.04, min_lr_ratio=0.05).extended(150, 600)
    m150 = warmup_cosine(150, 300, 0.04, 0.05)
    assert mid.multiplier(150) == pytest.approx(m150)
    assert m150 > mid.multiplier(375) > mid.multiplier(599) > mid.multiplier(600) == pytest.approx(0.05)
    assert LrSchedule.from_record(mid.record()) == mid and mid.extended(400, 600) == mid  # same end: unchanged
    early = old.extended(5, 600)  # still warming up: the plain schedule of 600 steps
    assert early.multiplier(5) == pytest.approx(warmup_cosine(5, 600, 0.04, 0.05)) and early.from_step is None


# ---- 6. a short run caches only the rows it reads ---------------------------------------------------------
def _cache_metas(root) -> dict[int, dict]:
    """num_examples -> meta.json of every complete auto feature cache under `root`."""
    metas = [json.loads(p.read_text()) for p in (root / "features").glob("*/meta.json")]
    return {m["num_examples"]: m for m in metas}


def test_a_short_run_caches_only_the_rows_it_reads_and_a_longer_run_builds_its_own(tmp_path, monkeypatch, caplog):
    """data.feature_cache=auto, 2 steps of 4 rows: the cache holds those 8 training rows and the 8 held-out ones, not
    the whole set, and the run says so (and how long it takes) before it builds; 3 steps read 4 more rows: a cache
    of its own rows (keyed by them), never the 16-row one taken as complete; a complete cache of the whole set is
    used by any run."""
    import logging

    from dspark.data.feature_cache import build_feature_cache, cache_key, dataset_fingerprint, target_identity

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    common = ["data.feature_cache=auto", "data.feature_cache_dtype=float32", "trainer.val_check_interval=2"]
    with caplog.at_level(logging.INFO):
        run_training(_run(tmp_path / "a", "trainer.max_steps=2", *common))
    metas = _cache_metas(tmp_path / "cache")
    assert sorted(metas) == [16], sorted(metas)
    said = [r.getMessage() for r in caplog.records if r.name in ("dspark.feature_cache", "dspark.data.feature_cache")]
    plan = [m for m in said if m.startswith("feature cache: this run reads 8 training rows")]
    assert len(plan) == 1 and "building 16 of the" in plan[0], said
    assert any(m.startswith("feature cache: about ") for m in said), said  # the time, measured on its first batch
    run_training(_run(tmp_path / "b", "trainer.max_steps=3", *common))
    assert sorted(_cache_metas(tmp_path / "cache")) == [16, 20]
    assert metas[16]["key"] != _cache_metas(tmp_path / "cache")[20]["key"]
    # the whole set's cache, once complete, is what every run reads (no partial one built beside it)
    import torch

    from dspark import factory
    from dspark.data.feature_cache_build import cache_dir_for_key, rows_before_target
    from dspark.schema import run_config
    from dspark.targets.source import target_folder
    from dspark.training.cache_plan import feature_cache_plan

    cfg = _run(tmp_path / "c", "trainer.max_steps=1", *common)
    run = run_config(cfg)
    target = factory.build_target(run.target, run.draft)
    dataset = rows_before_target(run.data, target_folder(run.target), factory.build_dataset)
    key = cache_key(target_identity(target), dataset_fingerprint(dataset), torch.float32)
    build_feature_cache(target, dataset, cache_dir_for_key(feature_cache_plan(run), key), dtype=torch.float32)
    run_training(cfg)
    assert sorted(_cache_metas(tmp_path / "cache")) == [16, 20, len(dataset)]


def test_the_cached_rows_are_the_ones_the_sampler_hands_out_on_every_rank():
    """cached_rows = the rows of the run's global batches (2 ranks: both ranks' shares) + the held-out tail; the whole
    set (None) for a run reading half of it or more, a named cache folder, a stream, an unknown number of ranks."""
    from dspark.schema import run_config
    from dspark.training.data_module import ResumableBatchSampler
    from dspark.training.data_plan import cached_rows

    rows = [{"input_ids": [1, 2, 3]}] * 200

    def plan(*more):
        return cached_rows(run_config(compose(TINY_RUN + ["data.feature_cache=auto", "data.val_examples=8", *more])),
                           rows)

    got = plan("trainer.max_steps=3", "trainer.devices=2", "trainer.accelerator=cpu")
    read = {i for r in (0, 1) for b in ResumableBatchSampler(192, 4, 3, 0, rank=r, world_size=2) for _, i in b}
    assert got == sorted(read) + list(range(192, 200)) and len(read) == 24
    assert len(plan("trainer.max_steps=12")) == 48 + 8  # 12 steps x 4 rows + the held-out ones: under half
    assert plan("trainer.max_steps=23") is None  # 92 + 8 rows: half the set
    assert plan("trainer.max_steps=3", "data.feature_cache=/some/folder") is None
    assert plan("trainer.max_steps=3", "data.feature_stream=true") is None
    import datasets  # data.group_by_length: the sampler's length-sorted order, as the DataModule builds it
    import torch

    rows = datasets.Dataset.from_list([{"input_ids": [1] * (1 + (i * 7) % 50)} for i in range(200)])
    lengths = torch.tensor([len(r) for r in rows.select(range(192))["input_ids"]])
    read = {i for b in ResumableBatchSampler(192, 4, 3, 0, lengths=lengths) for _, i in b}
    assert plan("trainer.max_steps=3", "data.group_by_length=true") == sorted(read) + list(range(192, 200))


# ---- 7. a tiny data set is named -------------------------------------------------------------------------
def test_a_tiny_data_set_gets_one_warning_line_with_its_rows_and_passes(tmp_path, capsys):
    tiny = [o for o in TINY_RUN if not o.startswith(("data.limit", "data.val_examples"))]
    run_training(compose(tiny + [f"run_dir={tmp_path / 'run'}", "data.limit=16", "data.val_examples=2",
                                 "trainer.max_steps=6", "trainer.val_check_interval=6"]))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning: data:")]
    assert len(lines) == 1, lines
    # 16 read, 14 usable, 2 held out: 12 train; 6 steps x 4 rows = 24 = 2 passes
    assert "only 12 training conversations (+2 held out" in lines[0] and "= 2.0 passes" in lines[0], lines[0]


def test_a_data_set_of_ordinary_size_gets_no_tiny_warning(tmp_path, capsys):
    run_training(_run(tmp_path / "run", "trainer.max_steps=1", "trainer.val_check_interval=1"))
    assert "warning: data:" not in capsys.readouterr().out
