"""Head-only target on a feature-cache hit (issue 26, item 4): only the embedding, LM head and final norm are read
from the checkpoint; the fingerprint and cache identity equal the whole target's; a cached training run that hits
the cache loads head-only and trains to the losses of the run with the whole target; the head-only target refuses
to run its layers."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import lightning as L
import pytest
import torch

from conftest import TINY_RUN, compose
from dspark import factory
from dspark.data.feature_cache import target_identity
from dspark.targets.checkpoint import CheckpointReader
from dspark.errors import ConfigError
from dspark.schema import run_config
from dspark.targets.head_only import HeadOnlyError, HeadOnlyTarget, HeadOnlyUnsupported, load_head_only_target
from dspark.targets.hf_target import FrozenTarget, load_hf_target
from dspark.targets.tiny_hy_v4 import TINY_HY_V4_DIR
from dspark.targets.tiny_v4 import TINY_V4_DIR
from dspark.targets.tiny_v41 import TINY_V41_DIR

TINY = {"tiny_v4": TINY_V4_DIR, "tiny_v41": TINY_V41_DIR, "tiny_hy_v4": TINY_HY_V4_DIR}


def stored_sizes(folder: Path) -> dict[str, int]:
    """Every stored tensor's byte size, from the safetensors headers (read here, independently of the code tested)."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        ["model.safetensors"]
    out = {}
    for name in files:
        with open(folder / name, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out.update({k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"})
    return out


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory) -> Path:
    """A tiny Llama with tied embeddings (the LM head is embed_tokens, not stored), saved in bfloat16 in 3+ shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("tied_llama")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder, max_shard_size="20KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_V4_DIR / f, folder / f)
    assert len(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    assert "lm_head.weight" not in stored_sizes(folder)
    return folder


def folder_of(name: str, tied_llama: Path) -> Path:
    return tied_llama if name == "tied_llama" else TINY[name]


# ---- (a) bytes read -----------------------------------------------------------------------------------
class _Recording:
    """safetensors.safe_open as transformers' loader calls it, recording the tensors it hands out."""

    def __init__(self, log: list[str]):
        from safetensors import safe_open

        self._open, self.log = safe_open, log

    def __call__(self, *args, **kwargs):
        inner, log = self._open(*args, **kwargs), self.log

        class Handle:
            def __getattr__(self, name):
                return getattr(inner, name)

            def __enter__(self):
                inner.__enter__()
                return self

            def __exit__(self, *exc):
                return inner.__exit__(*exc)

            def get_slice(self, key):
                log.append(key)
                return inner.get_slice(key)

            def get_tensor(self, key):
                log.append(key)
                return inner.get_tensor(key)

        return Handle()


@pytest.mark.parametrize("name,head", [
    ("tiny_v4", {"model.embed_tokens.weight", "head.weight", "model.norm.weight"}),  # V4's stored names
    ("tied_llama", {"model.embed_tokens.weight", "model.norm.weight"}),  # the LM head is the embedding
])
def test_head_only_load_reads_the_head_tensors_only(name, head, tied_llama, monkeypatch):
    import transformers.modeling_utils as mu

    folder = folder_of(name, tied_llama)
    sizes = stored_sizes(folder)
    whole: list[str] = []
    monkeypatch.setattr(mu, "safe_open", _Recording(whole))
    full = load_hf_target(str(folder), [1], "float32")
    assert sorted(whole) == sorted(sizes)  # the whole load reads every stored tensor

    read: list[tuple[str, int]] = []
    sampled: list[str] = []
    tensor, elements = CheckpointReader.tensor, CheckpointReader.elements

    def spy_tensor(self, key):
        t = tensor(self, key)
        read.append((key, t.numel() * t.element_size()))
        return t

    def spy_elements(self, key, index):
        sampled.append(key)
        return elements(self, key, index)

    monkeypatch.setattr(CheckpointReader, "tensor", spy_tensor)
    monkeypatch.setattr(CheckpointReader, "elements", spy_elements)
    whole.clear()
    t = load_head_only_target(str(folder), [1], "float32")
    assert whole == [] and sampled == []  # not transformers' loader; no samples while loading
    assert {k for k, _ in read} == head and len(read) == len(head)
    assert sum(b for _, b in read) == sum(sizes[k] for k in head) == t.checkpoint.bytes_read
    assert t.checkpoint.nbytes == sum(sizes.values()) > t.checkpoint.bytes_read
    assert torch.equal(t.embed_weight, full.embed_weight) and torch.equal(t.lm_head_weight, full.lm_head_weight)
    base = t.model.model
    assert torch.equal(base.norm.weight, full.model.model.norm.weight)
    assert all(p.is_meta for p in base.layers.parameters())
    assert (t.lm_head_weight is t.embed_weight) == (name == "tied_llama")


# ---- (c) fingerprint and cache identity from the checkpoint ---------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny_v4", "tiny_v41", "tiny_hy_v4", "tied_llama"])
def test_fingerprint_and_identity_equal_the_whole_targets(name, dtype, tied_llama):
    folder = folder_of(name, tied_llama)
    full, head = load_hf_target(str(folder), [1], dtype), load_head_only_target(str(folder), [1], dtype)
    assert head.fingerprint() == full.fingerprint()
    assert head.cache_identity == target_identity(full) == target_identity(head)  # a cache build keys it the same
    assert head.fingerprint(samples=7) == full.fingerprint(samples=7)  # other sample positions


def test_a_changed_fused_expert_changes_both_fingerprints_alike(tmp_path):
    """V4's stored per-expert w1 / w3 become one fused gate_up_proj [E, 2I, H] (stacked, then concatenated): the
    sampled values must come from the right expert and half, read from the checkpoint."""
    from safetensors.torch import load_file, save_file

    other = tmp_path / "tiny_v4"
    shutil.copytree(TINY_V4_DIR, other)
    sd = load_file(other / "model.safetensors")
    sd["model.layers.1.ffn.experts.1.w3.weight"] += 0.5
    save_file(sd, other / "model.safetensors", metadata={"format": "pt"})
    before = load_head_only_target(str(TINY_V4_DIR), [1], "float32").fingerprint()
    head = load_head_only_target(str(other), [1], "float32")
    full = load_hf_target(str(other), [1], "float32")
    assert head.fingerprint() == full.fingerprint() != before
    assert head.cache_identity == target_identity(full)


# ---- (d) a head-only target cannot run -------------------------------------------------------------------
def test_head_only_target_refuses_to_run(tmp_path):
    import datasets

    from dspark.data.feature_cache import build_feature_cache

    t = load_head_only_target(str(TINY_V4_DIR), [1], "float32")
    ids = torch.tensor([[5, 6, 7]])
    calls = [lambda: t.features(ids), lambda: t.logits(ids), lambda: t.model(input_ids=ids),
             lambda: t.model.model(input_ids=ids)]
    for call in calls:
        with pytest.raises(HeadOnlyError, match="loaded head-only.*decoder layers are not loaded"):
            call()
    with pytest.raises(HeadOnlyError, match="loaded head-only"):  # a cache build names why, writes nothing
        build_feature_cache(t, datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]]}), tmp_path)
    assert not any(tmp_path.iterdir())
    assert t.to("cpu") is t and t.device == torch.device("cpu")
    assert t.logits_from_final(torch.randn(2, 128)).shape == (2, 2048)  # the head works


