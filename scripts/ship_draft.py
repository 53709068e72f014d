"""Ship a trained draft in the repository: a finished run's draft/ folder with its floating-point weights stored in
bf16 (what the serving engines load; half the bytes of the float32 master weights training writes), the same
draft_config.json and target.json, and a fresh checksum manifest, so that eval.py and the exporters read it as they
read any run:

    python scripts/ship_draft.py RUN_DIR drafts/<name> [--dtype bfloat16] [--max-mb 60]
    python eval.py run_dir=drafts/<name> out=runs/<name>_eval          # the target named in its target.json

The weights are rounded to nearest-even in --dtype (torch's cast); integer tensors (vocabulary maps) are copied.
A folder over --max-mb is refused (the repository ships drafts of at most 60 MB). The shipped folder's acceptance is
its own: measure it with eval.py on the shipped folder, not on the run's float32 draft.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
from dspark.io import atomic_write_json, save_safetensors_atomic  # noqa: E402
from dspark.training import draft_dir  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def ship(run_dir: Path, out_dir: Path, dtype: torch.dtype = torch.bfloat16, max_mb: float = 60.0) -> Path:
    """out_dir/draft/ = run_dir/draft/ with floating weights cast to `dtype`, re-sealed; returns that folder."""
    src = Path(run_dir) / draft_dir.DRAFT_DIR
    state = draft_dir.load_state(src)  # checked against the run's manifest first
    shipped = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    nbytes = sum(t.numel() * t.element_size() for t in shipped.values())
    if nbytes > max_mb * 2**20:
        raise SystemExit(f"{src}: {nbytes / 2**20:.1f} MB of weights in {str(dtype).removeprefix('torch.')}, over "
                         f"--max-mb {max_mb:g}: ship a smaller draft (fewer layers, a smaller draft vocabulary)")
    dst = Path(out_dir) / draft_dir.DRAFT_DIR
    dst.mkdir(parents=True, exist_ok=True)
    save_safetensors_atomic(shipped, dst / draft_dir.WEIGHTS_FILE)
    atomic_write_json(dst / draft_dir.CONFIG_FILE, json.loads((src / draft_dir.CONFIG_FILE).read_text()))
    draft_dir.seal(dst, json.loads((src / draft_dir.TARGET_FILE).read_text()))
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a finished training run (its draft/ folder is read)")
    ap.add_argument("out_dir", type=Path, help="the shipped run folder (draft/ is written inside)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--max-mb", type=float, default=60.0)
    args = ap.parse_args()
    dst = ship(args.run_dir, args.out_dir, DTYPES[args.dtype], args.max_mb)
    size = (dst / draft_dir.WEIGHTS_FILE).stat().st_size
    print(f"{dst}: {size / 2**20:.1f} MB ({args.dtype}); evaluate it: python eval.py run_dir={args.out_dir} "
          f"out=runs/{args.out_dir.name}_eval")


if __name__ == "__main__":
    main()
