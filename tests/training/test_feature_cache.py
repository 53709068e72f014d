"""Offline target-feature cache: equals the online features, resumes an interrupted build, refuses a cache
built for another target / layer ids / dataset, and trains to the same losses as the online path."""
from __future__ import annotations

import pickle

import datasets
import lightning as L
import pytest
import torch
from transformers import DeepseekV4ForCausalLM, LlamaConfig, LlamaForCausalLM

from conftest import tiny_v4_config, TINY_RUN, compose
from dspark.data.feature_cache import META_NAME, FeatureCache, build_feature_cache, dataset_fingerprint, shard_name
from dspark.factory import ConfigError
from dspark.targets.hf_target import FrozenTarget
from dspark.training.data_module import ChatDataModule

LENGTHS = [5, 9, 3, 12, 7, 4, 10]  # 7 examples -> shards of 3: [0,3) [3,6) [6,7)


def tiny_v4(seed: int = 0) -> DeepseekV4ForCausalLM:
    torch.manual_seed(seed)
    cfg = tiny_v4_config()
    return DeepseekV4ForCausalLM(cfg).eval()


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(cfg).eval()


def make_rows(lengths=LENGTHS, seed: int = 1) -> datasets.Dataset:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(2, 50, (n,), generator=g).tolist() for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[0] + [1] * (n - 1) for n in lengths]})


@pytest.fixture(scope="module")
def target() -> FrozenTarget:
    return FrozenTarget(tiny_v4(), [0, 2])


