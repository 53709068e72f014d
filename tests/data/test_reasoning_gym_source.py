"""reasoning-gym as a second prompt source (dspark.data.reasoning_gym_source): seeded, balanced over its tasks,
prefix-stable, and disjoint from the shipped eval prompts."""
import json

import pytest

from dspark.data.reasoning_gym_source import (
    DEFAULT_TASKS,
    LICENSE,
    ReasoningGymStats,
    eval_prompts,
    iter_reasoning_gym,
    normalise_prompt,
)

pytest.importorskip("reasoning_gym")


def test_records_are_seeded_single_user_turns_with_provenance():
    a = list(iter_reasoning_gym(24, seed=0))
    assert a == list(iter_reasoning_gym(24, seed=0))  # deterministic
    assert len(a) == 24 and len({r["id"] for r in a}) == 24
    assert [r["source"] for r in a[:len(DEFAULT_TASKS)]] == [f"reasoning-gym/{t}" for t in DEFAULT_TASKS]
    for r in a:
        assert r["license"] == LICENSE
        assert r["id"].startswith("rg-") and "-s0-" in r["id"]
        assert len(r["messages"]) == 1 and r["messages"][0]["role"] == "user"
        assert r["messages"][0]["content"].strip()
    other = [r["messages"][0]["content"] for r in iter_reasoning_gym(24, seed=1)]
    assert sum(x == y["messages"][0]["content"] for x, y in zip(other, a)) < 6  # another seed, other problems


def test_a_longer_run_starts_with_the_shorter_one():
    """Resuming with a larger --limit must not reshuffle what is already regenerated."""
    short, long = list(iter_reasoning_gym(40, seed=3)), list(iter_reasoning_gym(100, seed=3))
    assert long[:40] == short


def test_no_exact_overlap_with_the_shipped_eval_prompts():
    banned = eval_prompts()
    assert len(banned) > 1500  # mt-bench (both turns), gsm8k, humaneval
    stats = ReasoningGymStats()
    records = list(iter_reasoning_gym(400, seed=0, stats=stats))
    assert not {normalise_prompt(r["messages"][0]["content"]) for r in records} & banned
    assert len({normalise_prompt(r["messages"][0]["content"]) for r in records}) == 400  # no repeats either


def test_a_prompt_equal_to_an_eval_prompt_is_dropped(tmp_path):
    first = next(iter_reasoning_gym(1, seed=0))
    text = first["messages"][0]["content"]
    (tmp_path / "bench.jsonl").write_text(json.dumps({"turns": ["  " + text.upper() + " "]}) + "\n")
    stats = ReasoningGymStats()
    records = list(iter_reasoning_gym(5, seed=0, eval_dir=tmp_path, stats=stats))
    assert stats.dropped_eval_overlap == 1 and len(records) == 5
    assert first["id"] not in {r["id"] for r in records}


def test_gsm_symbolic_is_refused():
    """Its templates are GSM8K test questions: training on it would leak the GSM8K eval."""
    with pytest.raises(ValueError, match="gsm_symbolic"):
        list(iter_reasoning_gym(3, tasks=["leg_counting", "gsm_symbolic"]))


def test_eval_prompts_keep_a_turn_with_a_unicode_line_separator(tmp_path):
    """json.dumps(ensure_ascii=False) leaves U+2028 / U+0085 raw inside strings; a line is split at "\\n" only
    (str.splitlines broke such a record in two and the read failed)."""
    turn = "first line\u2028second\x85third"
    (tmp_path / "bench.jsonl").write_text(json.dumps({"turns": [turn]}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert eval_prompts(tmp_path) == {normalise_prompt(turn)}
