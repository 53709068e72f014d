"""JSON Lines prompt files: turns/messages shapes, malformed lines counted or refused with the line number."""

import json
import logging
from pathlib import Path

import pytest

from dspark.data.jsonl import JsonlFormatError, JsonlStats, iter_jsonl_records, read_jsonl_records

EVAL_DIR = Path(__file__).resolve().parents[2] / "dspark" / "assets" / "eval"  # shipped with the repo


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_turns_and_messages_lines(tmp_path):
    path = _write(tmp_path / "p.jsonl", [
        json.dumps({"turns": ["first question", "follow-up"]}),
        "",
        json.dumps({"id": 7, "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
                                          {"role": "assistant", "content": "a"}]}),
    ])
    recs = read_jsonl_records(path)
    assert recs[0] == {"id": "p-1", "messages": [{"role": "user", "content": "first question"},
                                                 {"role": "user", "content": "follow-up"}]}
    assert recs[1]["id"] == "7"
    assert [m["role"] for m in recs[1]["messages"]] == ["system", "user", "assistant"]


BAD_LINES = [
    json.dumps({"turns": ["ok 1"]}),                                   # 1
    '{"turns": ["unterminated"',                                       # 2 invalid JSON
    json.dumps({"turns": ["ok 2"]}),                                   # 3
    json.dumps({"prompt": "no known key"}),                            # 4
    json.dumps(["a", "list"]),                                         # 5
    json.dumps({"turns": []}),                                         # 6
    json.dumps({"turns": ["x", 3]}),                                   # 7
    json.dumps({"messages": [{"role": "robot", "content": "beep"}]}),  # 8
    json.dumps({"messages": [{"role": "user", "content": "ok 3"}]}),   # 9
]


def test_malformed_lines_are_skipped_and_reported(tmp_path, caplog):
    path = _write(tmp_path / "bad.jsonl", BAD_LINES)
    stats = JsonlStats()
    with caplog.at_level(logging.WARNING, logger="dspark.data.jsonl"):
        recs = read_jsonl_records(path, stats=stats)
    assert [r["messages"][0]["content"] for r in recs] == ["ok 1", "ok 2", "ok 3"]
    assert stats.records == 3 and stats.skipped == 6
    assert stats.bad_lines == [2, 4, 5, 6, 7]  # the first five, 1-based
    assert "skipped 6 malformed line(s)" in caplog.text and "2, 4, 5, 6, 7, ..." in caplog.text


def test_strict_refuses_with_line_number(tmp_path):
    path = _write(tmp_path / "bad.jsonl", BAD_LINES)
    it = iter_jsonl_records(path, strict=True)
    assert next(it)["messages"][0]["content"] == "ok 1"
    with pytest.raises(JsonlFormatError, match=r"bad\.jsonl:2: malformed"):
        next(it)
    only_role = _write(tmp_path / "role.jsonl", [BAD_LINES[0], BAD_LINES[2], BAD_LINES[7]])
    with pytest.raises(JsonlFormatError, match=r":3: .*messages\[0\]"):
        read_jsonl_records(only_role, strict=True)


def test_clean_file_logs_nothing(tmp_path, caplog):
    path = _write(tmp_path / "ok.jsonl", [json.dumps({"turns": ["a"]})])
    with caplog.at_level(logging.WARNING, logger="dspark.data.jsonl"):
        assert len(read_jsonl_records(path, strict=True)) == 1
    assert caplog.text == ""


@pytest.mark.parametrize("name,min_turns,lines", [("gsm8k", 1, 1319), ("humaneval", 1, 164), ("mt-bench", 2, 80)])
def test_shipped_eval_files(name, min_turns, lines):
    path = EVAL_DIR / f"{name}.jsonl"
    assert name in (EVAL_DIR / "README.md").read_text()  # source and license recorded beside the file
    recs = read_jsonl_records(path, strict=True)
    assert len(recs) == lines  # the whole set (README), not a silent subset
    assert all(m["role"] == "user" and m["content"] for r in recs for m in r["messages"])
    assert max(len(r["messages"]) for r in recs) >= min_turns


def test_gitignore_covers_the_readme_outputs_and_not_the_sources():
    import shutil
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    outputs = ["runs/dspark_v4/x/metrics.json", "export/v4/model.safetensors", "outputs/a", "multirun/a",
               "data/regenerated/smollm2_sharegpt.jsonl", "lightning_logs/v", "notebooks/.ipynb_checkpoints/a"]
    sources = ["dspark/export/dense.py", "dspark/assets/eval/gsm8k.jsonl", "dspark/data/jsonl.py", "configs/config.yaml"]
    r = subprocess.run(["git", "check-ignore", "--no-index", *outputs, *sources], cwd=repo, capture_output=True, text=True)
    assert sorted(r.stdout.split()) == sorted(outputs)


def test_an_invalid_utf8_byte_is_a_malformed_line(tmp_path, caplog):
    """Before: UnicodeDecodeError out of the file iterator, naming neither the file nor the line, in both modes."""
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b'{"turns": ["ok 1"]}\n{"turns": ["caf\xe9"]}\n{"turns": ["ok 2"]}\n')  # latin-1 byte, line 2
    stats = JsonlStats()
    with caplog.at_level(logging.WARNING, logger="dspark.data.jsonl"):
        recs = read_jsonl_records(path, stats=stats)
    assert [r["messages"][0]["content"] for r in recs] == ["ok 1", "ok 2"]
    assert recs[1]["id"] == "bytes-3"  # line numbers unchanged after the bad line
    assert stats.skipped == 1 and stats.bad_lines == [2]
    assert "skipped 1 malformed line(s) (lines 2;" in caplog.text and "not valid UTF-8" in caplog.text
    with pytest.raises(JsonlFormatError, match=r"bytes\.jsonl:2: malformed prompt line: not valid UTF-8 \(byte 0xe9 "
                                               r"at column 16\)"):
        read_jsonl_records(path, strict=True)


def test_strict_refusal_is_a_one_line_user_error(tmp_path):
    """JsonlFormatError is a UserError: the CLIs' one_line_errors print it as one line and exit 2."""
    from dspark.errors import UserError, one_line_errors

    path = _write(tmp_path / "bad.jsonl", BAD_LINES[:2])
    with pytest.raises(SystemExit) as exit_info:
        with one_line_errors("train.py"):
            read_jsonl_records(path, strict=True)
    assert exit_info.value.code == 2 and issubclass(JsonlFormatError, (UserError, ValueError))
