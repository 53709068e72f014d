"""What a run's steps will read of its rows, known before any model loads: the data-parallel size the trainer section
implies, the rows read per optimizer step and over the run, the training rows the sampler hands out (so that a
short run's feature cache holds only those, dspark.data.feature_cache_build), and the one warning line of a tiny
data set."""
from __future__ import annotations

import torch

from dspark.data.cache_plan import cache_wanted, stream_wanted
from dspark.data.held_out import held_out_count
from dspark.training.data_module import ResumableBatchSampler

TINY_TRAIN_ROWS = 100  # fewer training conversations than this: one warning line (tiny_data_warning)


def data_parallel_size(trainer: dict) -> int | None:
    """Ranks that each read their own batches: trainer.devices x trainer.num_nodes; None when that cannot be told
    before the trainer starts (a device list of another form)."""
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    elif str(devices).strip() in ("auto", "-1"):
        accel = str(trainer.get("accelerator", "auto"))
        devices = torch.cuda.device_count() if accel in ("gpu", "cuda", "auto") and torch.cuda.is_available() else 1
    elif isinstance(devices, str) and "," in devices:
        devices = len([d for d in devices.split(",") if d.strip()])
    try:
        return max(1, int(devices)) * max(1, int(nodes))
    except (TypeError, ValueError):
        return None


def rows_per_step(run) -> int | None:
    """Training rows one optimizer step reads over all ranks (batch x gradient accumulation x ranks); None when the
    number of ranks is unknown."""
    world = data_parallel_size(dict(run.trainer))
    if world is None:
        return None
    return int(run.train.batch_size) * int(run.trainer.get("accumulate_grad_batches", 1) or 1) * world


def tiny_data_warning(run, n_train: int, n_held_out: int) -> str | None:
    """One line when the training rows are so few that the draft learns them by heart: how many there are and how many
    passes over them trainer.max_steps implies. None for a data set of ordinary size."""
    if n_train >= TINY_TRAIN_ROWS:
        return None
    per_step = rows_per_step(run)
    steps = int(run.trainer["max_steps"])
    passes = f"{steps * per_step / max(1, n_train):.1f} passes over them" if per_step else "passes unknown"
    return (f"warning: data: only {n_train} training conversations (+{n_held_out} held out; tiny below "
            f"{TINY_TRAIN_ROWS}): trainer.max_steps={steps} x {per_step or '?'} rows a step = {passes}; a draft "
            "trained on so few learns them by heart and its held-out figures say little (more data: data.limit=, "
            "data.path=)")


def cached_rows(run, dataset) -> list[int] | None:
    """The dataset indices a short run's feature cache holds (data.feature_cache=auto, no feature stream): the training
    rows its trainer.max_steps global batches read (the sampler's own order: ResumableBatchSampler over global
    batches, all ranks together) and the held-out rows, ascending. None (the whole set is cached) when the run
    reads half the rows or more, when the number of ranks cannot be told before the trainer starts, for a named
    cache folder (it holds one cache) and for a stream (its producer writes the whole set). The cache of these rows
    is keyed by them (their fingerprint), so a later run that reads other rows builds its own and never takes this
    one for complete; a complete cache of the whole set is read by every run (dspark.data.feature_cache_build)."""
    data = run.data
    if not cache_wanted(data) or stream_wanted(data) or str(data.feature_cache) != "auto":
        return None
    per_step, world = rows_per_step(run), data_parallel_size(dict(run.trainer))
    if per_step is None:
        return None
    n = len(dataset)
    held = held_out_count(data.val_examples, n)
    n_train, global_batch = n - held, int(run.train.batch_size) * world
    batches = int(run.trainer["max_steps"]) * int(run.trainer.get("accumulate_grad_batches", 1) or 1)
    if global_batch > n_train or 2 * (batches * global_batch + held) >= n:
        return None
    lengths = None
    if data.group_by_length:
        lengths = torch.tensor([len(ids) for ids in dataset.select(range(n_train))["input_ids"]])
    sampler = ResumableBatchSampler(n_train, global_batch, batches, int(run.seed), lengths=lengths)
    read = {int(i) for batch in sampler for _, i in batch}
    return sorted(read) + list(range(n_train, n))
