"""FLOPs, time and MFU of a draft's training step (issue #34, "Measure the step").

For each experiment (default: dspark_smollm2 and dflash_smollm2; the other arguments are train.py's Hydra
overrides, applied to every experiment), the module is built as train.py builds it (dspark.training.run._train:
dataset, target, draft, data module with its feature cache, draft vocabulary, factory.build_module) and driven
without a Trainer: `--warmup` steps, then `--steps` timed ones, each what Lightning runs per batch:
zero_grad; [autocast] loss = module.training_step(batch); backward; clip_grad_norm_(trainer.gradient_clip_val);
AdamW step; scheduler step. Precision is trainer.precision (bf16-mixed: autocast bf16 on the CPU; 32-true: fp32).
Batches without target features (data.feature_cache=null) get them before the clock starts, as a feature cache
hands them: the frozen target is never in the timed step (nor in the FLOP count).

Printed per experiment: FLOPs per step by part (dspark.training.flops: matrix products only, optimizer
~16 FLOP/param; exact integers and GFLOP, the mean over the timed steps, each part rounded on its own; a draft
dspark.training.flops does not model, e.g. EAGLE-3 or an MTP head: the matrix products torch's FlopCounterMode counts
in the step's forward and backward, as one part `counted`, plus the optimizer), loss tokens per step (block drafts:
the scored eval rows; chain drafts: the scored rows summed over the chain's steps), the median s/step, the achieved GFLOP/s, the GEMM peak measured here ([768 x H] @ [H x V] at the same
dtype and thread count, best of its repeats, dspark.training.flops.gemm_peak), MFU = achieved / peak; and
torch.profiler's top non-GEMM ops of one more step by self CPU time (GEMM ops: aten::mm / addmm / addmm_ / bmm /
baddbmm / matmul / linear, whose share is printed as one number).

  python benchmarks/bench_step_flops.py                                  # both SmolLM2 experiments (needs their cache)
  python benchmarks/bench_step_flops.py --experiments dspark_smollm2 --steps 8 trainer.precision=bf16-mixed
  python benchmarks/bench_step_flops.py --experiments dflash2_tiny target.path=runs/tiny_llama draft=dspark_smollm2 \
      draft.target_layer_ids=[0,2] draft.mask_token_id=4 draft.num_layers=1 draft.block_size=3   # tiny, seconds
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_EXPERIMENTS = ("dspark_smollm2", "dflash_smollm2")
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::matmul",
                      "aten::linear"})


def compose_config(experiment: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=[f"experiment={experiment}", *overrides])


def build(cfg, overrides: list[str]):
    """-> (module, optimizer, scheduler, data module), as dspark.training.run._train builds them."""
    import lightning as L
    import torch

    sys.path.insert(0, str(REPO))
    from dspark import factory
    from dspark.data.feature_cache_build import rows_before_target, target_loading
    from dspark.errors import ConfigError
    from dspark.preflight import check_training_config
    from dspark.schema import run_config
    from dspark.targets.source import target_folder
    from dspark.training.build import build_datamodule, build_module
    from dspark.training.cache_plan import feature_cache_plan
    from dspark.training.draft_vocab import install_draft_vocab

    check_training_config(cfg, overrides)
    run = run_config(cfg)
    if run.data.feature_stream:
        raise ConfigError("bench_step_flops: data.feature_stream=true is not measured here; build the cache first")
    L.seed_everything(run.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision("high")
    dataset = rows_before_target(run.data, target_folder(run.target), factory.build_dataset)
    plan = feature_cache_plan(run)
    target = factory.build_target(run.target, run.draft, target_loading(plan, run.copies_target, dataset))
    draft = factory.build_draft(run.draft, target, run.draft_start)
    datamodule = build_datamodule(run, target.tokenizer, dataset=dataset, target=target, plan=plan)
    install_draft_vocab(draft, datamodule.train_rows, target.tokenizer)
    module = build_module(run, draft, target)
    device = _device(cfg)
    module.to(device).train()
    module.on_fit_start()  # no Trainer: attaches the target (device, shared embedding / LM head)
    opt_cfg = module.configure_optimizers()
    return module, opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"], datamodule


def _device(cfg) -> str:
    import torch

    acc = str(cfg.trainer.accelerator)
    return "cuda" if acc in ("gpu", "cuda") or (acc == "auto" and torch.cuda.is_available()) else "cpu"


def autocast_for(precision: str, device: str):
    """Lightning's precision as a context: *-mixed -> autocast at its dtype; 32-true -> none."""
    import torch

    from dspark.training.flops import precision_dtype

    precision = str(precision)
    if precision.endswith("mixed"):
        return lambda: torch.autocast(device, dtype=precision_dtype(precision))
    if precision_dtype(precision) != torch.float32:
        raise SystemExit(f"bench_step_flops: trainer.precision={precision} is not measured here (32-true or *-mixed)")
    return contextlib.nullcontext