def test_unmappable_checkpoint_is_refused_naming_the_entry(tied_llama, tmp_path):
    """A stored tensor missing (the whole load would initialise it: no fingerprint could match) is refused."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "gap"
    shutil.copytree(tied_llama, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    gone = "model.layers.1.mlp.up_proj.weight"
    shard = folder / index["weight_map"].pop(gone)
    save_file({k: v for k, v in load_file(shard).items() if k != gone}, shard, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HeadOnlyUnsupported, match=gone.replace(".", r"\.") + ": no stored tensor"):
        load_head_only_target(str(folder), [1], "float32")


@pytest.mark.parametrize("case", ["init_from_target", "unmappable"])
def test_build_target_loads_whole_when_head_only_does_not_do(case, tied_llama, tmp_path, monkeypatch):
    """A hit with draft.init_from_target of a family that does not name the target modules its copy reads
    (dspark_v4) or a checkpoint head_only refuses: the whole target loads."""
    import dspark.data.feature_cache_build as fcb
    from dspark.training.cache_plan import feature_cache_plan

    folder = tied_llama
    if case == "unmappable":
        folder = tmp_path / "quantized"
        shutil.copytree(tied_llama, folder)
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8"}
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(HeadOnlyUnsupported, match="quantized"):
            load_head_only_target(str(folder), [1], "float32")
        monkeypatch.setattr(factory, "load_hf_target", lambda *a, **k: "whole")  # (transformers would quantize)
    else:
        monkeypatch.setattr(factory, "load_head_only_target", lambda *a, **k: pytest.fail("loaded head-only"))
    monkeypatch.setattr(fcb, "cache_status", lambda plan, rows: fcb.CacheStatus(tmp_path, None, True))
    cfg = compose(["experiment=dflash2_tiny", "target=hf", f"target.path={folder}", "target.dtype=float32",
                   "data.feature_cache=auto", "draft.target_layer_ids=[1]"])  # a draft of this dense target
    copies = "dspark_v4" if case == "init_from_target" else None  # a family that does not name what its copy reads
    loading = fcb.target_loading(feature_cache_plan(run_config(cfg)), copies, [{"input_ids": [1, 2]}])
    target = factory.build_target(cfg.target, cfg.draft, loading)
    assert target == "whole" if case == "unmappable" else type(target) is FrozenTarget


@pytest.mark.parametrize("experiment,dtype,num_layers,copied", [
    ("dspark_v41", "float32", 3, ["model.layers.1", "model.layers.2", "model.layers.3"]),  # the last 3 of 4
    ("dspark_v41", "bfloat16", 1, ["model.layers.3"]),
    ("hyv4_mtp", "float32", 1, ["model.layers.3", "model.layers.1.self_attn.indexer"]),  # layer 3 reuses 1's top-k
])
def test_init_from_target_on_a_hit_reads_only_what_it_copies(experiment, dtype, num_layers, copied, tmp_path,
                                                             monkeypatch, caplog):
    """draft.init_from_target on a hit, for the families that name what their copy reads (DeepSeek-V4.1 DSpark: the
    last num_layers decoder layers; HY V4 MTP: the last layer, an indexer, the final norm): the target loads
    head-only plus those modules (bytes counted against the checkpoint's headers), the draft equals the one built
    from the whole target bit for bit, and the copied modules go back to the meta device once it is built."""
    import logging

    import dspark.data.feature_cache_build as fcb
    from dspark.training.cache_plan import feature_cache_plan

    monkeypatch.setattr(fcb, "cache_status", lambda plan, rows: fcb.CacheStatus(tmp_path, None, True))
    overrides = [f"experiment={experiment}", f"target.dtype={dtype}", "draft.init_from_target=true",
                 f"draft.num_layers={num_layers}"]
    cfg = compose(overrides + ["data.feature_cache=auto"])
    with caplog.at_level(logging.INFO, logger="dspark.factory"):
        partial = factory.build_target(cfg.target, cfg.draft,
                                       fcb.target_loading(feature_cache_plan(run := run_config(cfg)), run.copies_target, [{"input_ids": [1, 2]}]))
    assert isinstance(partial, HeadOnlyTarget) and list(partial.init_modules) == copied
    assert f"final norm, {', '.join(copied)}: " in caplog.text
    sizes = stored_sizes(Path(partial.checkpoint.folder))
    head = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}  # (stored as transformers names)
    wanted = sum(n for k, n in sizes.items() if k in head or k.startswith(tuple(f"{c}." for c in copied)))
    assert partial.checkpoint.bytes_read == wanted < partial.checkpoint.nbytes == sum(sizes.values())
    print(f"{experiment}, {copied} copied: read {wanted} of {sum(sizes.values())} bytes")
    torch.manual_seed(0)
    draft = factory.build_draft(cfg.draft, partial)
    assert partial.init_modules == {} and all(p.is_meta for p in partial.model.model.layers.parameters())
    assert not partial.embed_weight.is_meta and not partial.model.model.norm.weight.is_meta

    whole_cfg = compose(overrides)
    whole = factory.build_target(whole_cfg.target, whole_cfg.draft)
    assert type(whole) is FrozenTarget
    torch.manual_seed(0)
    ref = factory.build_draft(whole_cfg.draft, whole).state_dict()
    got = draft.state_dict()
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k
    assert partial.fingerprint() == whole.fingerprint()


# ---- (b) cached training: miss (whole target, builds), then hit (head only), same losses ------------------
class TargetKind(L.Callback):
    def __init__(self):
        self.kinds = []

    def on_fit_start(self, trainer, pl_module):
        self.kinds.append(type(pl_module.target))


def test_cached_training_hit_loads_head_only_with_the_same_losses(tmp_path, monkeypatch):
    from test_train_e2e import train_losses

    from dspark.training.run import run_training

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))  # the first run must miss
    common = TINY_RUN + ["trainer.max_steps=3", "trainer.val_check_interval=3", "data.feature_cache=auto"]
    first, second = TargetKind(), TargetKind()
    run_training(compose(common + [f"run_dir={tmp_path / 'miss'}"]), callbacks=(first,))
    (cache,) = (tmp_path / "cache" / "features").iterdir()

    def refuse(*_a, **_k):
        raise AssertionError("the whole target loaded on a cache hit")

    with monkeypatch.context() as m:
        m.setattr(factory, "load_hf_target", refuse)
        run_training(compose(common + [f"run_dir={tmp_path / 'hit'}"]), callbacks=(second,))
        # a complete cache of other rows is refused before any model loads (head-only or whole)
        m.setattr(factory, "load_head_only_target", refuse)
        with pytest.raises(ConfigError, match=r"data\.feature_cache: .*another dataset"):
            run_training(compose(TINY_RUN + ["trainer.max_steps=1", f"data.feature_cache={cache}", "data.limit=150",
                                             f"run_dir={tmp_path / 'other'}"]))
    assert first.kinds == [FrozenTarget] and second.kinds == [HeadOnlyTarget]
    a, b = train_losses(tmp_path / "miss"), train_losses(tmp_path / "hit")
    assert sorted(a) == [0, 1, 2] and a == b  # exact: the same cached features, embedding and LM head values
    record = [json.loads((tmp_path / run / "draft" / "target.json").read_text()) for run in ("miss", "hit")]
    assert record[0] == record[1] and record[0]["fingerprint"]
