"""python -m dspark.export verify PATH | v4 --run-dir RUN --out OUT | dense --run-dir RUN --out OUT"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_DTYPES = ("bfloat16", "float16", "float32")


def _load_run_draft(run_dir: Path, target_kind: str, target_path: str | None):
    """Target + draft built by dspark.factory from RUN/draft/draft_config.json, with the trained weights."""
    import torch
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    from dspark import factory

    draft_dir = run_dir / "draft"
    if not (draft_dir / "draft_config.json").is_file():
        raise SystemExit(f"{draft_dir}/draft_config.json not found (is {run_dir} a finished training run?)")
    cfg = OmegaConf.create({
        "target": {"kind": target_kind, "path": target_path, "dtype": "float32"},
        "draft": json.loads((draft_dir / "draft_config.json").read_text()),
    })
    target = factory.build_target(cfg)
    draft = factory.build_draft(cfg, target)
    state = load_file(str(draft_dir / "model.safetensors"))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SystemExit(f"trained weights do not fit the draft: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():  # keep the trained dtypes (the fp32 set of a V4 draft stays fp32)
        for name, p in draft.named_parameters():
            p.data = state[name].to(p.device)
    return target, draft


def _print_quant_report(draft, out: Path) -> None:
    from dspark.export.dspark_v4 import QUANT_REPORT, quant_report

    rep = quant_report(draft, out)
    errs = rep["tensors"]
    for name in sorted(errs, key=lambda k: -errs[k]["rel_err"])[:5]:
        e = errs[name]
        print(f"  {name}: max abs err {e['max_abs_err']:.3g} (max |w| {e['max_abs']:.3g}), rel {e['rel_err']:.3g}")
    lg = rep["logits"]
    print(f"{rep['quant']}: {len(errs)} quantised tensors, worst rel err {rep['max_rel_err']:.3g} "
          f"({rep.get('worst_tensor')}); re-imported logits: max |diff| {lg['max_abs_diff']:.3g} "
          f"(max |logit| {lg['max_abs_logit']:.3g}), rel {lg['rel_diff']:.3g}, top-1 agreement "
          f"{lg['top1_agreement']:.3f} -> {out / QUANT_REPORT}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark.export", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="check an exported folder against its config (exit 1 with a list)")
    v.add_argument("path")
    for name in ("v4", "dense"):
        p = sub.add_parser(name, help=f"export a training run's draft ({'DeepSeek-V4 mtp.* sidecar' if name == 'v4' else 'vLLM Qwen3DSparkModel / DFlash folder'})")
        p.add_argument("--run-dir", required=True, type=Path)
        p.add_argument("--target", default="tiny_v4" if name == "v4" else "smollm2",
                       help="target kind as in configs/target (tiny_v4, smollm2, hf)")
        p.add_argument("--target-path", default=None, help="HF folder of the target (target kind hf)")
        p.add_argument("--out", required=True, type=Path)
        p.add_argument("--dtype", default="bfloat16", choices=_DTYPES)
        p.add_argument("--max-shard-gb", type=float, default=5.0)
        p.add_argument("--no-verify", action="store_true", help="skip the verifier run after writing")
        if name == "v4":
            p.add_argument("--merge-into", type=Path, default=None,
                           help="a target checkpoint folder: OUT becomes a copy of it with the mtp.* tensors added")
            p.add_argument("--quant", choices=("fp8", "fp4"), default=None,
                           help="fp8: FP8 128x128 block linears + experts (float32 scales); fp4: FP8 linears "
                                "(e8m0 scales) + packed e2m1 experts (V4-Flash layout). Writes quant_report.json")
    args = ap.parse_args(argv)

    from dspark.export.verify import main_verify

    if args.cmd == "verify":
        return main_verify(args.path)
    import torch

    dtype = getattr(torch, args.dtype)
    target, draft = _load_run_draft(args.run_dir, args.target, args.target_path)
    shard = int(args.max_shard_gb * 2**30)
    if args.cmd == "v4":
        from dspark.export.dspark_v4 import export_v4_sidecar
        from dspark.models.dspark_v4 import DSparkV4Draft

        if not isinstance(draft, DSparkV4Draft):
            raise SystemExit(f"{args.run_dir}: the draft is {type(draft).__name__}, not a DeepSeek-V4 DSpark draft")
        if args.merge_into is not None:
            from dspark.export.dspark_v4 import merge_v4_into_target

            try:
                merge_v4_into_target(draft, args.merge_into, args.out, dtype=dtype, quant=args.quant)
            except ValueError as err:
                raise SystemExit(str(err))
        else:
            export_v4_sidecar(draft, args.out, dtype=dtype, max_shard_bytes=shard, quant=args.quant)
        if args.quant is not None:
            _print_quant_report(draft, args.out)
    else:
        from dspark.export.dense import export_dense
        from dspark.models.dspark_dense import DSparkDenseDraft

        if not isinstance(draft, DSparkDenseDraft):
            raise SystemExit(f"{args.run_dir}: the draft is {type(draft).__name__}, not a dense DSpark/DFlash draft")
        export_dense(draft, args.out, dtype=dtype, num_target_layers=len(target.layers), max_shard_bytes=shard)
    print(f"wrote {args.out}")
    return 0 if args.no_verify else main_verify(args.out)


if __name__ == "__main__":
    sys.exit(main())
