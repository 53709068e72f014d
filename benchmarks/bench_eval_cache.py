"""Draft cost per verify round in eval.py's decoding loop, with and without the draft-side context cache.

For each draft and context length C, a batch of requests starts at anchor position C and runs `--rounds` verify
rounds, each keeping x0 + `--accept` drafts (so the context grows by 1 + accept per round, as in eval); the time of
`draft.propose_batch` per round is reported (median ms) for
  recompute: caches=None, every round projects the whole context again (eval.py before issue 13, block drafts;
             MTP: every step-0 row recomputed)
  cache:     draft.new_cache() per request, kept across rounds (block drafts: BlockContextCache; MTP: ChainCache)
Both modes run in the same process, interleaved round by round, so their ratio is what to read; the absolute ms
depend on the machine and its load. Weights are random (cost per round does not depend on them); the sizes are the
shipped configs' (configs/draft/*.yaml against their target configs).

  python benchmarks/bench_eval_cache.py                                    # all drafts, contexts 128 512 2048
  python benchmarks/bench_eval_cache.py --drafts dspark_v4 --contexts 128 2048 --batch 4 --out /tmp/bench.json

An untrained draft as a run folder eval.py reads (cost per round does not depend on training; AL does):
  python benchmarks/bench_eval_cache.py --save-untrained dflash_smollm2 /tmp/untrained_dflash
  python eval.py target=smollm2 run_dir=/tmp/untrained_dflash out=/tmp/e_cache                  # cache (default)
  python eval.py target=smollm2 run_dir=/tmp/untrained_dflash out=/tmp/e_nocache +draft_cache=false
  python benchmarks/bench_eval_cache.py --eval-summary /tmp/e_cache /tmp/e_nocache   # table of the eval.py reports
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# draft name -> (configs/draft group, target kind)
DRAFTS = {
    "dspark_v4": ("dspark_v4_tiny", "tiny_v4"),
    "dflash_smollm2": ("dflash_smollm2", "smollm2"),
    "dspark_smollm2": ("dspark_smollm2", "smollm2"),
    "dsv4_mtp": ("dsv4_mtp_tiny", "tiny_v4"),
    "hyv4_mtp": ("hyv4_mtp_tiny", "tiny_hy_v4"),
}


def target_dir(kind: str) -> Path:
    if kind == "tiny_v4":
        from dspark.targets.tiny_v4 import TINY_V4_DIR
        return TINY_V4_DIR
    if kind == "tiny_hy_v4":
        from dspark.targets.tiny_hy_v4 import TINY_HY_V4_DIR
        return TINY_HY_V4_DIR
    from dspark.targets.gguf_convert import prepare_smollm2
    return prepare_smollm2()


def build(name: str, seed: int = 0):
    """The draft of configs/draft/<group>.yaml against its target's config, random weights, random shared head."""
    from transformers import AutoConfig, AutoTokenizer

    from dspark.models import registry

    group_name, kind = DRAFTS[name]
    group = yaml.safe_load((REPO / "configs" / "draft" / f"{group_name}.yaml").read_text())
    folder = target_dir(kind)
    hf_config = AutoConfig.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(seed)
    cfg = registry.build_config(group, hf_config, tok)
    draft = registry.family(group["kind"]).draft(cfg).eval()
    v, h = int(hf_config.vocab_size), int(hf_config.hidden_size)
    draft.share_target_weights(torch.randn(v, h) * 0.02, torch.randn(v, h) * 0.02)
    n_taps = len(group.get("target_layer_ids") or [])
    hc = int(getattr(hf_config, "hc_mult", 1) or 1)
    return draft, n_taps, h, hc, v


def features(length: int, n_taps: int, hidden: int, hc: int, seed: int):
    from dspark.targets.hf_target import TargetFeatures

    g = torch.Generator().manual_seed(seed)
    return TargetFeatures(aux=torch.randn(1, length, n_taps * hidden, generator=g),
                          final=torch.randn(1, length, hidden, generator=g),
                          pre_head=torch.randn(1, length, hc, hidden, generator=g))


