"""build_chat_dataset / cached_chat_dataset: contract columns, drop counts, cache reuse and keying."""

import pytest
from transformers import AutoTokenizer

from dspark.data.chat import render_with_loss_mask
from dspark.data.dataset import (
    ChatDatasetStats,
    build_chat_dataset,
    cache_key,
    cached_chat_dataset,
    default_cache_dir,
)
from dspark.targets.tiny_v4 import TINY_V4_DIR

RECORDS = [
    {"id": "long", "messages": [{"role": "user", "content": "Explain rain."},
                                {"role": "assistant", "content": "Rain forms when water vapour condenses into drops."}]},
    {"id": "short", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi"}]},
    {"id": "prompt-only", "messages": [{"role": "user", "content": "Only a question?"}]},
    {"id": "broken", "messages": [{"role": "narrator", "content": "??"}]},
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_V4_DIR, local_files_only=True)


def test_build_keeps_contract_columns_and_counts_drops(tok):
    stats = ChatDatasetStats()
    ds = build_chat_dataset(RECORDS, tok, max_length=64, min_loss_tokens=5, stats=stats)
    assert ds.column_names == ["input_ids", "loss_mask"]
    assert len(ds) == 1
    ids, mask = render_with_loss_mask(RECORDS[0]["messages"], tok, 64)
    assert ds[0] == {"input_ids": ids, "loss_mask": mask}
    assert (stats.records, stats.kept, stats.dropped_few_loss_tokens, stats.dropped_render_errors) == (4, 1, 2, 1)
    assert stats.loss_tokens == sum(mask) and stats.tokens == len(ids)


def test_max_length_truncates(tok):
    full_ids, full_mask = render_with_loss_mask(RECORDS[0]["messages"], tok, None)
    n = len(full_ids) - 4
    ds = build_chat_dataset(RECORDS[:1], tok, max_length=n, min_loss_tokens=1)
    assert ds[0] == {"input_ids": full_ids[:n], "loss_mask": full_mask[:n]}
    # cut before the assistant answer: no trainable token left, so the example is dropped
    stats = ChatDatasetStats()
    assert len(build_chat_dataset(RECORDS[:1], tok, max_length=full_mask.index(1), stats=stats)) == 0
    assert stats.dropped_few_loss_tokens == 1


def test_cache_builds_once_and_reloads(tok, tmp_path):
    calls = []

    def records_fn():
        calls.append(1)
        return iter(RECORDS)

    a = cached_chat_dataset("unit-src", records_fn, tok, 64, tmp_path, min_loss_tokens=1)
    b = cached_chat_dataset("unit-src", records_fn, tok, 64, tmp_path, min_loss_tokens=1)
    assert len(calls) == 1
    assert a[:] == b[:] and len(a) == 2
    # a different max_length (or source, or tokenizer) is a different entry
    cached_chat_dataset("unit-src", records_fn, tok, 32, tmp_path, min_loss_tokens=1)
    assert len(calls) == 2
    entries = sorted(p.name for p in (tmp_path / "chat_datasets").iterdir())
    assert len(entries) == 2 and all(e.startswith("unit-src-") for e in entries)


def test_cache_key_depends_on_tokenizer_template(tok):
    k1 = cache_key("s", tok, 64, 8)
    other = AutoTokenizer.from_pretrained(TINY_V4_DIR, local_files_only=True)
    assert cache_key("s", other, 64, 8) == k1
    other.chat_template = other.chat_template + " "
    assert cache_key("s", other, 64, 8) != k1
    assert cache_key("s/../x y", tok, 64, 8).startswith("s_.._x_y-")


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("DSPARK_CACHE")
    assert default_cache_dir().parts[-2:] == (".cache", "dspark")
