"""Benchmark of the DSpark LM loss (forward + backward): naive materialised vs fused implementations.

Each variant runs in its own subprocess so that peak memory is its own:
  CPU : peak RSS growth (VmHWM after the run minus VmRSS once the inputs exist; VmHWM is reset through
        /proc/self/clear_refs before the run), wall time of forward + backward.
  CUDA: torch.cuda.max_memory_allocated growth over the inputs, CUDA-event time (median of --reps).
Variants: naive (full [N, V] logits + autograd), compiled (torch.compile of naive, CUDA), chunked (the torch
reference of dspark.ops.fused_loss), tilelang (the kernels, CUDA).

  python benchmarks/bench_loss.py --n 640 --variants naive chunked                       # CPU
  python benchmarks/bench_loss.py --device cuda --dtype bfloat16 --variants naive compiled chunked tilelang
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def run_one(a) -> dict:
    import torch

    sys.path.insert(0, str(REPO))
    from dspark.ops.fused_loss import lm_loss, lm_loss_naive

    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dev, dtype)  # noqa: E731
    x = mk(a.n, a.h).requires_grad_(True)
    y = mk(a.n, a.h)
    w = mk(a.v, a.h, scale=a.h ** -0.5)
    e = mk(a.n, a.r).requires_grad_(True) if a.r else None
    w2 = mk(a.v, a.r, scale=0.02).requires_grad_(True) if a.r else None
    labels = torch.randint(0, a.v, (a.n,), generator=g).to(dev)
    coef = torch.full((a.n,), 1.0 / a.n, device=dev)

    if a.variant == "naive":
        fn = lambda: lm_loss_naive(x, y, w, e, w2, labels, 0.1 * coef, 0.9 * coef)[0]  # noqa: E731
    elif a.variant == "compiled":
        naive_c = torch.compile(lm_loss_naive)
        fn = lambda: naive_c(x, y, w, e, w2, labels, 0.1 * coef, 0.9 * coef)[0]  # noqa: E731
    else:
        backend = "torch" if a.variant == "chunked" else "tilelang"
        fn = lambda: lm_loss(x, y, w, e, w2, labels, 0.1 * coef, 0.9 * coef, chunk_rows=a.chunk,  # noqa: E731
                             backend=backend)[0]

    def step():
        for t in (x, e, w2):
            if t is not None:
                t.grad = None
        loss = fn()
        loss.backward()
        return loss

    out = {"variant": a.variant, "device": a.device, "dtype": a.dtype, "N": a.n, "V": a.v, "H": a.h, "r": a.r,
           "chunk_rows": a.chunk}
    if dev.type == "cuda":
        for _ in range(a.warmup):
            step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(a.reps):
            s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            loss = step()
            t.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(t) / 1e3)
        out["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
        out["seconds"] = sorted(times)[len(times) // 2]
    else:
        base = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
            f.write("5")
        t0 = time.perf_counter()
        loss = step()
        out["seconds"] = time.perf_counter() - t0
        out["peak_extra_bytes"] = _status("VmHWM") - base
        out["inputs_rss_bytes"] = base
    out["loss"] = float(loss)
    out["grad_x_norm"] = float(x.grad.float().norm())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2560)
    p.add_argument("--v", type=int, default=129280)
    p.add_argument("--h", type=int, default=4096)
    p.add_argument("--r", type=int, default=256, help="Markov rank (0: no Markov head)")
    p.add_argument("--chunk", type=int, default=256, help="chunk_rows of the torch reference")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--variants", nargs="+", default=["naive", "chunked"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="append one JSON line per variant to this file")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # child process
    a = p.parse_args()
    if a.variant:
        print(json.dumps(run_one(a)))
        return
    results = []
    for v in a.variants:
        cmd = [sys.executable, __file__, "--variant", v] + [
            f"--{k}={getattr(a, k)}" for k in ("n", "v", "h", "r", "chunk", "device", "dtype", "reps", "warmup")]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        if proc.returncode != 0:
            res = {"variant": v, "error": proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}
        else:
            res = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(res)
        print(json.dumps(res), flush=True)
    ok = {r["variant"]: r for r in results if "error" not in r}
    if "naive" in ok:
        for name, r in ok.items():
            if name != "naive":
                print(f"{name}: memory {r['peak_extra_bytes'] / ok['naive']['peak_extra_bytes']:.3f}x naive, "
                      f"time {r['seconds'] / ok['naive']['seconds']:.2f}x naive")
    if a.out:
        with open(a.out, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
