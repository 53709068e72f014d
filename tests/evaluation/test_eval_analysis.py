"""Eval-side confidence analysis on hand-made verify steps: split, round grouping, STS on over-confident
logits, scheduler simulation; and the conversation renderer for multi-turn benchmarks."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dspark.evaluation import analysis
from dspark.evaluation.speculative import StepStats


def step(logits, n):
    return StepStats(anchor_pos=0, draft_tokens=[0] * len(logits), num_accepted=n, next_token=0, conf=None,
                     conf_logits=list(logits))


def test_rounds_group_the_jth_step_of_each_request_of_a_batch():
    a = [step([0.0, 0.0], 1), step([10.0, -10.0], 2)]
    b = [step([0.0, 10.0], 0)]
    rounds = analysis.rounds([[a, b], [[step([-10.0, 0.0], 0)]]], np.ones(2))
    assert [r.shape for r in rounds] == [(2, 2), (1, 2), (1, 2)]
    np.testing.assert_allclose(rounds[0][0], [0.5, 0.25])  # survival = cumulative product of sigmoids
    np.testing.assert_allclose(rounds[1][0], [1 / (1 + np.exp(-10)), 1 / (1 + np.exp(-10)) / (1 + np.exp(10))])


def test_blocks_refuse_missing_logits_and_mixed_gamma():
    with pytest.raises(ValueError, match="no confidence logits"):
        analysis.blocks([[StepStats(0, [1], 1, 0, None)]])
    with pytest.raises(ValueError, match="different numbers"):
        analysis.blocks([[step([0.0], 1), step([0.0, 0.0], 1)]])


def test_confidence_report_sts_fixes_overconfident_logits():
    """True acceptance probability sigmoid(z / 3) per position, the head reports z (3x over-confident):
    STS fitted on even requests lowers the held-out ECE and finds T near 3 at position 1."""
    rng = np.random.default_rng(0)
    g, requests = 3, []
    for _ in range(120):
        steps = []
        for _ in range(5):
            z = rng.normal(0, 4, size=g)
            ok = rng.random(g) < 1 / (1 + np.exp(-z / 3))
            steps.append(step(z, int(np.cumprod(ok).sum())))
        requests.append(steps)
    rep = analysis.confidence_report([requests[:60], requests[60:]], lambda b: 100.0 / (1 + 0.01 * b))
    cal = rep["calibration"]
    assert rep["split"] == {"fit_requests": 60, "fit_blocks": 300, "heldout_requests": 60, "heldout_blocks": 300}
    assert cal["pooled"]["ece_after"] < 0.5 * cal["pooled"]["ece_before"]
    assert 2.0 < cal["temperatures"][0] < 4.5
    sweep = rep["threshold_sweep"]
    assert [s["drafts_kept"] for s in sweep] == sorted((s["drafts_kept"] for s in sweep), reverse=True)
    sim = rep["scheduler"]
    assert sim["speedup_vs_best_fixed"] >= 1 - 1e-9  # the prefix scheduler includes every fixed length


def test_render_conversation_interleaves_answers():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from dspark.evaluation.run_eval import render_conversation

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    ids = render_conversation(tok, ["hi", "more"], ["yo"])
    assert tok.decode(ids) == "<user>hi<assistant>yo<user>more<assistant>"
    with pytest.raises(ValueError, match="need 1 answers"):
        render_conversation(tok, ["hi", "more"], [])


def test_compare_rows_and_the_notebook_code_run_on_reports(tmp_path, monkeypatch):
    """compare.load_rows reads summaries from report folders and run dirs; the notebook's code cells run."""
    import json
    import os

    from dspark.evaluation.compare import load_rows, table

    def write(folder, al, T):
        rep = {"temperature": T, "gamma": 2, "mean_acceptance_length": al, "draft_acceptance_rate": (al - 1) / 2,
               "speedup_vs_target": None, "harness": {"overhead_share": 0.1}, "num_requests": 3,
               "per_position_conditional_rate": [0.5, None]}
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"summary.T{T:g}.g2.json").write_text(json.dumps({"reports": {"gsm8k": rep, "mt-bench": rep}}))

    write(tmp_path / "a" / "eval", 1.5, 0.0)
    write(tmp_path / "b", 1.25, 1.0)
    rows = load_rows({"a": tmp_path / "a", "b": tmp_path / "b"})
    assert [(r["run"], r["benchmark"], r["mean_acceptance_length"]) for r in rows] == [
        ("a", "gsm8k", 1.5), ("a", "mt-bench", 1.5), ("b", "gsm8k", 1.25), ("b", "mt-bench", 1.25)]
    assert "1.250" in table(rows) and "-" in table(rows)
    with pytest.raises(FileNotFoundError, match="no eval summary"):
        load_rows({"x": tmp_path})
    import matplotlib

    matplotlib.use("Agg")
    runs = tmp_path / "runs"  # the notebook's default: every run under $DSPARK_RUNS with eval reports
    write(runs / "dspark_v4" / "20260101-000000" / "eval", 1.5, 0.0)
    write(runs / "dflash" / "20260101-000001" / "eval", 1.25, 1.0)
    monkeypatch.setenv("DSPARK_RUNS", str(runs))  # never the checkout's own runs/: the test must not depend on them
    nb = json.loads((Path(__file__).resolve().parents[2] / "notebooks" / "eval_reports.ipynb").read_text())
    scope: dict = {}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            exec("".join(cell["source"]), scope)
    assert len(scope["rows"]) == 4 and sorted({r["mean_acceptance_length"] for r in scope["rows"]}) == [1.25, 1.5]
