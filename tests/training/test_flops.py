"""dspark.training.flops: the analytical FLOPs of a dense block draft's training step equal what
torch.utils.flop_counter counts around one real training_step forward + backward (DSpark and DFlash, some rows
invalid, every Markov head, a window, the dense mask, the recomputed attention, the materialised loss, a reduced
vocabulary); its parameter count is the module's; the GEMM peak measures; the bench script prints parts that sum
to its total; a run's metrics.json carries the new throughput fields."""
from __future__ import annotations

import importlib.util
import json
import re
import warnings

import pytest
import torch

from conftest import REPO
from dspark.training import flops

V, S, MASK = 40, 24, 39


def _module(markov_rank=4, markov="vanilla", layout=None, window=None, fused=True, draft_vocab=None,
            weights=None, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft
    from dspark.targets.hf_target import FrozenTarget
    from dspark.training.block_module import BlockDraftModule
    from dspark.training.objectives import LossWeights

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)
    target = FrozenTarget(LlamaForCausalLM(cfg), [0, 2])
    draft = DSparkDenseDraft(DSparkDenseConfig.from_target_config(
        cfg, num_layers=layers, block_size=3, mask_token_id=MASK, target_layer_ids=[0, 2], markov_rank=markov_rank,
        markov_head_type=markov, layout=layout, sliding_window=window, draft_vocab_size=draft_vocab))
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    w = weights or ((1.0, 0.0, 0.0) if markov_rank == 0 else (0.1, 0.9, 1.0))
    module = BlockDraftModule(draft, target, fused_loss=fused, loss_weights=LossWeights(*w))
    return module.train()


