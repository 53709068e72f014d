"""`python -m dspark.serving.load_check --target DIR [--draft DIR] --method M [-k N] [--model-class mod:Cls]`

Builds vLLM's own draft model class for an export (no engine, no KV cache) in the vLLM venv and runs its
`load_weights` (vLLM's name remapping, fusing, sharding) on the exported tensors, poisoned with NaN beforehand:
prints which parameters stayed unloaded or partly loaded and which exported tensors wrote nothing
(dspark/serving/vllm_load_audit.py, verdict: dspark/serving/audit.py). Exit 0: everything loaded; 1: a
problem (listed); 2: vLLM could not build or load the class at all (its message is printed).

Dense drafts: --target <target folder> --draft <export> --method dflash|dspark. DeepSeek-V4 DSpark / MTP
drafts merged into a target copy: --target <merged folder> --method dspark|mtp (no --draft). On a CPU-only
vLLM the DeepSeek-V4 classes of the CPU entry only raise; --model-class picks the CUDA one
(e.g. vllm.models.deepseek_v4.nvidia.mtp:DeepSeekV4MTP), which may still need CUDA to construct.
--drop-config-key KEY / --set-config KEY=JSON serve the audit a view of the target folder with an edited config.json
(e.g. vLLM 0.32's DeepSeek-V4 wants its native keys: no transformers `mlp_layer_types`, `num_hash_layers`,
`topk_method="noaux_tc"`); --cuda-stubs lets a CUDA class construct on CPU (inert streams / events, an SM90
capability): the module tree and the weight loading are vLLM's, nothing runs. --only mtp. audits the draft
tensors of a merged target copy one by one.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from dspark.serving import engine  # VLLMWorker looked up per call: tests substitute it
from dspark.serving.audit import describe, judge
from dspark.serving.engine import VLLMUnavailable, VLLMWorkerError


def config_view(folder: Path, drop_keys: list[str], into: Path, set_keys: dict | None = None) -> Path:
    """A folder of symlinks to `folder`'s files with a config.json lacking `drop_keys` and with `set_keys`
    (the originals untouched)."""
    into.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.name != "config.json":
            (into / f.name).symlink_to(f.resolve())
    c = json.loads((folder / "config.json").read_text())
    for k in drop_keys:
        c.pop(k, None)
    c.update(set_keys or {})
    (into / "config.json").write_text(json.dumps(c, indent=1))
    return into


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark.serving.load_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, type=Path, help="target folder (or a target copy with the draft merged)")
    ap.add_argument("--draft", type=Path, default=None, help="dense draft export folder")
    ap.add_argument("--method", required=True, help="vLLM speculative method: dflash | dspark | mtp")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=1)
    ap.add_argument("--model-class", default=None, help="module:Class to build instead of the registered one")
    ap.add_argument("--drop-config-key", action="append", default=[], help="see the module docstring")
    ap.add_argument("--set-config", action="append", default=[], metavar="KEY=JSON",
                    help="config.json key for the audit's view, e.g. topk_method='\"noaux_tc\"' or num_hash_layers=0")
    ap.add_argument("--cuda-stubs", action="store_true",
                    help="let a CUDA class construct on CPU (inert torch.cuda.Stream/Event, SM90 capability)")
    ap.add_argument("--only", action="append", default=[], metavar="PREFIX",
                    help="load only tensors whose names start with PREFIX (e.g. mtp. in a merged target copy)")
    ap.add_argument("--no-per-tensor", action="store_true", help="skip the one-tensor-at-a-time pass")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the audit and its verdict here")
    args = ap.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="dspark-view-") as tmp:
            sets = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.set_config)}
            target = config_view(args.target, args.drop_config_key, Path(tmp) / "t", sets) \
                if args.drop_config_key or sets else args.target
            with engine.VLLMWorker(args.vllm_python) as w:
                audit = w.load_check(target=str(target), draft=None if args.draft is None else str(args.draft),
                                     method=args.method, num_speculative_tokens=args.num_speculative_tokens,
                                     per_tensor=not args.no_per_tensor and (args.draft is not None or bool(args.only)),
                                     model_class=args.model_class, cuda_stubs=args.cuda_stubs,
                                     tensor_filter=args.only or None)
                versions = w.versions
    except VLLMUnavailable as exc:
        print(f"load_check: error: {exc}", file=sys.stderr)
        return 2
    except VLLMWorkerError as exc:
        print(f"load_check: vLLM could not build/load it: {exc}", file=sys.stderr)
        if args.json:
            args.json.write_text(json.dumps({"error": str(exc), "detail": exc.detail}, indent=1))
        return 2
    verdict = judge(audit, args.draft or args.target, merged=args.draft is None)
    if args.json:
        args.json.write_text(json.dumps({"verdict": verdict, "audit": audit, "vllm": versions}, indent=1))
    print(("OK " if verdict["ok"] else "FAIL ") + describe(verdict))
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
