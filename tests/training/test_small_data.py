"""Data that yields nothing, or too little for the default held-out split (issue 40 items 3-4): refused or fitted in
one line, before any model loads; an empty dataset is never cached."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, TINY_RUN, compose
from dspark import factory
from dspark.errors import ConfigError
from dspark.data.held_out import held_out_count


def _sharegpt_lines(path, n: int) -> None:
    path.write_text("".join(json.dumps({"id": str(i), "conversations": [
        {"from": "human", "value": f"What is {i} plus {i}?"}, {"from": "gpt", "value": f"It is {2 * i}."}]}) + "\n"
        for i in range(n)))


@pytest.fixture
def no_model_loads(monkeypatch):
    monkeypatch.setattr(factory, "build_target", lambda *a, **k: pytest.fail("a model loaded"))


def test_a_jsonl_file_without_one_usable_line_is_refused_naming_sharegpt(tmp_path, no_model_loads):
    data = tmp_path / "sharegpt.jsonl"
    _sharegpt_lines(data, 5)
    from dspark.training.run import run_training

    with pytest.raises(ConfigError) as e:
        run_training(compose(TINY_RUN + [f"run_dir={tmp_path / 'run'}", "data.source=jsonl", f"data.path={data}"]))
    assert str(e.value) == (f"data.path: {data} has 0 usable conversations (5 line(s) skipped; first: line 1: line "
                            "has neither 'turns' nor 'messages'); the lines are ShareGPT records ({\"conversations\": "
                            "[{\"from\", \"value\"}]}): use data.source=sharegpt")
    other = tmp_path / "other.jsonl"
    other.write_text('{"prompt": "hi"}\n\n')
    with pytest.raises(ConfigError, match=r"0 usable conversations \(1 line\(s\) skipped.*needs 'messages'"):
        run_training(compose(TINY_RUN + [f"run_dir={tmp_path / 'run2'}", "data.source=jsonl", f"data.path={other}"]))


def test_the_sharegpt_source_reads_json_lines_too(tmp_path):
    from dspark.data.sharegpt import iter_sharegpt

    data = tmp_path / "sharegpt.jsonl"
    _sharegpt_lines(data, 3)
    records = list(iter_sharegpt(data, english_only=False))
    assert [r["messages"][1]["content"] for r in records] == ["It is 0.", "It is 2.", "It is 4."]


def test_an_empty_dataset_is_refused_and_never_cached(tmp_path, monkeypatch):
    from dspark.data.dataset import cached_chat_dataset
    from dspark.targets.tiny_v4 import load_tiny_v4

    _, tok = load_tiny_v4()
    records = [{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}]
    with pytest.raises(ConfigError, match=r"yielded 0 usable conversations \(1 read, 1 with fewer than 50 answer"):
        cached_chat_dataset("tiny-test", lambda: iter(records), tok, 64, cache_dir=tmp_path, min_loss_tokens=50)
    assert not any((tmp_path / "chat_datasets").glob("*")) if (tmp_path / "chat_datasets").exists() else True
    ds = cached_chat_dataset("tiny-test", lambda: iter(records), tok, 64, cache_dir=tmp_path, min_loss_tokens=1)
    assert len(ds) == 1  # the same key builds (not a cached empty set) once the records are usable


@pytest.mark.parametrize("n,setting,held", [(39, "auto", 3), (2, "auto", 1), (9, "auto", 1), (5000, "auto", 64),
                                            (39, 38, 38), (39, 1, 1)])
def test_held_out_count(n, setting, held):
    assert held_out_count(setting, n) == held


@pytest.mark.parametrize("n,setting,message", [
    (39, 64, r"^data.val_examples: 64 cannot be held out of 39 usable conversations .*use 1 to 38, or auto"),
    (39, 39, r"cannot be held out of 39"), (1, "auto", r"^data: 1 usable conversation\(s\): training needs at least 2"),
])
def test_held_out_counts_that_cannot_fit_are_refused(n, setting, message):
    with pytest.raises(ConfigError, match=message):
        held_out_count(setting, n)


def test_a_small_dataset_trains_with_a_fitted_split_and_an_explicit_misfit_is_one_line(tmp_path):
    """39 conversations: the default (auto) holds out a tenth and says so; data.val_examples=64 is refused in one
    line (exit 2) before any model loads."""
    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Count to {i}, please, one number per word."},
        {"role": "assistant", "content": " ".join(str(k) for k in range(1, i + 12))}]}) + "\n" for i in range(39)))
    tiny = [o for o in TINY_RUN if not o.startswith("data.val_examples")]
    base = [sys.executable, str(REPO / "train.py"), *tiny, "data.source=jsonl", f"data.path={data}",
            "data.min_loss_tokens=4", "trainer.max_steps=2"]
    bad = subprocess.run(base + [f"run_dir={tmp_path / 'bad'}", "data.val_examples=64"], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    lines = [ln for ln in bad.stderr.strip().splitlines() if ln.strip()]
    assert bad.returncode == 2 and len(lines) == 1, bad.stderr[-3000:]
    assert lines[0].startswith("train.py: error: data.val_examples: 64 cannot be held out of 39 usable conversations")
    assert "Loading weights" not in bad.stdout + bad.stderr and not (tmp_path / "bad" / "checkpoints").exists()
    ok = subprocess.run(base + [f"run_dir={tmp_path / 'ok'}"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "data.val_examples=auto: 3 of 39 usable conversations held out for validation" in ok.stdout
    saved = json.loads((tmp_path / "ok" / "metrics.json").read_text())
    assert saved["global_step"] == 2 and "val/tau_prob" in saved["final"]


def test_the_held_out_count_is_a_new_run_config_and_the_checked_one_is_never_changed(tmp_path, monkeypatch):
    """auto becomes a count once the rows are known: the checkpoints save the count, the RunConfig preflight built is
    left as it was (also on a resume, which takes the checkpoint's count)."""
    from dspark.training import run as run_module
    from dspark.training.resume import checkpoint_config

    checked = []
    original = run_module.check_training_config
    monkeypatch.setattr(run_module, "check_training_config", lambda cfg: checked.append(original(cfg)) or checked[-1])
    tiny = [o for o in TINY_RUN if not o.startswith(("data.val_examples", "trainer.max_steps"))]
    for resume in ([], ["resume=last", "resume_override=[trainer.max_steps]", "trainer.max_steps=3"]):
        run_module.run_training(compose(tiny + [f"run_dir={tmp_path / 'run'}", "trainer.max_steps=2", *resume]))
    assert [c.data.val_examples for c in checked] == ["auto", "auto"]
    saved, step = checkpoint_config(tmp_path / "run" / "checkpoints" / "last.ckpt")
    n = 160 - saved["data"]["val_examples"]  # data.limit=160 records, a tenth of the usable ones held out
    assert step == 3 and isinstance(saved["data"]["val_examples"], int) and 0 < saved["data"]["val_examples"] < n
