#!/usr/bin/env python
"""The draft's top-2 logit margin at every draft position of every verify round of ONE request, decoded by eval.py's
engine at T = 0 (first turn, greedy drafting): tells whether a step where eval.py and vLLM accept differently
(serve_check's per_request `first_step_diff`) is an argmax near-tie of the draft.

    python benchmarks/draft_margins.py RUN_DIR BENCHMARK CONV STEP[,STEP...] [--gamma 6] [--max-new-tokens 128]

Prints the margins at the given rounds (0-based) next to the request's median and 5th-percentile margin.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv=None) -> None:
    import torch
    from hydra import compose, initialize_config_dir

    from dspark.evaluation import run_eval as ev
    from dspark.evaluation.speculative import speculative_generate_batch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("benchmark")
    p.add_argument("conv", type=int, help="0-based conversation index in the benchmark file")
    p.add_argument("steps", help="comma-separated 0-based verify rounds to print")
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    a = p.parse_args(argv)
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=[f"run_dir={a.run_dir}", f"num_prompts={a.conv + 1}"])
    source = ev.draft_source(cfg)
    cfg = ev.with_run_target(cfg, source[2])
    target, draft, *_ = ev.build(cfg, source)
    convs = ev.read_benchmarks(cfg)[a.benchmark]
    prompt = torch.tensor(ev.render_conversation(target.tokenizer, convs[a.conv][:1], []))
    rounds: list[torch.Tensor] = []  # per round: the draft's logits [g, V]
    propose = draft.propose_batch

    def recording(*args, **kwargs):
        props = propose(*args, **kwargs)
        rounds.append(props[0].logits.float().clone())
        return props

    draft.propose_batch = recording
    decoded = speculative_generate_batch(
        target, draft, [prompt], max_new_tokens=a.max_new_tokens, num_drafts=a.gamma, temperature=0.0,
        eos_token_id=[target.tokenizer.eos_token_id], generators=[None], draft_sample_method="greedy",
        draft_cache=True, rejection_sample_method="standard")
    steps = decoded.steps[0]
    gaps = [lg.topk(2, dim=-1).values.diff(dim=-1).neg().squeeze(-1) for lg in rounds]  # [g] per round
    every = torch.cat(gaps)
    print(f"{a.benchmark} conv {a.conv}: {prompt.numel()} prompt tokens, {len(steps)} rounds; margin median "
          f"{every.median():.3e}, 5th percentile {every.quantile(0.05):.3e}, min {every.min():.3e}")
    for i in (int(s) for s in a.steps.split(",")):
        print(f"  round {i}: accepted {steps[i].num_accepted}, margins by position "
              + " ".join(f"{g:.2e}" for g in gaps[i].tolist()))


if __name__ == "__main__":
    main()
