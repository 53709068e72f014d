"""Bandwidth of the mHC pieces (forward and backward) against the device's measured copy bandwidth.

For each piece the minimal traffic (every input read once, every output written once) is divided by the
measured time; the copy bandwidth is that of a torch clone of a same-sized tensor (read + write).
Target (issue 7): the tilelang kernels at >= 60% of the copy bandwidth.

  python benchmarks/bench_mhc.py --device cuda --tokens 16384 --out results.jsonl   # kernels vs torch
  python benchmarks/bench_mhc.py --device cpu --tokens 256                          # torch pieces only
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _time(fn, device: str, reps: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / 1e3 / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _nbytes(*ts) -> int:
    out = 0
    for t in ts:
        out += sum(_nbytes(u) for u in t) if isinstance(t, (tuple, list)) else t.numel() * t.element_size()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hc", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from dspark.ops.mhc import TORCH_OPS

    tables = {"torch": TORCH_OPS}
    if a.device == "cuda":
        from dspark.ops.kernels.mhc_tl import TILELANG_OPS

        tables["tilelang"] = TILELANG_OPS
    dev, dt = a.device, getattr(torch, a.dtype)
    n, hc, h = a.tokens, a.hc, a.hidden
    m = (2 + hc) * hc
    g = torch.Generator(device="cpu").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    x = r(n, hc, h).to(dt)
    flat = x.flatten(-2).contiguous()
    fn = r(m, hc * h) * 0.01
    f, w, post, comb = r(n, h).to(dt), torch.rand(n, hc).to(dev), r(n, hc), torch.rand(n, hc, hc).to(dev)
    dy, dout, dmix = r(n, h).to(dt), r(n, hc, h).to(dt), r(n, m)
    mix, inv = TORCH_OPS["mix_fwd"](flat, fn, 1e-6)
    cases = {
        "mix_fwd": lambda o: o["mix_fwd"](flat, fn, 1e-6),
        "mix_bwd": lambda o: o["mix_bwd"](dmix, flat, fn, mix, inv),
        "collapse_fwd": lambda o: o["collapse_fwd"](x, w),
        "collapse_bwd": lambda o: o["collapse_bwd"](dy, x, w),
        "post_fwd": lambda o: o["post_fwd"](f, x, post, comb),
        "post_bwd": lambda o: o["post_bwd"](dout, f, x, post, comb),
    }
    inputs = {"mix_fwd": (flat, fn), "mix_bwd": (dmix, flat, fn, mix, inv), "collapse_fwd": (x, w),
              "collapse_bwd": (dy, x, w), "post_fwd": (f, x, post, comb), "post_bwd": (dout, f, x, post, comb)}
    big = torch.empty(n * hc * h * 4 // 2, dtype=torch.float16, device=dev)  # 4 bytes per stream element
    copy_s = _time(lambda: big.clone(), dev, a.reps)
    copy_bw = 2 * _nbytes(big) / copy_s
    rows = [{"op": "copy", "device": dev, "GBps": copy_bw / 1e9}]
    for name, call in cases.items():
        for impl, ops in tables.items():
            out = call(ops)
            traffic = _nbytes(*inputs[name]) + _nbytes(out)
            s = _time(lambda: call(ops), dev, a.reps)
            rows.append({"op": name, "impl": impl, "device": dev, "tokens": n, "hc": hc, "hidden": h,
                         "dtype": a.dtype, "ms": s * 1e3, "GBps": traffic / s / 1e9,
                         "frac_of_copy": traffic / s / copy_bw})
    for row in rows:
        print(json.dumps(row))
    if a.out:
        with open(a.out, "a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
