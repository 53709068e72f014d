"""benchmarks/bench_step.py --quick: the training-step benchmark runs end to end at tiny sizes (so it cannot rot), and
its variants measure the same step: the fused and materialised loss paths, the target online or its features
given, the packed or dense attention mask all start from the same loss."""
from __future__ import annotations

import importlib.util
import math

from conftest import REPO


def test_bench_step_quick():
    spec = importlib.util.spec_from_file_location("bench_step", REPO / "benchmarks" / "bench_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(["--quick"])
    assert {(r["dtype"], r["variant"]) for r in results} == {
        (d, v) for d in ("bfloat16", "float32") for v in ("fused/online", "fused/cached", "unfused/online",
                                                         "dense-mask/online")}
    for r in results:
        assert r["median_s"] > 0 and r["peak_rss_bytes"] > 0 and r["finite"], r
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 2e-2)):
        first = [r["loss_first"] for r in results if r["dtype"] == dtype]
        assert max(first) - min(first) <= tol * max(1.0, abs(first[0])), (dtype, first)
        assert all(math.isfinite(x) for x in first)