def _batch(module, keep_all=False):
    """2 sequences of S tokens; row 1's loss mask ends at 18 and its last anchor slot is padding, so some blocks
    end early (eval_mask prefixes of different lengths). Features given, as data.feature_cache hands them."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, MASK, (2, S), generator=g)
    loss_mask = torch.ones(2, S, dtype=torch.long)
    if not keep_all:
        loss_mask[1, 18:] = 0
    batch = {"input_ids": ids, "attention_mask": torch.ones(2, S, dtype=torch.long), "loss_mask": loss_mask,
             "anchors": torch.tensor([[3, 9, 15, 20], [2, 8, 14, 0 if not keep_all else 16]]),
             "keep": torch.tensor([[True] * 4, [True, True, True, keep_all]])}
    feats = module.target.features(ids, batch["attention_mask"])
    batch["aux"], batch["final"] = feats.aux, feats.final
    return batch


def _counted(module, batch) -> dict[str, int]:
    """FlopCounterMode around training_step + backward -> {"gemm": mm / addmm / addmm_, "bmm": batched}."""
    from torch.utils.flop_counter import FlopCounterMode

    def addmm_flop(self_shape, a_shape, b_shape, *args, **kwargs) -> int:  # in place, as the fused loss runs it
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_flop})
    with warnings.catch_warnings(), counter:
        warnings.filterwarnings("ignore", message=".*self.log.*")
        module.training_step(batch, 0).backward()
    by_op = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    bmm = by_op.pop("aten.bmm", 0)
    assert set(by_op) <= {"aten.mm", "aten.addmm", "aten.addmm_"}, by_op
    return {"gemm": sum(by_op.values()), "bmm": bmm, "total": counter.get_total_flops()}


CASES = {
    "dspark": {},
    "dspark_all_valid": {"keep_all": True},
    "dflash": {"markov_rank": 0, "layout": "mask"},
    "dspark_ce_only": {"weights": (1.0, 0.0, 0.0)},  # no teacher GEMM, confidence head forward only
    "gated": {"markov": "gated"},
    "rnn": {"markov": "rnn"},
    "window": {"window": 5},  # each block's own window gathered
    "dense_mask": {"dense_mask": True},
    "recompute": {"recompute": True},  # checkpointed attention: its forward again in the backward
    "recompute_window": {"recompute": True, "window": 5},
    "unfused": {"fused": False},  # [N, V] logits over every prediction row
    "reduced_vocab": {"draft_vocab": 24},
    "one_layer": {"layers": 1},
}


@pytest.mark.parametrize("case", list(CASES))
def test_analytical_flops_equal_the_counted_ones(case, monkeypatch):
    """The count is exact by construction (integer shapes, the same GEMMs), so the totals must be EQUAL: any
    tolerance would hide a missed or extra GEMM (the smallest here, the confidence head, is ~0.1 % of a step)."""
    kw = dict(CASES[case])
    keep_all, dense_mask, recompute = kw.pop("keep_all", False), kw.pop("dense_mask", False), kw.pop("recompute", False)
    if recompute:
        monkeypatch.setattr("dspark.ops.attention.RECOMPUTE_BYTES", 0)
    module = _module(**kw)
    module.packed_attention_mask = not dense_mask
    batch = _batch(module, keep_all)
    parts, shapes = flops.module_step_flops(module, batch)
    counted = _counted(module, batch)
    assert shapes.attention_recompute == recompute
    assert (shapes.loss_rows < shapes.pred_rows) == (not keep_all)  # invalid rows are not scored (fused)
    assert parts["attention"] == counted["bmm"], (case, parts, counted)
    assert parts["total"] - parts["optimizer"] == counted["total"], (case, parts, counted)
    assert sum(parts[p] for p in flops.PARTS) == parts["total"]


def test_parameter_count_is_the_modules():
    for kw in ({}, {"markov_rank": 0, "layout": "mask"}, {"markov": "gated"}, {"markov": "rnn"},
               {"draft_vocab": 24}):
        module = _module(**kw)
        n = sum(p.numel() for p in module.draft.parameters() if p.requires_grad)
        assert flops.trainable_params(flops.DraftDims.from_config(module.draft.config)) == n, kw


def test_attention_work_follows_the_anchors():
    """A block sees the context before its anchor: later anchors, more pairs; a window caps them; padding slots
    (anchor 0) see their own block only."""
    early = flops.attention_work(torch.tensor([[2, 3]]), 4, 100, None, 4)[0]
    late = flops.attention_work(torch.tensor([[60, 90]]), 4, 100, None, 4)[0]
    windowed = flops.attention_work(torch.tensor([[60, 90]]), 4, 100, 10, 4)[0]
    pad = flops.attention_work(torch.tensor([[0, 0]]), 4, 100, None, 4)[0]
    assert pad == 2 * 4 * 4 < early < windowed < late
    assert flops.attention_work(torch.tensor([[60, 90]]), 4, 100, None, 4, packed=False)[0] == 8 * 108


def test_precision_dtype_and_gemm_peak():
    assert flops.precision_dtype("bf16-mixed") is torch.bfloat16
    assert flops.precision_dtype("32-true") is torch.float32
    with pytest.raises(ValueError):
        flops.precision_dtype("fp8")
    peak = flops.gemm_peak(32, 256, torch.float32, budget_s=0.05)
    assert peak["gflops"] >= peak["median_gflops"] > 0 and peak["repeats"] >= 3
    assert peak["threads"] == torch.get_num_threads() and peak["dtype"] == "float32"
    assert peak["shape"] == [768, 32, 256]


# ---- the bench script and a run's metrics.json ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from dspark.targets.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("flops") / "target")


def tiny_overrides(target, run_dir) -> list[str]:
    """A dense DSpark draft on the tiny Llama (experiment=dflash2_tiny's data and target, draft dspark_smollm2)."""
    return [f"target.path={target}", "draft=dspark_smollm2", "draft.target_layer_ids=[0,2]", "draft.mask_token_id=4",
            "draft.num_layers=1", "draft.block_size=3", "draft.markov_rank=8", "data.limit=40", "data.val_examples=4",
            "data.max_length=96", "train.loss_weights={ce: 0.1, l1: 0.9, conf: 1.0}", f"run_dir={run_dir}",
            "trainer.enable_progress_bar=false"]


def test_bench_script_prints_parts_that_sum_to_the_total(tiny_llama, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_step_flops", REPO / "benchmarks" / "bench_step_flops.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(["--experiments", "dflash2_tiny", "--steps", "1", "--warmup", "1", "--profile-top", "5",
                          "--peak-budget-s", "0.1", *tiny_overrides(tiny_llama, tmp_path / "run")])
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\| (\w+) \| (\d+) \|", out, flags=re.M))  # | part | FLOP | ...
    assert set(rows) == {*flops.PARTS, "total"}, out
    assert sum(int(rows[p]) for p in flops.PARTS) == int(rows["total"]) > 0
    (r,) = results
    assert r["flops_per_step"]["total"] == int(rows["total"]) and 0 < r["mfu"]
    assert r["loss_tokens_per_step"] > 0 and r["s_per_step"] > 0
    assert "aten::mm" not in {name for name, *_ in r["top_ops"]} and r["top_ops"]


def test_run_metrics_carry_flops_and_mfu(tiny_llama, tmp_path):
    from conftest import compose

    from dspark.training.run import run_training

    run = tmp_path / "run"
    cfg = compose(["experiment=dflash2_tiny", *tiny_overrides(tiny_llama, run), "trainer.max_steps=5",
                   "trainer.val_check_interval=5", "validate_at_start=false"])
    run_training(cfg)
    t = json.loads((run / "metrics.json").read_text())["throughput"]
    assert t["timed_steps"] == 2
    fps = t["flops_per_step"]
    assert sum(fps[p] for p in flops.PARTS) == pytest.approx(fps["total"], rel=1e-9) and fps["lm_head_loss"] > 0
    assert t["loss_tokens_per_s"] > 0 and t["gemm_peak_dtype"] == "float32" and t["threads"] >= 1
    assert t["mfu"] == pytest.approx(fps["total"] / t["s_per_step"] / (t["gemm_peak_gflops"] * 1e9), rel=0.02)


def test_bench_script_counts_a_chain_draft_with_torch_and_its_loss_tokens_are_the_scored_rows(tmp_path):
    """A draft dspark.training.flops does not model (EAGLE-3): one step under FlopCounterMode, plus the optimizer's
    16 FLOP / parameter; its loss tokens are the rows the chain's steps score (recursive_forward's labels)."""
    import torch

    from dspark.training.mtp_objectives import recursive_forward

    spec = importlib.util.spec_from_file_location("bench_step_flops", REPO / "benchmarks" / "bench_step_flops.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    overrides = ["data.limit=24", "data.val_examples=4", "data.max_length=64", f"run_dir={tmp_path / 'run'}"]
    cfg = bench.compose_config("eagle3_tiny", overrides)
    module, opt, sched, datamodule = bench.build(cfg, overrides)
    batch = bench.batches(module, datamodule, 1, "cpu")[0]
    step = bench.make_step(module, opt, sched, None, bench.autocast_for("32-true", "cpu"), "cpu")
    parts, tokens = bench.step_flops(module, step, batch, 0)
    params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert parts["optimizer"] == flops.OPTIMIZER_FLOPS_PER_PARAM * params
    assert parts["total"] == parts["counted"] + parts["optimizer"] and parts["counted"] > 0
    ids, lm = batch["input_ids"], batch["loss_mask"] * batch["attention_mask"]
    with torch.no_grad():
        feats = module.features(batch)
        steps = recursive_forward(module.draft, module.draft.context_hidden(feats), ids, lm, feats.final,
                                  module.num_steps)
    assert tokens == sum(int(st.labels.numel()) for st in steps) > 0
    # the counted FLOPs hold at least the LM head's forward over those rows (2 x rows x H x draft vocabulary)
    d = module.draft.config
    vd = int(getattr(d, "draft_vocab_size", None) or d.vocab_size)
    assert parts["counted"] >= 2 * tokens * int(d.hidden_size) * vd
    (r,) = bench.main(["--experiments", "eagle3_tiny", "--steps", "1", "--warmup", "0", "--profile-top", "0",
                       "--peak-budget-s", "0.1", *overrides])  # the whole script, its MFU against the head's GEMM
    assert set(r["flops_per_step"]) == {"counted", "optimizer", "total"} and 0 < r["mfu"]
    assert r["gemm_peak"]["shape"][2] == vd


def _eagle3_tiny_run(run_dir) -> dict:
    from conftest import compose

    from dspark.training.run import run_training

    run_training(compose(["experiment=eagle3_tiny", "data.limit=24", "data.val_examples=4", "data.max_length=64",
                          f"run_dir={run_dir}", "trainer.max_steps=5", "trainer.val_check_interval=5",
                          "validate_at_start=false", "trainer.enable_progress_bar=false"]))
    return json.loads((run_dir / "metrics.json").read_text())["throughput"]


def test_run_metrics_of_a_draft_flops_does_not_model_carry_counted_flops(tmp_path, monkeypatch):
    """EAGLE-3 (no shape model in dspark.training.flops): after training, one more step on the last timed batch runs
    under torch's FlopCounterMode with a copy of the draft; metrics.json carries that count plus the optimizer's FLOPs
    per step, the loss tokens the chain scores and the MFU from the FLOPs per token. The count leaves the run as it
    was: its trained draft is bit for bit the one of a run that counts nothing."""
    from dspark.pretrained import load_draft
    from dspark.training.callbacks import Throughput

    t = _eagle3_tiny_run(tmp_path / "run")
    assert (t["flop_counted_steps"], t["timed_steps"]) == (1, 2)  # steps 1-3 warm up, 4-5 timed
    fps = t["flops_per_step"]
    assert set(fps) == {"counted", "optimizer", "total"} and fps["total"] == fps["counted"] + fps["optimizer"]
    draft, _ = load_draft(tmp_path / "run" / "draft")
    params = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    assert fps["optimizer"] == flops.OPTIMIZER_FLOPS_PER_PARAM * params
    d = draft.config
    vd = int(d.draft_vocab_size or d.vocab_size)
    # at least the LM head's forward and backward over the scored rows (3 x 2 x rows x H x Vd)
    assert fps["counted"] >= 6 * t["loss_tokens_per_step"] * int(d.hidden_size) * vd > 0
    assert t["mfu"] == pytest.approx(t["achieved_gflops"] / t["gemm_peak_gflops"], rel=1e-3)
    assert t["gemm_peak_shape"][2] == vd

    monkeypatch.setattr(Throughput, "replay_flops", lambda self, trainer, pl_module: None)
    assert "flops_per_step" not in _eagle3_tiny_run(tmp_path / "uncounted")
    counted, uncounted = ((tmp_path / r / "draft" / "model.safetensors").read_bytes() for r in ("run", "uncounted"))
    assert counted == uncounted
