"""One full DSpark training step on CPU: the LightningModule's training_step (configured loss path), backward,
gradient clipping, AdamW step, at DeepSpec's DSpark configuration.

Built with the project's own builders, so it measures what train.py runs:
  target : a tiny random Qwen3ForCausalLM (hidden 128, 4 layers, 4 heads / 2 KV heads, head_dim 32,
           intermediate 256, vocabulary V) wrapped in dspark's FrozenTarget, taps [0, 1, 2, 3]
  draft  : dspark.factory.build_draft of a `dspark_dense` group (1 layer, block 7, anchor layout,
           vanilla Markov head rank 64, confidence head, full context)
  module : dspark.training.modules.MODULES["block"].from_config(train group of configs/config.yaml, lr 6e-4)
  step   : optimizer.zero_grad; [autocast bf16] loss = module.training_step(batch); loss.backward();
           clip_grad_norm_(1.0); AdamW.step; scheduler.step       (what Lightning does per step with
           gradient_clip_val=1.0; bf16 = target in bfloat16 + Lightning's "bf16-mixed" CPU autocast)
  batch  : 1 sequence of `seq` random tokens, loss_mask on after the first seq/16 tokens, `anchors` anchors
           sampled by dspark.training.blocks.sample_anchors

Variants (each in its own subprocess, so that its peak memory is its own):
  fused/online     the configured path: fused chunked loss (train.fused_loss=true), target run in the step
  fused/cached     the same, target features given in the batch (data.feature_cache)
  unfused/online   the materialised reference: [loss rows, V] logits + autograd (train.fused_loss=false)
  dense-mask/...   (--variants) the old dense [A*g, S + A*g] attention mask instead of the packed one
Memory: peak RSS = the process's VmHWM over the whole run; growth = that peak minus VmRSS once the target, draft
and batch exist (VmHWM reset then through /proc/self/clear_refs): gradients, AdamW state and the steps' own peak.
(Not per-step VmHWM - VmRSS: the allocator keeps freed warm-up memory mapped, which hides a step's peak.)
The unfused path is skipped, with
the reason printed, when its predicted extra memory (8 x A*g*V*4 bytes, at most: only the loss rows are
scored) exceeds --max-unfused-gb.

  python benchmarks/bench_step.py                      # the table of benchmarks/README.md (V x anchors x dtype)
  python benchmarks/bench_step.py --seq 4096 16384 --vocab 4096 --anchors 512 --dtypes float32 \
      --variants fused/online dense-mask/online     # long context: packed vs dense attention mask
  python benchmarks/bench_step.py --quick              # tiny sizes, in-process, a few seconds (tests/benchmarks/test_bench_step.py)
  python benchmarks/bench_step.py --profile --vocab 151936 --anchors 512 --dtypes bfloat16 --variants fused/online
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("fused/online", "fused/cached", "unfused/online", "unfused/cached", "dense-mask/online",
            "dense-mask/cached")
DEFAULT_VARIANTS = ("fused/online", "fused/cached", "unfused/online")


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS
            f.write("5")
        return True
    except OSError:
        return False


def unfused_extra_bytes(rows: int, vocab: int) -> int:
    """Predicted extra memory of the materialised loss path: ~8 live [rows, V] fp32 tensors at its peak (logits,
    Markov bias, teacher logits, q, p, q - p and their autograd copies; DeepSpec's own count is 7.5)."""
    return 8 * rows * vocab * 4


# ---- the step ---------------------------------------------------------------------------------------
def build(case: dict):
    """-> (module, optimizer, scheduler, batch) for one case, through the project's builders."""
    import torch
    from omegaconf import OmegaConf
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, str(REPO))
    from dspark import factory
    from dspark.models import registry
    from dspark.schema import TrainKeys, typed
    from dspark.targets.hf_target import FrozenTarget
    from dspark.training.blocks import sample_anchors
    from dspark.training.module import OptimConfig
    from dspark.training.modules import MODULES

    V, S, A, H = case["vocab"], case["seq"], case["anchors"], case["hidden"]
    dtype = getattr(torch, case["dtype"])
    torch.manual_seed(0)
    hf = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=case["layers"],
                     num_attention_heads=4, num_key_value_heads=2, head_dim=H // 4,
                     max_position_embeddings=max(4096, 2 * S), tie_word_embeddings=False)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(hf).to(dtype)
    target = FrozenTarget(model, list(range(case["layers"])), None)
    group = {"kind": "dspark_dense", "num_layers": 1, "block_size": 7, "mask_token_id": V - 1,
             "target_layer_ids": list(range(case["layers"])), "markov_rank": 64, "markov_head_type": "vanilla",
             "sliding_window": case.get("window"), "layout": "anchor", "init_from_target": False, "arch": {}}
    draft = factory.build_draft(group, target)
    train = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "config.yaml").train)
    train["lr"] = 6e-4  # DeepSpec
    train["fused_loss"] = case["variant"].startswith("fused") or case["variant"].startswith("dense-mask")
    module_cls = MODULES[registry.family("dspark_dense").objective]
    optim = OptimConfig.from_keys(typed(TrainKeys, train), max_steps=1000)
    module = module_cls.from_config(typed(module_cls.KEYS, train), draft, target, optim)
    if case["variant"].startswith("dense-mask"):
        module.packed_attention_mask = False
    module.train()
    module.on_fit_start()  # attaches the target (device, shared embedding / LM head)
    opt_cfg = module.configure_optimizers()
    opt, sched = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V - 1, (1, S), generator=g)
    loss_mask = torch.zeros(1, S, dtype=torch.long)
    loss_mask[:, S // 16:] = 1
    anchors, keep = sample_anchors(loss_mask[0], A, g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask,
             "anchors": anchors[None], "keep": keep[None]}
    if case["variant"].endswith("/cached"):  # what the feature cache hands the step (in the target's dtype)
        feats = target.features(ids, batch["attention_mask"])
        batch["aux"], batch["final"] = feats.aux, feats.final
    return module, opt, sched, batch


def make_step(module, opt, sched, batch, dtype_name: str):
    import contextlib

    import torch

    params = [p for p in module.parameters() if p.requires_grad]
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype_name == "bfloat16" else \
        contextlib.nullcontext

    def step(i: int) -> float:
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = module.training_step(batch, i)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        return float(loss.detach())

    return step


def measure(case: dict) -> dict:
    """Build one case, run warm-up + timed steps, return its numbers."""
    import torch

    warnings.filterwarnings("ignore", message=".*self.log.*")
    torch.set_num_threads(case["threads"])
    t0 = time.perf_counter()
    module, opt, sched, batch = build(case)
    step = make_step(module, opt, sched, batch, case["dtype"])
    out = dict(case, build_s=time.perf_counter() - t0)
    built = _status("VmRSS")  # target, draft, batch (and cached features) exist; no optimizer state yet
    can_reset = _reset_hwm()
    losses = [step(i) for i in range(case["warmup"])]
    times = []
    for i in range(case["reps"]):
        t = time.perf_counter()
        losses.append(step(case["warmup"] + i))
        times.append(time.perf_counter() - t)
    growth = _status("VmHWM") - built  # what training steps add at their peak: grads, AdamW state, activations
    if case.get("profile"):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
            step(10_000)
        out["profile_table"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        out["profile_shapes"] = prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=15)
    out.update(median_s=statistics.median(times), min_s=min(times), max_s=max(times), times=times,
               peak_growth_bytes=growth if can_reset else None, peak_rss_bytes=_status("VmHWM"),
               loss_first=losses[0], loss_last=losses[-1], finite=all(map(lambda x: x == x, losses)))
    return out


# ---- driver -----------------------------------------------------------------------------------------
def run_child(case: dict, mem_limit_gb: float) -> dict:
    """One case in a fresh interpreter (address space capped at mem_limit_gb: a runaway fails, never swaps
    the shared machine)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(case),
           "--mem-limit-gb", str(mem_limit_gb)]
    env = dict(os.environ, OMP_NUM_THREADS=str(case["threads"]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = proc.stdout.splitlines()
    if lines and lines[-1].startswith("{"):
        if len(lines) > 1:  # the profiler's tables
            print("\n".join(lines[:-1]), flush=True)
        return json.loads(lines[-1])
    return dict(case, error=(proc.stderr.strip().splitlines() or ["no output"])[-1], rc=proc.returncode)


def fmt_gb(b) -> str:
    return "-" if b is None else f"{b / 1e9:.2f}"


def print_table(results: list[dict]) -> None:
    print("\n| seq | V | anchors | dtype | variant | median s/step | min-max | peak RSS GB | peak growth GB | "
          "vs fused/online (time, growth) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = {}
    for r in results:
        if r["variant"] == "fused/online" and "median_s" in r:
            base[(r["seq"], r["vocab"], r["anchors"], r["dtype"])] = r
    for r in results:
        key = (r["seq"], r["vocab"], r["anchors"], r["dtype"])
        head = f"| {r['seq']} | {r['vocab']} | {r['anchors']} | {r['dtype']} | {r['variant']} |"
        if "median_s" not in r:
            print(f"{head} skipped: {r.get('skip') or r.get('error')} | | | | |")
            continue
        b = base.get(key)
        ratio = ""
        if b is not None and r is not b:
            g = (r["peak_growth_bytes"] or 0) / max(1, b["peak_growth_bytes"] or 1)
            ratio = f"{r['median_s'] / b['median_s']:.2f}x, {g:.2f}x"
        print(f"{head} {r['median_s']:.3f} | {r['min_s']:.3f}-{r['max_s']:.3f} | {fmt_gb(r['peak_rss_bytes'])} | "
              f"{fmt_gb(r['peak_growth_bytes'])} | {ratio} |")


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[4096, 32768, 151936])
    p.add_argument("--anchors", type=int, nargs="+", default=[128, 512])
    p.add_argument("--seq", type=int, nargs="+", default=[1024])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    p.add_argument("--window", type=int, default=None, help="draft sliding window (default: full context)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--big-reps", type=int, default=3, help="timed steps when anchors x 7 x V > 1e8")
    p.add_argument("--max-unfused-gb", type=float, default=8.0,
                   help="skip the materialised path when its predicted extra memory exceeds this")
    p.add_argument("--mem-limit-gb", type=float, default=14.0, help="address-space cap of each child")
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of one more step")
    p.add_argument("--inproc", action="store_true", help="run every case in this process (no peak isolation)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, in-process, 1 warm-up + 1 timed step")
    p.add_argument("--out", default=None, help="append one JSON line per case to this file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    if a.child:
        import resource

        cap = int(a.mem_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        case = json.loads(a.child)
        res = measure(case)
        if "profile_table" in res:
            print(res.pop("profile_table"))
            print(res.pop("profile_shapes"))
        print(json.dumps(res))
        return [res]

    if a.quick:
        a.vocab, a.anchors, a.seq, a.hidden, a.layers = [512], [8], [96], 32, 2
        a.warmup, a.reps, a.big_reps, a.inproc = 1, 1, 1, True
        a.variants = list(DEFAULT_VARIANTS) + ["dense-mask/online"]
    print(f"bench_step: threads={a.threads}, load average {os.getloadavg()}, cpu bf16: "
          f"{'avx512_bf16' in open('/proc/cpuinfo').read()}", flush=True)
    results = []
    for seq in a.seq:
        for vocab in a.vocab:
            for anchors in a.anchors:
                for dtype in a.dtypes:
                    for variant in a.variants:
                        rows = anchors * 7
                        big = rows * vocab > 1e8
                        case = dict(seq=seq, vocab=vocab, anchors=anchors, dtype=dtype, variant=variant,
                                    window=a.window, hidden=a.hidden, layers=a.layers, threads=a.threads,
                                    warmup=1 if big else a.warmup, reps=a.big_reps if big else a.reps,
                                    profile=a.profile)
                        need = unfused_extra_bytes(rows, vocab)
                        if variant.startswith("unfused") and need > a.max_unfused_gb * 1e9:
                            res = dict(case, skip=f"materialised path predicted {need / 1e9:.1f} GB extra "
                                                  f"(> --max-unfused-gb {a.max_unfused_gb})")
                        elif a.inproc:
                            res = measure(case)
                            if "profile_table" in res:
                                print(res.pop("profile_table"))
                                print(res.pop("profile_shapes"))
                        else:
                            res = run_child(case, a.mem_limit_gb)
                        results.append(res)
                        brief = {k: res.get(k) for k in ("seq", "vocab", "anchors", "dtype", "variant", "median_s",
                                                         "peak_growth_bytes", "skip", "error")}
                        print(json.dumps(brief), flush=True)
                        if a.out:
                            with open(a.out, "a") as fh:
                                fh.write(json.dumps(res) + "\n")
    print_table(results)
    print(f"load average at the end: {os.getloadavg()}")
    return results


if __name__ == "__main__":
    main()