@torch.no_grad()
def bench(name: str, contexts: list[int], rounds: int, batch: int, accept: int, num_drafts: int | None) -> list[dict]:
    draft, n_taps, hidden, hc, vocab = build(name)
    g = int(num_drafts or draft.config.block_size)
    rows = []
    for ctx in contexts:
        total = ctx + rounds * (1 + accept) + 2
        feats = [features(total, n_taps, hidden, hc, seed=i) for i in range(batch)]
        gen = torch.Generator().manual_seed(1)
        toks = [torch.randint(0, vocab, (total + 1,), generator=gen) for _ in range(batch)]
        caches = [draft.new_cache() for _ in range(batch)]
        times = {"recompute": [], "cache": []}

        def run(a: int, mode: str) -> float:
            t0 = time.perf_counter()
            draft.propose_batch([f.prefix(a) for f in feats], [t[: a + 1] for t in toks], num_drafts=g,
                                temperature=0.0, generators=[None] * batch,
                                caches=caches if mode == "cache" else None)
            return time.perf_counter() - t0

        a = ctx
        run(a, "cache")  # fills the caches with the prompt (eval: the first round after prefill)
        run(a, "recompute")  # warm-up
        for _ in range(rounds):
            a += 1 + accept
            for mode in ("recompute", "cache"):
                times[mode].append(run(a, mode))
        rec, cac = (1e3 * statistics.median(times[m]) for m in ("recompute", "cache"))
        row = {"draft": name, "kind": draft.config.__class__.__name__, "context": ctx, "batch": batch, "drafts": g,
               "window": getattr(draft.config, "sliding_window", None) if hasattr(draft, "context_kv")
               else getattr(draft, "attention_window", None),
               "recompute_ms": round(rec, 3), "cache_ms": round(cac, 3), "speedup": round(rec / cac, 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def save_untrained(experiment: str, run_dir: str) -> None:
    """RUN/draft/ of a freshly initialised draft of `experiment=<experiment>` (what a finished run leaves, untrained)."""
    from hydra import compose, initialize_config_dir

    from dspark import factory
    from dspark.training.run import export_draft

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment={experiment}"])
    torch.manual_seed(0)
    target = factory.build_target(cfg.target, cfg.draft)
    draft = factory.build_draft(cfg.draft, target)
    export_draft(draft, cfg.draft, cfg.target, Path(run_dir) / "draft", target.fingerprint())
    print(f"untrained {experiment} draft written to {run_dir}/draft")


def eval_summary(folders: list[str]) -> None:
    """One markdown row per eval.py report folder (summary.*.json): draft time, spec / plain wall time, ratio."""
    print("| run | draft cache | rounds | draft s | target s | spec wall s | plain wall s | speedup vs plain | AL |"
          " greedy == plain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for folder in folders:
        for path in sorted(Path(folder).glob("summary.*.json")):
            reports = json.loads(path.read_text())["reports"].values()
            h = [r["harness"] for r in reports]
            tot = lambda key: sum(x[key] for x in h)  # noqa: E731
            spec = sum(r["wall_time_s"]["speculative"] for r in reports)
            plain = sum(r["wall_time_s"].get("target") or 0.0 for r in reports)
            n_spec = sum(r["generated_tokens"] for r in reports)
            n_plain = sum(r["tokens_per_s"].get("target", 0) * r["wall_time_s"].get("target", 0) for r in reports)
            speed = (n_spec / spec) / (n_plain / plain) if plain and n_plain else None
            al = sum(r["mean_acceptance_length"] * r["num_drafts"] for r in reports) / sum(r["num_drafts"] for r in reports)
            same = [r.get("greedy_outputs_equal_target") for r in reports]
            cache = next(iter(reports)).get("draft_cache", True)
            print(f"| {folder} | {cache} | {tot('rounds')} | {tot('draft_forward_s'):.2f} | {tot('target_forward_s'):.2f} |"
                  f" {spec:.2f} | {plain:.2f} | {'-' if speed is None else f'{speed:.2f}x'} | {al:.2f} |"
                  f" {', '.join(str(x) for x in same)} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafts", default="dspark_v4,dflash_smollm2,dsv4_mtp,hyv4_mtp",
                   help=f"comma-separated, of {sorted(DRAFTS)}")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--accept", type=int, default=2, help="drafts accepted per round (context grows by 1 + accept)")
    p.add_argument("--num-drafts", type=int, default=None, help="default: the draft's block size / num_steps")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--save-untrained", nargs=2, metavar=("EXPERIMENT", "RUN_DIR"), default=None,
                   help="only write an untrained draft of configs/experiment/EXPERIMENT.yaml to RUN_DIR/draft")
    p.add_argument("--eval-summary", nargs="+", metavar="EVAL_OUT", default=None,
                   help="only print a table of eval.py report folders (out=...)")
    a = p.parse_args()
    if a.eval_summary:
        eval_summary(a.eval_summary)
        return
    if a.save_untrained:
        save_untrained(*a.save_untrained)
        return
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = []
    for name in a.drafts.split(","):
        rows += bench(name.strip(), a.contexts, a.rounds, a.batch, a.accept, a.num_drafts)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
