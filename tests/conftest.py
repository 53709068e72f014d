"""Shared fixtures: Hydra config composition for end-to-end runs, an isolated dataset cache."""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported: see train.py

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# Small enough for 2 CPU cores: a handful of steps on ~100 ShareGPT conversations.
TINY_RUN = [
    "data.limit=160", "data.val_examples=8", "data.max_length=128",
    "train.batch_size=4", "train.val_batch_size=8", "train.num_anchors=4",
    "trainer.max_steps=6", "trainer.val_check_interval=3", "callbacks.last_checkpoint.every_n_train_steps=1",
    "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "validate_at_start=false",
    "draft.num_layers=1",
]


@pytest.fixture(scope="session", autouse=True)
def _dataset_cache(tmp_path_factory):
    """One tokenized-dataset cache per test session (never the user's ~/.cache)."""
    if "DSPARK_CACHE" not in os.environ:
        cache = tmp_path_factory.mktemp("dspark_cache")
        os.environ["DSPARK_CACHE"] = str(cache)
        # the C++ CPU kernels (dspark.ops.cpu_kernels) are built once per test run, not once per xdist worker: their
        # build folder is shared by the workers (torch's build takes a lock; the name is per kernel version)
        base = tmp_path_factory.getbasetemp()
        shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "torch_extensions"
        shared.mkdir(exist_ok=True)
        (cache / "torch_extensions").symlink_to(shared, target_is_directory=True)
    yield


def compose(overrides: list[str], config_name: str = "config"):
    """train.py's config (config_name "eval": eval.py's) from the repo's configs/ with these overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


def compose_eval(*overrides: str):
    return compose(list(overrides), config_name="eval")


def tiny_chat_bench(root) -> Path:
    """A two-conversation benchmark folder (chat.jsonl: three turns in all) for eval.py's data_dir."""
    bench = root / "bench"
    bench.mkdir()
    (bench / "chat.jsonl").write_text('{"turns": ["How do I make a good cup of tea?", "And coffee?"]}\n'
                                      '{"turns": ["Write a short poem about the sea."]}\n')
    return bench


def tiny_v4_config(**overrides):
    """A 3-layer DeepSeek-V4 small enough for hand-sized tests (sliding attention + MoE, hc 2, topk_method
    "noaux_tc" as released V4 configs: vLLM builds the gate bias only then)."""
    from transformers import DeepseekV4Config

    keys = dict(vocab_size=50, hidden_size=16, moe_intermediate_size=8, num_hidden_layers=3, num_attention_heads=2,
                head_dim=8, partial_rotary_factor=0.5, q_lora_rank=8, o_groups=1, o_lora_rank=4, n_routed_experts=2,
                num_experts_per_tok=1, hc_mult=2, sliding_window=4, layer_types=["sliding_attention"] * 3,
                mlp_layer_types=["moe"] * 3, topk_method="noaux_tc")
    keys.update(overrides)
    return DeepseekV4Config(**keys)


# ---- comparing results of float computations done through different shapes ---------------------------
# float32 matmuls of different shapes (chunked rows, a reduced vocabulary, another batch size or thread count)
# may round differently in the last bits: values agree to a few ulps, not bit for bit. Relative error of a
# float32 dot product of length K is bounded by about K * 2^-24; for the tiny tests here (K <= 64, |x| <= ~10)
# 1e-5 absolute is a generous bound that still catches any real difference (wrong row, wrong id, wrong bias).
FP32_CROSS_SHAPE_ATOL = 1e-5