def read_all(path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = FeatureCache(path)
    return [cache.get(i, dtype=None) for i in range(len(cache))]


def one_example(target, ids: list[int]):
    f = target.features(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    return f.aux[0], f.final[0]  # [S, n*H], [S, H]


# ---- content ---------------------------------------------------------------------------------------
def test_float32_cache_is_exactly_the_target_features(target, tmp_path):
    rows = make_rows()
    path = build_feature_cache(target, rows, tmp_path, batch_size=2, dtype=torch.float32, shard_size=3)
    cache = FeatureCache(path)
    assert len(cache) == len(rows) and cache.meta["num_shards"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [META_NAME] + [shard_name(k) for k in range(3)]
    # the builder's batches (per shard, batch_size 2, shortest first): the same padded forward gives identical numbers
    for batch in ([2, 0], [1], [5, 4], [3], [6]):
        seqs = [rows[i]["input_ids"] for i in batch]
        S = max(map(len, seqs))
        ids = torch.tensor([s + [0] * (S - len(s)) for s in seqs])  # [B, S]
        am = torch.tensor([[1] * len(s) + [0] * (S - len(s)) for s in seqs])
        f = target.features(ids, am)
        for j, i in enumerate(batch):
            aux, final = cache.get(i)
            n = len(seqs[j])
            assert aux.shape == (n, 32) and final.shape == (n, 16) and aux.dtype == torch.float32
            assert torch.equal(aux, f.aux[j, :n]) and torch.equal(final, f.final[j, :n])
    # and each example alone agrees up to float32 rounding (padding does not leak into real positions)
    for i in range(len(rows)):
        ref_aux, ref_final = one_example(target, rows[i]["input_ids"])
        aux, final = cache.get(i)
        torch.testing.assert_close(aux, ref_aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-5)


def test_bfloat16_cache_matches_per_example_features(target, tmp_path):
    rows = make_rows()
    cache = FeatureCache(build_feature_cache(target, rows, tmp_path, batch_size=3, shard_size=4))
    assert cache.meta["dtype"] == "bfloat16" and cache.meta["aux_size"] == 32 and cache.meta["hidden_size"] == 16
    for i in range(len(rows)):
        ref_aux, ref_final = one_example(target, rows[i]["input_ids"])
        assert cache.get(i, dtype=None)[0].dtype == torch.bfloat16
        aux, final = cache.get(i)  # float32 by default
        torch.testing.assert_close(aux, ref_aux, rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(final, ref_final, rtol=1.6e-2, atol=1e-2)
    with pytest.raises(IndexError, match="index 7"):
        cache.get(7)


def test_cache_pickles_for_dataloader_workers(target, tmp_path):
    rows = make_rows()
    cache = FeatureCache(build_feature_cache(target, rows, tmp_path, shard_size=3))
    before = cache.get(4)
    clone = pickle.loads(pickle.dumps(cache))  # open shard handles are dropped, reopened lazily
    assert all(torch.equal(a, b) for a, b in zip(before, clone.get(4)))


# ---- resume ----------------------------------------------------------------------------------------
class FailOnCall:
    """Wraps target.features: raises on call number `fail_at` (1-based), counts calls."""

    def __init__(self, target: FrozenTarget, fail_at: int | None = None):
        self.inner, self.fail_at, self.calls = target.features, fail_at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("simulated crash in the target forward")
        return self.inner(*args, **kwargs)


def test_interrupted_build_resumes_to_the_clean_result(tmp_path):
    rows = make_rows()
    clean = build_feature_cache(FrozenTarget(tiny_v4(), [0, 2]), rows, tmp_path / "clean", batch_size=3,
                                shard_size=3)
    target = FrozenTarget(tiny_v4(), [0, 2])
    out = tmp_path / "crashed"
    target.features = FailOnCall(target, fail_at=2)  # one batch per shard: dies in the 2nd shard
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_feature_cache(target, rows, out, batch_size=3, shard_size=3)
    assert (out / shard_name(0)).is_file() and not (out / shard_name(1)).exists()
    assert not (out / META_NAME).exists() and not list(out.glob(".*tmp"))  # no torn files
    with pytest.raises(FileNotFoundError, match="meta.json"):
        FeatureCache(out)
    target.features = spy = FailOnCall(target)
    build_feature_cache(target, rows, out, batch_size=3, shard_size=3)
    assert spy.calls == 2  # shards 1 and 2 only
    for (a1, f1), (a2, f2) in zip(read_all(clean), read_all(out)):
        assert torch.equal(a1, a2) and torch.equal(f1, f2)
    build_feature_cache(target, rows, out, batch_size=3, shard_size=3)  # complete: reused as is
    assert spy.calls == 2


def test_shards_of_another_build_are_recomputed_not_trusted(target, tmp_path):
    rows = make_rows()
    wrapped = FrozenTarget(target.model, [0, 2])
    wrapped.features = FailOnCall(wrapped, fail_at=2)
    with pytest.raises(RuntimeError):
        build_feature_cache(wrapped, rows, tmp_path, batch_size=3, shard_size=3, dtype=torch.float32)
    wrapped.features = spy = FailOnCall(wrapped)
    build_feature_cache(wrapped, rows, tmp_path, batch_size=3, shard_size=3, dtype=torch.bfloat16)
    assert spy.calls == 3  # the float32 shard 0 was not reused for a bfloat16 cache
    assert FeatureCache(tmp_path).get(0, dtype=None)[0].dtype == torch.bfloat16


def _damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) - 100]))
    else:
        data[len(data) - 40] ^= 0x20  # inside the last tensor's bytes: safetensors still parses it
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_a_damaged_shard_is_refused_naming_it_and_rebuilds(target, tmp_path, how):
    """meta.json records each shard's sha256 and size: a truncated shard is refused when the cache opens, an
    altered one the first time a process reads it; deleting it + meta.json and rebuilding redoes that shard."""
    from dspark.errors import IntegrityError

    rows = make_rows()
    build_feature_cache(target, rows, tmp_path, batch_size=2, dtype=torch.float32, shard_size=3)
    before = [(a.clone(), f.clone()) for a, f in read_all(tmp_path)]
    _damage(tmp_path / shard_name(1), how)
    if how == "truncate":
        with pytest.raises(IntegrityError, match=r"shard-00001\.safetensors: truncated .*delete"):
            FeatureCache(tmp_path)
    else:
        cache = FeatureCache(tmp_path)
        cache.get(0)  # shard 0 is intact
        with pytest.raises(IntegrityError, match=r"shard-00001\.safetensors: content altered.*delete"):
            cache.get(3)
    (tmp_path / shard_name(1)).unlink()
    (tmp_path / META_NAME).unlink()
    wrapped = FrozenTarget(target.model, target.layer_ids, target.tokenizer)
    wrapped.features = spy = FailOnCall(wrapped)
    build_feature_cache(wrapped, rows, tmp_path, batch_size=2, dtype=torch.float32, shard_size=3)
    assert spy.calls == 2  # shard 1 (rows 3..5, batch 2) only
    assert all(torch.equal(a, b) for x, y in zip(before, read_all(tmp_path)) for a, b in zip(x, y))


# ---- compatibility ---------------------------------------------------------------------------------
def test_check_compatible_names_what_differs(target, tmp_path):
    rows = make_rows()
    cache = FeatureCache(build_feature_cache(target, rows, tmp_path, shard_size=4))
    cache.check_compatible(target, rows)  # same target, same rows: fine
    cache.check_compatible(FrozenTarget(tiny_v4(), [0, 2]), make_rows())  # rebuilt identically: fine
    cases = [
        (FrozenTarget(tiny_v4(seed=1), [0, 2]), rows, r"another target: weights_hash"),  # retrained weights
        (FrozenTarget(tiny_llama(), [0, 2]), rows, r"another target: config_hash"),
        (FrozenTarget(target.model, [0, 1]), rows, r"other layer ids: .*\[0, 2\].*\[0, 1\]"),
        (target, make_rows(seed=2), r"another dataset: .*7 rows"),
        (target, rows.select(range(6)), r"another dataset: .* 6 with hash"),
    ]
    for other_target, other_rows, message in cases:
        with pytest.raises(ValueError, match=message):
            cache.check_compatible(other_target, other_rows)
    # building into a folder that holds another target's cache refuses instead of overwriting it
    with pytest.raises(ValueError, match="other layer ids"):
        build_feature_cache(FrozenTarget(target.model, [1]), rows, tmp_path)
    with pytest.raises(ValueError, match="another dtype"):
        build_feature_cache(target, rows, tmp_path, dtype=torch.float32)


