"""Held-out loss of an UNTRAINED draft under a few initialisations of its final norm (benchmarks/README.md, "Step-0 CE").

    python benchmarks/init_probe.py experiment=dspark_smollm2 data.path=... [--scales 1 0.5 0.25 0.1]

Builds the run exactly as train.py does (same rows, the feature cache, seed), then for each scale s sets the draft's
final RMSNorm weight to s (the draft's logits are lm_head(s * h / rms(h)), so s sets their spread) and prints the
held-out CE, tau_prob, top-1 agreement and the logit spread of draft and teacher on the first held-out batch.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install


def main(argv: list[str]) -> int:
    import torch
    from hydra import compose, initialize_config_dir

    from dspark import factory
    from dspark.data.feature_cache_build import rows_before_target, target_loading
    from dspark.schema import run_config
    from dspark.targets.source import target_folder
    from dspark.training.build import build_datamodule, build_module
    from dspark.training.cache_plan import feature_cache_plan
    from dspark.training.draft_vocab import install_draft_vocab

    scales = [1.0, 0.5, 0.25, 0.1]
    if "--scales" in argv:
        i = argv.index("--scales")
        scales = [float(v) for v in argv[i + 1:]]
        argv = argv[:i]
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=argv)
    run = run_config(cfg)
    torch.manual_seed(run.seed)
    dataset = rows_before_target(run.data, target_folder(run.target), factory.build_dataset)
    plan = feature_cache_plan(run)
    target = factory.build_target(run.target, run.draft, target_loading(plan, run.copies_target, dataset))
    draft = factory.build_draft(run.draft, target, run.draft_start)
    dm = build_datamodule(run, target.tokenizer, dataset=dataset, target=target, plan=plan)
    install_draft_vocab(draft, dm.train_rows, target.tokenizer)
    module = build_module(run, draft, target).eval()
    module._attach_target()
    batches = list(dm.val_dataloader())
    print("| final-norm scale | held-out CE | tau_prob | agree pos 0 | draft logit std | teacher logit std |")
    print("|---|---|---|---|---|---|")
    for s in scales:
        draft.norm.weight.data.fill_(s)
        sums: dict = {}
        with torch.no_grad():
            for b in batches:
                for k, v in module.validation_sums(b).items():
                    sums[k] = sums.get(k, 0) + v.double()
            m = module.validation_metrics(sums)
            r = module.draft_rows(batches[0])
            keep = r.blocks.eval_mask
            lm = target.lm_head_weight.float()
            d = (draft.head_input(r.hidden)[keep].float() @ lm.T).std(-1).mean()
            t = (module._teacher_rows(r.final, r.blocks)[keep].float() @ lm.T).std(-1).mean()
        print(f"| {s} | {float(m['val/ce']):.2f} | {float(m['val/tau_prob']):.3f} | {float(m['val/agree_0']):.3f} | "
              f"{float(d):.2f} | {float(t):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