def tiny_llama_target(vocab: int):
    """A seeded random 2-layer Llama (hidden 32) as a FrozenTarget tapping both layers: the dense draft tests' target."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dspark.targets.hf_target import FrozenTarget

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
    return FrozenTarget(LlamaForCausalLM(cfg), [0, 1])


def vllm_or_skip() -> Path:
    """The interpreter of vLLM's venv (dspark.serving.engine.vllm_python); without one the test skips, saying why, except
    under DSPARK_REQUIRE_VLLM=1 (.ci/run: the vLLM checks must run, never skip)."""
    from dspark.serving.engine import VLLMUnavailable, vllm_python

    try:
        return vllm_python()
    except VLLMUnavailable as exc:
        if os.environ.get("DSPARK_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(str(exc))


def wait_until(proc, what: str, cond, last_words, limit_s: float = 600.0) -> None:
    """Polls `cond` (what the child process has done: a file, a logged step) until it holds. The child ending first
    fails naming `what` and its `last_words()`; `limit_s` is a safety net against a hang, never the condition."""
    import time

    deadline = time.monotonic() + limit_s
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"the process ended (rc {proc.returncode}) before {what}:\n{last_words()[-3000:]}")
        assert time.monotonic() < deadline, f"safety net: no {what} after {limit_s:.0f} s"
        time.sleep(0.01)


def assert_same_argmax(got_ids, ref_ids, ref_logits, atol: float = FP32_CROSS_SHAPE_ATOL):
    """Token ids picked by argmax from logits computed two ways: equal, except where the reference's logits
    of the two ids are within `atol` (a near-tie that rounding may break either way)."""
    import torch

    assert got_ids.shape == ref_ids.shape
    diff = got_ids != ref_ids
    if diff.any():
        at_got = ref_logits.gather(-1, got_ids.unsqueeze(-1)).squeeze(-1)
        at_ref = ref_logits.gather(-1, ref_ids.unsqueeze(-1)).squeeze(-1)
        gap = (at_ref - at_got).abs()[diff]
        assert bool((gap <= atol).all()), f"argmax differs beyond rounding: gaps {gap.tolist()} > {atol}"
    return torch.equal(got_ids, ref_ids)


def reseal(folder) -> None:
    """Re-writes the checksum manifest of a folder a test edited by hand, so that what the test checks (names,
    shapes, configs) is judged, not the edit itself (tests/test_faults.py covers the integrity refusals)."""
    from dspark.integrity import write_manifest

    write_manifest(folder)


# ---- the end of a test run: how many tests skipped, and why ------------------------------------------------
def skip_reasons(reports) -> list[tuple[str, int]]:
    """(reason, count) of skipped test reports, most frequent first (`-ra` lists them one by one)."""
    from collections import Counter

    counts: Counter = Counter()
    for rep in reports:
        longrepr = getattr(rep, "longrepr", None)
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        counts[str(reason).removeprefix("Skipped: ")] += 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After the `-ra` list (printed when the terminal reporter's own summary ends), before the `N passed` line."""
    try:
        return (yield)
    finally:
        _print_skip_counts(terminalreporter)


def _print_skip_counts(terminalreporter) -> None:
    reasons = skip_reasons(terminalreporter.stats.get("skipped", []))
    if not reasons:
        return
    total = sum(n for _, n in reasons)
    terminalreporter.section(f"{total} skipped, by reason", sep="-")
    for reason, n in reasons:
        terminalreporter.line(f"{n:4d} x {reason}")
    if any("vllm" in reason.lower() for reason, _ in reasons):
        terminalreporter.line("what CI runs (vLLM and its sources installed, nothing vLLM skipped): bash .ci/run")


def tiny_dense_dspark_run(root):
    """(cfg, target, draft, run dir): a dense DSpark draft (Markov + confidence head, block 3) against a tiny HF Llama
    target (vocabulary 50, word-level tokenizer, eos t1) written under `root`, its RUN/draft/ as train.py leaves it."""
    import torch
    from omegaconf import OmegaConf
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from dspark import factory
    from dspark.training.run import export_draft

    vocab = {f"t{i}": i for i in range(50)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0")),
                                  unk_token="t0", eos_token="t1")
    tok.save_pretrained(root / "target")
    torch.manual_seed(0)
    hf = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(hf).save_pretrained(root / "target")
    draft_cfg = {"kind": "dspark_dense", "num_layers": 1, "block_size": 3, "mask_token_id": 49,
                 "target_layer_ids": [0, 2], "markov_rank": 4, "markov_head_type": "vanilla", "sliding_window": None,
                 "layout": "anchor", "init_from_target": False, "arch": {}}
    cfg = OmegaConf.create({"target": {"kind": "hf", "path": str(root / "target"), "dtype": "float32"},
                            "draft": draft_cfg})
    target = factory.build_target(cfg.target, cfg.draft)
    draft = factory.build_draft(cfg.draft, target)
    export_draft(draft, cfg.draft, cfg.target, root / "run" / "draft", target.fingerprint())  # records target.json as train.py
    return cfg, target, draft, root / "run"


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fails the test if any target loads (inputs must be refused before)."""
    from dspark import factory  # noqa: PLC0415

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(factory, "build_target", refuse)


@pytest.fixture(scope="module")
def v4_run(tmp_path_factory):
    """An untrained DSpark draft of the tiny DeepSeek-V4 target, sealed as a finished run leaves draft/."""
    from dspark import factory  # noqa: PLC0415
    from dspark.training.run import export_draft  # noqa: PLC0415

    run = tmp_path_factory.mktemp("v4_run")
    cfg = compose(TINY_RUN + [f"run_dir={run}"])
    target = factory.build_target(cfg.target, cfg.draft)
    export_draft(factory.build_draft(cfg.draft, target), cfg.draft, cfg.target, run / "draft", target.fingerprint())
    return run
