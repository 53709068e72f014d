"""python -m dspark.export verify PATH | v4 --run-dir RUN --out OUT | dense --run-dir RUN --out OUT
                       | dflash2 --run-dir RUN --out OUT (vLLM DFlash2DraftModel)
                       | mtp --run-dir RUN --out OUT (HY V4 / DeepSeek-V4 MTP drafts)

Each export format is one `_add_<format>` (its options) + one `_run_<format>` (target, draft, args -> writes
args.out) registered in FORMATS; every export ends with the independent verifier unless --no-verify. OUT must be new
or empty unless --overwrite (checked before any model loads); the folder is written whole or not at all
(dspark.export._io.sealed).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark.errors import UserError

_DTYPES = ("bfloat16", "float16", "float32")


def _load_run_draft(run_dir: Path, target_kind: str, target_path: str | None):
    """Target + draft built by dspark.factory from RUN/draft/draft_config.json, with the trained weights."""
    import torch
    from omegaconf import OmegaConf

    from dspark import factory
    from dspark.training import draft_dir as run_draft

    draft_dir = run_dir / run_draft.DRAFT_DIR
    if not (draft_dir / run_draft.CONFIG_FILE).is_file():
        raise SystemExit(f"{draft_dir}/draft_config.json not found (is {run_dir} a finished training run?)")
    state = run_draft.load_state(draft_dir)  # checked against its manifest before any model loads
    cfg = OmegaConf.create({
        "target": {"kind": target_kind, "path": target_path, "dtype": "float32"},
        "draft": json.loads((draft_dir / "draft_config.json").read_text()),
    })
    target = factory.build_target(cfg)
    draft = factory.build_draft(cfg, target)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SystemExit(f"trained weights do not fit the draft: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():  # keep the trained dtypes (the fp32 set of a V4 draft stays fp32)
        for name, p in draft.named_parameters():
            p.data = state[name].to(p.device)
    return target, draft, cfg


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


def _add_v4(p: argparse.ArgumentParser) -> None:
    p.add_argument("--merge-into", type=Path, default=None,
                   help="a target checkpoint folder: OUT becomes a copy of it with the mtp.* tensors added")
    p.add_argument("--quant", choices=("fp8", "fp4"), default=None,
                   help="fp8: FP8 128x128 block linears + experts (float32 scales); fp4: FP8 linears "
                        "(e8m0 scales) + packed e2m1 experts (V4-Flash layout). Writes quant_report.json")
    _add_not_for_vllm(p)


def _add_not_for_vllm(p: argparse.ArgumentParser) -> None:
    p.add_argument("--not-for-vllm", action="store_true",
                   help="write a draft vLLM 0.33.0 would serve differently from how it was trained (gated / rnn "
                        "Markov head, confidence bias, ...) for dspark's own import; the config lists the reasons "
                        "under dspark_not_for_vllm and the verifier reports them as notes")


def _require(draft, adapter_cls, run_dir: Path, what: str) -> None:
    """The run's draft must be of the family the format's adapter serves."""
    if getattr(type(draft), "family_kind", None) != adapter_cls.kind:
        raise SystemExit(f"{run_dir}: the draft is {type(draft).__name__}, not a {what} draft")


def _run_v4(target, draft, cfg, args, dtype, shard: int) -> None:
    from dspark.export.dspark_v4 import V4DSparkAdapter, export_v4_sidecar, merge_v4_into_target

    _require(draft, V4DSparkAdapter, args.run_dir, "DeepSeek-V4 DSpark")
    try:
        if args.merge_into is not None:
            merge_v4_into_target(draft, args.merge_into, args.out, dtype=dtype, quant=args.quant,
                                 for_vllm=not args.not_for_vllm, overwrite=args.overwrite)
        else:
            export_v4_sidecar(draft, args.out, dtype=dtype, max_shard_bytes=shard, quant=args.quant,
                              for_vllm=not args.not_for_vllm, overwrite=args.overwrite)
    except UserError:
        raise
    except ValueError as err:
        raise SystemExit(str(err))
    if args.quant is not None:
        from dspark.integrity import write_manifest

        _print_quant_report(draft, args.out)
        write_manifest(args.out)  # quant_report.json joins the sealed files


def _run_v41(target, draft, cfg, args, dtype, shard: int) -> None:
    from dspark.export.dspark_v41 import run_cli

    run_cli(draft, args, dtype, shard)


def _add_dense(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=("vllm", "speculators"), default="vllm",
                   help="config.json in vLLM's own format (Qwen3DSparkModel / DFlashDraftModel) or the "
                        "speculators format (speculators_model_type dspark / dflash)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="reduce the draft vocabulary to the N most frequent trained tokens (d2t / t2d + lm_head "
                        "rows); needs --vocab-counts")
    p.add_argument("--vocab-counts", type=Path, default=None,
                   help="token frequencies: a jsonl of tokenized rows (input_ids + loss_mask) or conversations "
                        "(messages, tokenized with the target's chat template), or a datasets folder (save_to_disk)")
    p.add_argument("--verifier", default=None, help="speculators format: the target's name_or_path to record")
    _add_not_for_vllm(p)


def _run_dense(target, draft, cfg, args, dtype, shard: int) -> None:
    from dspark.export.dense import DenseAdapter, export_dense

    _require(draft, DenseAdapter, args.run_dir, "dense DSpark/DFlash")
    if (args.draft_vocab_size is None) != (args.vocab_counts is None):
        raise SystemExit("--draft-vocab-size and --vocab-counts go together")
    if args.draft_vocab_size is not None and getattr(draft, "reduced_vocab", False):
        raise SystemExit(f"--draft-vocab-size: the run's draft was trained with draft_vocab_size="
                         f"{draft.d2t.numel()} and exports with that vocabulary as it is: drop --draft-vocab-size")
    if args.draft_vocab_size is not None and args.draft_vocab_size < draft.config.vocab_size:
        from dspark.export.vocab import build_vocab_mapping, count_tokens, count_tokens_jsonl, reduce_dense_vocab

        v = draft.config.vocab_size
        if args.vocab_counts.is_dir():
            from datasets import load_from_disk

            counts = count_tokens(load_from_disk(str(args.vocab_counts)), v, target.tokenizer)
        else:
            counts = count_tokens_jsonl(args.vocab_counts, v, target.tokenizer)
        try:
            d2t, t2d = build_vocab_mapping(counts, args.draft_vocab_size)
        except ValueError as err:
            raise SystemExit(f"--draft-vocab-size: {err}")
        covered = counts[t2d].sum().item() / max(counts.sum().item(), 1)
        print(f"draft vocabulary: {args.draft_vocab_size} of {v} ids cover {covered:.4f} of "
              f"{counts.sum().item()} trained tokens in {args.vocab_counts}")
        draft = reduce_dense_vocab(draft, d2t, t2d)
    try:
        export_dense(draft, args.out, dtype=dtype, num_target_layers=len(target.layers), max_shard_bytes=shard,
                     fmt=args.format, verifier=args.verifier, for_vllm=not args.not_for_vllm, overwrite=args.overwrite)
    except UserError:
        raise
    except ValueError as err:
        raise SystemExit(str(err))


def _run_dflash2(target, draft, cfg, args, dtype, shard: int) -> None:
    from dspark.export.dflash2 import DFlash2Adapter, export_dflash2

    _require(draft, DFlash2Adapter, args.run_dir, "DFlash2")
    try:
        export_dflash2(draft, args.out, dtype=dtype, num_target_layers=len(target.layers), max_shard_bytes=shard,
                       for_vllm=not args.not_for_vllm)
    except ValueError as err:
        raise SystemExit(str(err))


def _add_mtp(p: argparse.ArgumentParser) -> None:
    p.add_argument("--merge-into", type=Path, default=None,
                   help="a target checkpoint folder: OUT becomes a copy of it with the MTP tensors added (its own "
                        "MTP tensors replaced, config.json num_nextn_predict_layers updated)")
    p.add_argument("--layer-names", choices=("mtp_layers", "layers"), default="mtp_layers",
                   help="HY V4: model.mtp_layers.{i}.* (default) or model.layers.{N+i}.* (N = target layers)")
    p.add_argument("--split-experts", action="store_true",
                   help="HY V4: routed experts per expert (mlp.experts.{e}.{gate,up,down}_proj.weight), not fused")


def _run_mtp(target, draft, cfg, args, dtype, shard: int) -> None:
    from dspark.export.mtp import export_mtp, merge_mtp_into_target, mtp_adapter

    try:
        mtp_adapter(draft)
    except TypeError:
        raise SystemExit(f"{args.run_dir}: the draft is {type(draft).__name__}, not an MTP draft (hyv4_mtp / dsv4_mtp)")
    try:
        if args.merge_into is not None:
            merge_mtp_into_target(draft, args.merge_into, args.out, dtype=dtype, layer_names=args.layer_names,
                                  split_experts=args.split_experts, overwrite=args.overwrite)
        else:
            export_mtp(draft, args.out, dtype=dtype, max_shard_bytes=shard, layer_names=args.layer_names,
                       split_experts=args.split_experts, overwrite=args.overwrite)
    except UserError:
        raise
    except ValueError as err:
        raise SystemExit(str(err))


def _recorded_target(run_dir: Path) -> tuple[str, str | None] | None:
    """(kind, path) of the target the run was trained against (RUN/draft/target.json), None for older runs."""
    from dspark.training.draft_dir import DRAFT_DIR, TARGET_FILE

    path = run_dir / DRAFT_DIR / TARGET_FILE
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    return str(rec["kind"]), rec.get("path")


def resolve_target(args: argparse.Namespace) -> tuple[str, str | None]:
    """--target / --target-path when given, else the run's draft/target.json, else the format's default kind."""
    if args.target is not None:
        return args.target, args.target_path
    recorded = _recorded_target(args.run_dir)
    if recorded is not None:
        return recorded[0], args.target_path or recorded[1]
    return FORMATS[args.cmd][1] or _default_target(args.run_dir), args.target_path


def _default_target(run_dir: Path) -> str:
    path = run_dir / "draft" / "draft_config.json"
    from dspark.models import registry

    kind = json.loads(path.read_text()).get("kind") if path.is_file() else None
    default = registry.families()[kind].default_target if kind in registry.kinds() else None
    if default is None:
        raise SystemExit(f"{path}: draft kind {kind!r} has no default target; pass --target")
    return default


# name -> (help, default target kind, add options, run)
FORMATS = {
    "v4": ("export a training run's draft as a DeepSeek-V4 mtp.* sidecar (or merged into a target checkpoint)",
           "tiny_v4", _add_v4, _run_v4),
    "v41": ("export a training run's draft as a DeepSeek-V4.1 mtp.* sidecar (or merged into a V4.1 target checkpoint)",
            "tiny_v41", _add_v4, _run_v41),
    "dense": ("export a training run's dense draft as a vLLM Qwen3DSparkModel / DFlash folder", "smollm2",
              _add_dense, _run_dense),
    "dflash2": ("export a training run's DFlash2 draft as a vLLM DFlash2DraftModel folder", None,
                _add_not_for_vllm, _run_dflash2),
    "mtp": ("export a training run's MTP draft (HY V4 model.mtp_layers.{i}.* / DeepSeek-V4 mtp.{i}.*) as a sidecar",
            None, _add_mtp, _run_mtp),
}


def next_step(args: argparse.Namespace, draft) -> str:
    """What to do with the folder just written, as commands: a draft vLLM reads from inside the target checkpoint
    (its adapter's `vllm_reads_merged`: DeepSeek-V4 / V4.1 DSpark, MTP) is merged first unless it was; any other
    folder is a draft model of its own (speculative_config `model`)."""
    import json

    from dspark.export.adapter import primary_adapter

    cfg = draft.config
    spec = {"method": cfg.vllm_method, "num_speculative_tokens": int(getattr(cfg, type(cfg).DRAFTS_KEY))}
    run = args.run_dir
    if primary_adapter(type(draft).family_kind).vllm_reads_merged:
        if getattr(args, "merge_into", None) is None:
            return (f"next: vLLM reads this draft from inside the target's checkpoint: merge it into a copy of the "
                    f"target (python -m dspark.export {args.cmd} --run-dir {run} --merge-into <target checkpoint "
                    f"folder> --out <merged folder>), then serve that folder: vllm serve <merged folder> "
                    f"--speculative-config '{json.dumps(spec)}'")
        return f"next: vllm serve {args.out} --speculative-config '{json.dumps(spec)}'"
    return (f"next: vllm serve <target> --speculative-config '{json.dumps({**spec, 'model': str(args.out)})}'; "
            f"python -m dspark.serve_check run_dir={run} export={args.out} compares vLLM's acceptance with eval.py's")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="check an exported folder against its config (exit 1 with a list)")
    v.add_argument("path")
    for name, (help_text, default_target, add, _) in FORMATS.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--run-dir", required=True, type=Path)
        p.add_argument("--target", default=None,
                       help="target kind as in configs/target (tiny_v4, tiny_hy_v4, smollm2, hf); default: the one the "
                            "run was trained against (RUN/draft/target.json), else "
                            + ("by draft kind" if default_target is None else default_target))
        p.add_argument("--target-path", default=None,
                       help="HF folder or Hub id of the target (target kind hf); default: RUN/draft/target.json's")
        p.add_argument("--out", required=True, type=Path,
                       help="the folder to write, new or empty (written beside it, then renamed into place)")
        p.add_argument("--overwrite", action="store_true",
                       help="OUT may hold files (e.g. an earlier export): replace it whole, nothing of it survives")
        p.add_argument("--dtype", default="bfloat16", choices=_DTYPES)
        p.add_argument("--max-shard-gb", type=float, default=5.0)
        p.add_argument("--no-verify", action="store_true", help="skip the verifier run after writing")
        add(p)
    args = ap.parse_args(argv)

    from dspark.export.verify import main_verify

    if args.cmd == "verify":
        return main_verify(args.path)
    import torch

    from dspark.errors import one_line_errors
    from dspark.export._io import check_out_dir

    with one_line_errors("python -m dspark.export"):
        check_out_dir(args.out, args.overwrite, source=getattr(args, "merge_into", None))  # before any model loads
        target, draft, cfg = _load_run_draft(args.run_dir, *resolve_target(args))
        FORMATS[args.cmd][3](target, draft, cfg, args, getattr(torch, args.dtype), int(args.max_shard_gb * 2**30))
    print(f"wrote {args.out}")
    status = 0 if args.no_verify else main_verify(args.out)
    if status == 0:
        print(next_step(args, draft))
    return status


if __name__ == "__main__":
    sys.exit(main())
