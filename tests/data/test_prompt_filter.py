"""dspark.data.prompt_filter: no training prompt equal to, or sharing 13 words with, a shipped eval prompt; no
repeated user-turn sequence; the kept records pass unchanged and in order."""
from __future__ import annotations

import json

from dspark.data.prompt_filter import NGRAM, PromptFilter


def _rec(rid, *turns):
    msgs = []
    for t in turns:
        msgs += [{"role": "user", "content": t}, {"role": "assistant", "content": "x"}]
    return {"id": rid, "messages": msgs}


def test_eval_copies_and_near_copies_are_dropped_and_the_rest_kept(tmp_path):
    long_q = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
              "and must-see attractions.")
    (tmp_path / "bench.jsonl").write_text(json.dumps({"turns": [long_q, "Rewrite it in limericks."]}) + "\n")
    f = PromptFilter(tmp_path)
    words = long_q.split()
    records = [
        _rec("exact", long_q),
        _rec("case_space", "  " + long_q.upper().replace(" ", "   ")),  # same after normalisation
        _rec("pasted", "Please help: " + long_q + " Thanks a lot!"),  # the eval prompt inside a longer message
        _rec("second_turn", "Hello there", "rewrite it in LIMERICKS."),  # any turn counts
        _rec("13_words", "My own question about " + " ".join(words[3:3 + NGRAM]) + " plus more"),
        _rec("12_words", "My own question about " + " ".join(words[3:3 + NGRAM - 1]) + " plus more"),
        _rec("unrelated", "What is the capital of France?"),
    ]
    kept = list(f.apply(records))
    assert [r["id"] for r in kept] == ["12_words", "unrelated"]
    assert kept[1] is records[-1]
    assert (f.dropped_eval_overlap, f.dropped_duplicate, f.kept) == (5, 0, 2)


def test_repeated_user_turns_are_dropped_after_the_first(tmp_path):
    f = PromptFilter(None)
    records = [_rec("a", "Hi", "More?"), _rec("b", "hi ", "more?"), _rec("c", "Hi"), _rec("d", "Hi", "Else?")]
    assert [r["id"] for r in f.apply(records)] == ["a", "c", "d"]
    assert (f.dropped_duplicate, f.kept) == (1, 3)
    assert "1 duplicates" in f.summary()


def test_the_shipped_eval_sets_are_read(tmp_path):
    f = PromptFilter()  # dspark/assets/eval: MT-Bench, GSM8K, HumanEval
    from dspark.data.reasoning_gym_source import EVAL_DIR

    first = json.loads(next(open(p, encoding="utf-8") for p in sorted(EVAL_DIR.glob("*.jsonl"))).readline())
    assert f.overlaps_eval(first["turns"][0])
    assert not f.overlaps_eval("a prompt no benchmark holds, about nothing in particular")