def test_dataset_fingerprint_is_the_content_not_the_container():
    rows = make_rows()
    as_list = [dict(r) for r in rows]
    assert dataset_fingerprint(rows) == dataset_fingerprint(as_list)
    picked = rows.select([5, 0, 3])  # an indices mapping over the same table
    assert dataset_fingerprint(picked) == dataset_fingerprint([as_list[5], as_list[0], as_list[3]])
    assert dataset_fingerprint(picked) != dataset_fingerprint(rows.select([0, 5, 3]))


# ---- data module -----------------------------------------------------------------------------------
def test_datamodule_indexes_the_cache_by_original_dataset_index(target, tmp_path):
    rows = make_rows()
    cache = FeatureCache(build_feature_cache(target, rows, tmp_path, shard_size=3))
    dm = ChatDataModule(rows, pad_id=0, batch_size=2, num_anchors=2, total_batches=2, val_examples=3,
                        val_batch_size=3, seed=0, features=cache)
    batch = next(iter(dm.val_dataloader()))  # val rows are dataset rows 4, 5, 6
    B, S = batch["input_ids"].shape
    assert batch["aux"].shape == (B, S, 32) and batch["final"].shape == (B, S, 16)
    for j, i in enumerate(range(4, 7)):
        n = LENGTHS[i]
        aux, final = cache.get(i, dtype=None)
        assert torch.equal(batch["aux"][j, :n], aux) and torch.equal(batch["final"][j, :n], final)
        assert not batch["aux"][j, n:].any() and not batch["final"][j, n:].any()  # zero padding
    train = next(iter(dm.train_dataloader()))
    for j in range(train["input_ids"].shape[0]):  # each train row finds its own features
        n = int(train["attention_mask"][j].sum())
        i = next(k for k in range(4) if rows[k]["input_ids"] == train["input_ids"][j, :n].tolist())
        assert torch.equal(train["aux"][j, :n], cache.get(i, dtype=None)[0])
    with pytest.raises(ValueError, match="7 examples, the dataset has 6"):
        ChatDataModule(rows.select(range(6)), pad_id=0, batch_size=2, num_anchors=2, total_batches=2,
                       val_examples=2, features=cache)


# ---- end to end ------------------------------------------------------------------------------------
class NoTargetForward(L.Callback):
    """With a feature cache the training/validation steps must not run the target's forward."""

    def on_fit_start(self, trainer, pl_module):
        def refuse(*_a, **_k):
            raise AssertionError("target.features called although the batch carries cached features")

        pl_module.target.features = refuse


def test_cached_training_matches_online_losses(tmp_path):
    from test_train_e2e import train_losses

    from dspark.training.run import run_training

    common = TINY_RUN + ["trainer.max_steps=3", "trainer.val_check_interval=3"]
    online, cached = tmp_path / "online", tmp_path / "cached"
    run_training(compose(common + [f"run_dir={online}"]))
    s = run_training(compose(common + [f"run_dir={cached}", "data.feature_cache=auto",
                                       "data.feature_cache_dtype=float32"]), callbacks=(NoTargetForward(),))
    a, b = train_losses(online), train_losses(cached)
    assert sorted(a) == sorted(b) == [0, 1, 2]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4), step
    assert s["final"]["val/tau_prob"] >= 1.0


def test_explicit_cache_dir_of_another_dataset_is_refused(tmp_path):
    from dspark.training.run import run_training

    common = TINY_RUN + ["trainer.max_steps=1", "trainer.val_check_interval=1", f"data.feature_cache={tmp_path / 'fc'}"]
    run_training(compose(common + [f"run_dir={tmp_path / 'a'}"]))
    assert (tmp_path / "fc" / META_NAME).is_file()
    with pytest.raises(ConfigError, match=r"data\.feature_cache: .*another dataset"):
        run_training(compose(common + [f"run_dir={tmp_path / 'b'}", "data.limit=150"]))
    with pytest.raises(ConfigError, match=r"data\.feature_cache_dtype"):
        run_training(compose(common + [f"run_dir={tmp_path / 'c'}", "data.feature_cache_dtype=float16"]))


def test_a_shards_batches_take_its_examples_shortest_first():
    from dspark.data.feature_cache import shard_batches

    assert shard_batches([5, 9, 3], 2) == [[2, 0], [1]]
    assert shard_batches([4, 4, 1, 4], 3) == [[2, 0, 1], [3]]  # ties keep their order
    assert shard_batches([7], 8) == [[0]] and shard_batches([], 2) == []
