"""The training pieces of a run from its typed config (dspark.schema.RunConfig): the DataModule, with the feature
cache its batches read, and the LightningModule of the draft's objective. The target, the draft and the rows come
from dspark.factory (which eval and export share); training.run assembles them."""
from __future__ import annotations

from dspark import factory
from dspark.data import feature_stream
from dspark.data.cache_plan import FeatureCachePlan, cache_wanted, stream_wanted
from dspark.data.feature_cache_build import prepare_feature_cache
from dspark.data.held_out import held_out_count
from dspark.ops.backend import set_ops_backend
from dspark.schema import RunConfig, run_config, typed
from dspark.targets.hf_target import FrozenTarget
from dspark.training.cache_plan import feature_cache_plan
from dspark.training.data_module import ChatDataModule
from dspark.training.data_plan import cached_rows
from dspark.training.module import OptimConfig
from dspark.training.modules import MODULES


def build_datamodule(run: RunConfig, tokenizer, dataset=None, target: FrozenTarget | None = None,
                     plan: FeatureCachePlan | None = None) -> ChatDataModule:
    """Train/val DataModule; with data.feature_cache set, builds (or reuses) the offline feature cache for `target`
    first (dspark.data.feature_cache_build, from the run's `plan`: training.cache_plan.feature_cache_plan, made here
    when not given; a short run's holds only the rows it reads, data_plan.cached_rows), and the batches then carry
    the cached features; with data.feature_stream the cache is read while a child process writes it
    (dspark.data.feature_stream, told the run config as it is now) and the first pass over the data follows the
    order the shards are written in."""
    run = run_config(run)
    data, train, trainer = run.data, run.train, run.trainer
    if cache_wanted(data) and target is None:
        raise ValueError("build_datamodule: data.feature_cache needs the target (pass target=)")
    dataset = dataset if dataset is not None else factory.build_dataset(data, tokenizer)
    plan = plan if plan is not None else feature_cache_plan(run)
    features = prepare_feature_cache(plan, target, dataset, cached_rows(run, dataset),  # a short run: its rows only
                                     child_config=run.values() if stream_wanted(data) else None)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    val = held_out_count(data.val_examples, len(dataset))  # auto -> its count (run.choose_held_out says it)
    # streamed: the first pass follows the producer's shards (whether or not the cache is complete by now)
    groups = feature_stream.first_pass_groups(len(dataset), val, feature_stream.SHARD_SIZE) \
        if stream_wanted(data) else None
    return ChatDataModule(
        dataset, pad_id=int(pad), batch_size=train.batch_size, num_anchors=train.num_anchors,
        total_batches=int(trainer["max_steps"]) * int(trainer["accumulate_grad_batches"]),
        val_examples=val, val_batch_size=train.val_batch_size,
        seed=run.seed, num_workers=data.num_workers, features=features, first_pass_groups=groups,
        group_by_length=data.group_by_length,
    )


def build_module(run: RunConfig, draft, target: FrozenTarget):
    """The LightningModule of the draft family's objective (dspark.training.modules.MODULES), from that objective's
    train.* keys (its KEYS, typed here) and the shared optimisation keys; the run config's plain values (the draft
    section as its resolved draft group) are its hyper_parameters."""
    run = run_config(run)
    set_ops_backend(run.ops_backend)
    module_cls = MODULES[run.draft_family.objective]
    optim = OptimConfig.from_keys(run.train, run.trainer["max_steps"])
    module = module_cls.from_config(typed(module_cls.KEYS, run.objective), draft, target, optim)
    # the resolved run config: in every checkpoint (hyper_parameters) and every logger (hparams.yaml, W&B config)
    module.save_hyperparameters(run.values())
    return module