def batches(module, datamodule, n: int, device: str) -> list[dict]:
    """n training batches on `device`, each with its target features (aux, final): computed here when the data
    module has no feature cache, so the timed step never runs the target."""
    import torch

    out: list[dict] = []
    while len(out) < n:
        for batch in datamodule.train_dataloader():
            batch = {k: v.to(device) for k, v in batch.items()}
            if "final" not in batch:
                with torch.no_grad():
                    feats = module.target.features(batch["input_ids"], batch["attention_mask"])
                batch["aux"], batch["final"] = feats.aux, feats.final
            out.append(batch)
            if len(out) == n:
                break
    return out


def make_step(module, opt, sched, clip: float | None, autocast, device: str):
    import torch

    params = [p for p in module.parameters() if p.requires_grad]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step(batch: dict, i: int) -> float:
        """One training step; returns its wall time in s."""
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = module.training_step(batch, i)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        sched.step()
        sync()
        return time.perf_counter() - t

    return step


def top_ops(prof, n: int) -> tuple[list[tuple[str, float, float, int]], float]:
    """(the n non-GEMM ops with the most self CPU time: (name, self ms, share of the step's self CPU time, calls),
    the GEMM ops' share)."""
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS)
    rest = sorted((e for e in events if e.key not in GEMM_OPS), key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [(e.key, e.self_cpu_time_total / 1e3, e.self_cpu_time_total / total, e.count) for e in rest[:n]]
    return rows, gemm / total


def measure(experiment: str, overrides: list[str], *, steps: int, warmup: int, peak_budget_s: float,
            profile_top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from dspark.training import flops
    from dspark.training.trainer import resolve_precision

    cfg = compose_config(experiment, overrides)
    module, opt, sched, datamodule = build(cfg, overrides)
    device = _device(cfg)
    precision, _ = resolve_precision(cfg.trainer.precision, device)  # 'auto': what train.py picks here
    precision = str(precision)
    step = make_step(module, opt, sched, cfg.trainer.gradient_clip_val, autocast_for(precision, device), device)
    cached = "final" in next(iter(datamodule.train_dataloader()))
    data = batches(module, datamodule, warmup + steps + (1 if profile_top else 0), device)
    warnings.filterwarnings("ignore", message=".*self.log.*")  # training_step logs; no Trainer collects it
    for i in range(warmup):
        step(data[i], i)
    times, counts = [], []
    for i in range(warmup, warmup + steps):
        times.append(step(data[i], i))
        counts.append(step_flops(module, step, data[i], i))
    ops, gemm_share = [], None
    if profile_top:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(data[-1], len(data) - 1)
        ops, gemm_share = top_ops(prof, profile_top)
    dtype = flops.precision_dtype(precision)
    d = module.draft.config
    vocab = int(getattr(d, "draft_vocab_size", None) or d.vocab_size)  # the rows the draft's LM-head GEMM scores
    peak = flops.gemm_peak(int(d.hidden_size), vocab, dtype, device=device,
                           budget_s=peak_budget_s)
    per_step = {k: round(sum(c[k] for c, _ in counts) / steps) for k in counts[0][0]}
    achieved = sum(c["total"] for c, _ in counts) / sum(times)  # FLOP/s over the timed steps
    return {"experiment": experiment, "precision": precision, "dtype": str(dtype).removeprefix("torch."),
            "device": device, "threads": torch.get_num_threads(), "features_cached": cached,
            "flops_per_step": per_step, "loss_tokens_per_step": sum(n for _, n in counts) / steps,
            "s_per_step": statistics.median(times), "times": times, "achieved_gflops": achieved / 1e9,
            "gemm_peak": peak, "mfu": achieved / (peak["gflops"] * 1e9), "top_ops": ops,
            "gemm_self_share": gemm_share}


def step_flops(module, step, batch: dict, i: int) -> tuple[dict, int]:
    """(FLOPs of one training step by part, its loss tokens). A dense block draft: dspark.training.flops's exact
    count (tests/training/test_flops.py holds it equal to the dispatched ops'); any other draft: one more step run
    under torch's FlopCounterMode (matrix products and attention, forward and backward) + the optimizer's FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    from dspark.training import flops

    if flops.is_dense_block_module(module):
        parts, shapes = flops.module_step_flops(module, batch)
        return parts, shapes.loss_rows
    with FlopCounterMode(display=False) as counter:
        step(batch, i)
    return flops.counted_step_flops(module, counter.get_total_flops()), flops.step_loss_tokens(module, batch)


def print_report(r: dict) -> None:
    fps, peak = r["flops_per_step"], r["gemm_peak"]
    print(f"\n== {r['experiment']}: precision {r['precision']} ({r['dtype']}), {r['device']}, "
          f"{r['threads']} threads, {len(r['times'])} timed steps ==")
    if not r["features_cached"]:
        print("(no data.feature_cache: the target's features were computed before the timed steps)")
    print("| part | FLOP | GFLOP | share |\n|---|---|---|---|")
    for part in (*(p for p in fps if p != "total"), "total"):
        print(f"| {part} | {fps[part]} | {fps[part] / 1e9:.3f} | {100 * fps[part] / max(1, fps['total']):.1f} % |")
    times = r["times"]
    print(f"loss tokens / step: {r['loss_tokens_per_step']:.1f}")
    print(f"s / step: {r['s_per_step']:.4f} median ({min(times):.4f}-{max(times):.4f})")
    print(f"achieved: {r['achieved_gflops']:.2f} GFLOP/s; GEMM peak [{peak['shape'][0]} x {peak['shape'][1]}] @ "
          f"[{peak['shape'][1]} x {peak['shape'][2]}] {peak['dtype']}, {peak['threads']} threads: {peak['gflops']:.2f} "
          f"GFLOP/s (best of {peak['repeats']}; median {peak['median_gflops']:.2f}); MFU {100 * r['mfu']:.1f} %")
    if r["top_ops"]:
        print(f"top non-GEMM ops of one profiled step by self CPU time (GEMM ops: "
              f"{100 * r['gemm_self_share']:.1f} % of its self CPU time):")
        print("| op | self CPU ms | share | calls |\n|---|---|---|---|")
        for name, ms, share, calls in r["top_ops"]:
            print(f"| {name} | {ms:.2f} | {100 * share:.1f} % | {calls} |")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiments", nargs="+", default=list(DEFAULT_EXPERIMENTS))
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, OMP_NUM_THREADS)")
    p.add_argument("--peak-budget-s", type=float, default=1.0, help="time the GEMM peak measurement may take")
    p.add_argument("--profile-top", type=int, default=12, help="non-GEMM ops listed (0: no profiled step)")
    p.add_argument("--loss-paths", nargs="+", default=["kernel"], choices=["kernel", "torch"],
                   help="the fused loss's CPU row work: the C++ row pass (dspark.ops.loss_rows_cpu, the default) "
                        "and / or the torch chunk loop it replaced, each measured in this run")
    p.add_argument("overrides", nargs="*", help="train.py overrides (key=value), applied to every experiment")
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    results = []
    from dspark.ops import loss_rows_cpu

    built = loss_rows_cpu.kernel
    for experiment in a.experiments:
        for path in a.loss_paths:
            loss_rows_cpu.kernel = built if path == "kernel" else (lambda: None)
            try:
                r = measure(experiment, a.overrides, steps=a.steps, warmup=a.warmup, peak_budget_s=a.peak_budget_s,
                            profile_top=a.profile_top)
            finally:
                loss_rows_cpu.kernel = built
            r["loss_path"] = path
            print(f"-- fused loss row work: {path}")
            print_report(r)
            results.append(r)
    return results


if __name__ == "__main__":
    main()
