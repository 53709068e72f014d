"""Every check of a training config that needs no model weights, in one place, run before anything heavy loads:
a bad value fails in about a second with one line naming the key, not after the target has loaded.

First the schema (dspark.schema: every key known, typed, in range), then the rules between keys and against the
target's config.json: anchors vs sequence length, drafts per step vs sequence length, the data file, the feature
cache vs the objective, the trainer settings the run depends on. The draft group is resolved against the target
(dspark.draft_resolve) when the schema builds the run config, before these rules read it."""
from __future__ import annotations

from pathlib import Path

from dspark import schema
from dspark.data.jsonl import iter_jsonl_records, require_usable_records
from dspark.errors import require
from dspark.models.contract import optional


def command_line_overrides() -> list[str]:
    """The command line's overrides when running under Hydra (else none)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    except Exception:  # noqa: BLE001 (no Hydra run: nothing to read)
        return []


def check_train(run: schema.RunConfig) -> None:
    anchors, length = run.train.num_anchors, run.data.max_length
    require(anchors < length, "train.num_anchors",
            f"{anchors} anchors cannot fit in a sequence of data.max_length={length} (an anchor a needs a loss-masked "
            f"token a+1): use fewer than {length}")


def check_trainer(run: schema.RunConfig) -> None:
    """The Trainer keys the run depends on (the rest Lightning checks when the Trainer is built)."""
    t = run.trainer
    steps = t.get("max_steps")
    require(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1, "trainer.max_steps",
            f"must be an int >= 1 (runs are bounded by steps: the data and the LR schedule follow it), got {steps!r}")
    acc = t.get("accumulate_grad_batches")
    require(isinstance(acc, int) and acc >= 1, "trainer.accumulate_grad_batches", f"must be an int >= 1, got {acc!r}")
    require(not t.get("use_distributed_sampler"), "trainer.use_distributed_sampler",
            "must stay false: ChatDataModule shards, shuffles and resumes its own batches")
    if str(t.get("strategy", "")).startswith("deepspeed"):
        import importlib.util

        require(importlib.util.find_spec("deepspeed") is not None, "trainer.strategy",
                "DeepSpeed needs `pip install dspark[deepspeed]`")
    for name, spec in (run.logger or {}).items():
        if spec is not None and str(spec["_target_"]).endswith("WandbLogger"):
            import importlib.util

            require(importlib.util.find_spec("wandb") is not None, f"logger.{name}",
                    "W&B needs `pip install dspark[wandb]`")


def check_data(run: schema.RunConfig) -> None:
    data, fam = run.data, run.draft_family
    depth_key = fam.drafts_key  # an int >= 1 (dspark.schema.check_draft_keys)
    depth = int(getattr(run.draft, depth_key))
    require(data.max_length > depth + 1, "data.max_length",
            f"{data.max_length} is too short for draft.{depth_key} {depth}")
    if data.source != "sharegpt":
        hint = ""
        if data.source == "regenerated":  # the SmolLM2 answers the repository ships packed, or how to make them
            hint = ("; the repository ships 5,023 regenerated SmolLM2 conversations: `python scripts/pack_regenerated.py "
                    "unpack smollm2_sharegpt_5k` (+ smollm2_reasoning_gym_1500) writes data/regenerated/, then "
                    "data.path=data/regenerated/smollm2_sharegpt_5k.jsonl; or regenerate your own with "
                    "scripts/regenerate.py (README, 'A real target')")
        require(data.path is not None and Path(data.path).is_file(), "data.path", f"{data.path!r} is not a file{hint}")
        require_usable_records(data.path, strict=data.strict)  # 0 usable lines: refused now
        if data.strict:  # refuse a malformed line now, naming it, not after the target has loaded
            from itertools import islice

            for _ in islice(iter_jsonl_records(data.path, strict=True), data.limit):
                pass
    if data.feature_cache in (None, "", False):
        require(not data.feature_stream, "data.feature_stream",
                "streams the features into the feature cache: set data.feature_cache (auto or a folder)")
        return
    require(not optional(fam.draft, "needs_pre_head"), "data.feature_cache",
            f"the cache stores no pre-hc_head stream, which draft.kind={fam.kind} reads; set it to null")
    layout = data.feature_cache_layout
    drops = layout.teacher_rows != "all" or layout.context_rows != "all"
    require(not drops or fam.objective == "block", "data.feature_cache_layout",
            f"teacher_rows={layout.teacher_rows} / context_rows={layout.context_rows} drop rows only a block "
            f"objective never reads; draft.kind={fam.kind} trains the {fam.objective!r} objective, which reads the "
            "final hidden of every context position: use teacher_rows=all, context_rows=all")


def check_warm_start(run: schema.RunConfig) -> None:
    """draft.init_from names a folder when a new run starts from it (a resumed run restores its checkpoint and never
    reads it: dspark.training.run)."""
    source = run.draft_start.init_from
    if source and run.resume in (None, "", False):
        require(Path(str(source)).expanduser().is_dir(), "draft.init_from",
                f"{source!r} is not a folder (a trained RUN/draft, or a serving export of a draft of the same target)")


def check_training_config(cfg, overrides: list[str] | None = None) -> schema.RunConfig:
    """The final run config (dspark.schema.RunConfig: every key checked, the draft group resolved against the
    target's config.json, dspark.draft_resolve), after the rules between keys; raises ConfigError naming the first bad
    key; loads no model weights. `cfg`: Hydra's DictConfig (or its plain values)."""
    run = schema.run_config(cfg, command_line_overrides() if overrides is None else overrides)
    check_train(run)
    check_trainer(run)
    check_data(run)
    check_warm_start(run)
    return run
