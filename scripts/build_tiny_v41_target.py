"""Build dspark/assets/tiny_v41: the tiny DeepSeek-V4.1 target (dspark.targets.v41) from the shipped tiny V4.

The weights are the tiny V4 target's (dspark/assets/tiny_v4, bf16-stored) without hc_head, which V4.1 does not
have; the config is the tiny V4's with model_type "deepseek_v41". It is NOT retrained under V4.1's mHC: its
language-model quality under V4.1 is what this script prints (held-out token NLL vs the V4 original), for a draft
to train against and for the V4.1 export / import checks. Seconds on 2 CPU cores:

    python scripts/build_tiny_v41_target.py [--out dspark/assets/tiny_v41]
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from _tiny_build_env import REPO  # first: sets up the environment torch starts with (and the worktree on sys.path)

import torch


def build(out: Path) -> dict:
    import dspark.targets.v41 as v41
    from dspark.targets.tiny_v4 import TINY_V4_DIR, load_tiny_v4

    v4, tok = load_tiny_v4()
    values = v4.config.to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        values.pop(key, None)
    model = v41.DeepseekV41ForCausalLM(v41.DeepseekV41Config(**values))
    model.load_state_dict({k: t for k, t in v4.state_dict().items() if ".hc_head." not in k}, strict=True)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)  # the tiny V4's values are bf16: lossless
    tok.save_pretrained(out)
    for name in ("chat_template.jinja", "generation_config.json"):
        if (TINY_V4_DIR / name).is_file():
            shutil.copy(TINY_V4_DIR / name, out / name)
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return {"source": str(TINY_V4_DIR), "params": sum(p.numel() for p in model.parameters())}


def measure(out: Path, n: int = 40) -> dict:
    """Mean next-token NLL (nats/token) on the first `n` user turns of dspark/assets/eval/mt-bench.jsonl: the tiny V4
    target, the tiny V4.1 target (same weights, V4.1 mHC) and the V4.1 target on the same tokens shuffled."""
    from transformers import AutoModelForCausalLM

    from dspark.targets.tiny_v4 import load_tiny_v4

    v4, tok = load_tiny_v4()
    v41 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    turns = [t for line in (REPO / "dspark/assets/eval/mt-bench.jsonl").read_text().splitlines()
             for t in json.loads(line)["turns"]][:n]
    g = torch.Generator().manual_seed(0)

    def nll(model, ids):
        with torch.no_grad():
            logits = model(ids[None]).logits[0, :-1].float()
        return torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum").item(), ids.numel() - 1

    sums = {"tiny_v4": [0.0, 0], "tiny_v41": [0.0, 0], "tiny_v41_shuffled": [0.0, 0]}
    for text in turns:
        ids = torch.tensor(tok(text)["input_ids"][:256])
        if ids.numel() < 8:
            continue
        for key, model, seq in (("tiny_v4", v4, ids), ("tiny_v41", v41, ids),
                                ("tiny_v41_shuffled", v41, ids[torch.randperm(ids.numel(), generator=g)])):
            total, count = nll(model, seq)
            sums[key][0] += total
            sums[key][1] += count
    return {key: round(total / count, 3) for key, (total, count) in sums.items()} | {"tokens": sums["tiny_v4"][1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "dspark/assets/tiny_v41")
    ap.add_argument("--measure", action="store_true", help="also print held-out NLLs (V4 vs V4.1 vs shuffled)")
    args = ap.parse_args()
    report = build(args.out)
    if args.measure:
        report["nll_nats_per_token"] = measure(args.out)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
