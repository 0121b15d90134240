"""Translation and summarization data: the FreeDict parser and its word choices, the split, the
featurizer and glossaries, the scores by hand, and bad pair files (decoding: test_seq2seq.py)."""

import dataclasses
import gzip
import itertools

import numpy as np
import pytest

import tasks
from core.errors import UserError
from tasks.common.tokenizer import BOS, EOS, PAD, Tokenizer
from tasks.nlp import freedict
from tasks.nlp.encoder_decoder import Seq2SeqFeaturizer, TextSource
from tasks.nlp.pairs import read_pairs, split_pairs
from tasks.nlp.summarize import rouge_scores
from tasks.nlp.translate import translation_scores

# Hand-copied from freedict-eng-deu.dict.dz (2022.04.21), trimmed.
ENTRIES = [
    (
        "dog",
        "dog /dˈɒɡ/\nBandhaken <masc>, Bandzieher <masc>, Reifzange <fem>\n         Note: Fassbinderei\n\n",
    ),
    (
        "dog",
        "dog /dˈɒɡ/\nHund <masc> [zool.]\n"
        '      "train a dog"  - einen Hund abrichten\n'
        '      "Let sleeping dogs lie."  - Schlafende Hunde soll man nicht wecken., Man soll keine schlafenden '
        "Hunde wecken.\n   Synonym: {dawg}\n\n see: {dogs}\n\n",
    ),
    ("the", "the /ðˈə/\ndas <art>\n         Note: des; dem; das\n\n"),
    ("the", "the /ðˈə/\nder <art>\n         Note: des; dem; den\n\n"),
    (
        "go",
        "go /ɡˈəʊ/ (went /wˈɛnt/ <>, gone /ɡˈɒn/ <>) <v>\ngehen <v, intr>\n"
        '      "he/she has/had gone"  - er/sie ist/war gegangen\n'
        '      "go too far"  - zu weit gehen, es zu weit treiben\n\n',
    ),
    ("with", "with /wˈɪð/\nbei ([+ dat]) <prep>\n"),
    ("run", "run /ɹˈʌn/\n [Am.] Laufmasche <fem>, Fallmasche <fem> [textil.]\n"),
    ("dog house", "dog house\nHundehütte <fem>, Hundezwinger <masc>\n"),
    ("Dog House", "Dog House\nHundehaus <neut>\n"),
    ("go to the dogs", "go to the dogs <v>\nvor die Hunde gehen <v>\n"),
    ("go to the dogs again", "go to the dogs again\nwieder vor die Hunde gehen\n"),
]


def b64(number: int) -> str:
    digits = ""
    while True:
        number, digit = divmod(number, 64)
        digits = freedict._BASE64[digit] + digits
        if number == 0:
            return digits


@pytest.fixture(scope="module")
def toy_dictionary(tmp_path_factory):
    """A dictd pair of files holding ENTRIES, as Debian ships them."""
    folder = tmp_path_factory.mktemp("dictd")
    data, index = b"00-database-info\nA toy dictionary\n", []
    for headword, entry in ENTRIES:
        raw = entry.encode("utf-8")
        index.append(f"{headword}\t{b64(len(data))}\t{b64(len(raw))}")
        data += raw
    (folder / "toy.dict.dz").write_bytes(gzip.compress(data))
    (folder / "toy.index").write_text("\n".join(index) + "\n", encoding="utf-8")
    return folder / "toy.dict.dz", folder / "toy.index"


def test_examples_keep_the_first_alternatives_on_both_sides():
    text = "".join(entry for _, entry in ENTRIES)
    assert freedict.example_pairs(text) == [
        ("train a dog", "einen Hund abrichten"),
        # A German sentence is kept whole; the alternative sentence after ".," is dropped.
        ("Let sleeping dogs lie.", "Schlafende Hunde soll man nicht wecken."),
        ("he has gone", "er ist gegangen"),
        ("go too far", "zu weit gehen"),
    ]


def test_a_sentence_with_commas_is_one_translation():
    german = "Ich weiß, das gehört nicht hierher, aber ich habe eine Frage."
    assert freedict.first_translation(german) == german
    assert freedict.first_translation("Aal blau, blauer Aal") == "Aal blau"


def test_senses_of_a_toy_dictionary_and_the_choice_by_counts(toy_dictionary):
    senses = freedict.senses(*toy_dictionary)
    # Labels (<...>, [...], nested ([+ dat])) go; an entry without examples still has a sense.
    assert senses == {
        "dog": ("Bandhaken", "Hund"),
        "the": ("das", "der"),
        "go": ("gehen",),
        "with": ("bei",),
        "run": ("Laufmasche",),
    }
    # Phrases of 2 to PHRASE_WORDS words, lower-cased, the first entry's first translation.
    assert freedict.phrases(*toy_dictionary) == {"dog house": "Hundehütte", "go to the dogs": "vor die Hunde gehen"}
    chosen = freedict.choose_senses(senses, ["der Hund", "der Hund bellt", "das Haus"])
    assert chosen["dog"] == "Hund" and chosen["the"] == "der"
    # No counts at all: the first sense.
    assert freedict.choose_senses(senses, [])["dog"] == "Bandhaken"


def test_learned_words_choose_senses_and_fill_gaps_from_the_pairs():
    senses = {"the": ("das", "der"), "dog": ("Bandhaken", "Hund"), "bark": ("Rinde", "bellen")}
    pairs = [
        ("the dog barks", "der Hund bellt"),
        ("the dog", "der Hund"),
        ("the house", "das Haus"),
        ("a house", "ein Haus"),
        ("the bark", "die Rinde"),
    ]
    words = freedict.learned_words(senses, pairs)
    # "the" shares 2 pairs with "der" and 1 with "das"; target counts alone would agree (der 2,
    # das 1), but "dog": "Hund" shares 2 pairs, "Bandhaken" none.
    assert words["the"] == "der" and words["dog"] == "Hund"
    # "bark" (a headword) shares one pair with "Rinde" and none with "bellen".
    assert words["bark"] == "Rinde"
    # "house" has no entry: Dice picks "Haus" (2 * 2 / (2 + 2)) over "das" (2 * 1 / (2 + 1)), and
    # they share 2 pairs. "barks" and "a" share one pair with their best words: left out.
    assert words["house"] == "Haus" and "barks" not in words and "a" not in words
    # One shared pair is enough with least=1: "bellt" (2 * 1 / (1 + 1)) beats "Hund" (2 / (1 + 2)).
    assert freedict.Cooccurrence(pairs).associate("barks", least=1) == "bellt"
    # Equal Dice: the German word seen first wins, whatever the hash seed orders sets by.
    ties = [(f"w{i}", " ".join(german)) for i, german in enumerate(itertools.permutations(["Ab", "Cd", "Ef", "Gh"]))]
    counts = freedict.Cooccurrence(ties)
    assert [counts.associate(english, least=1) for english, _ in ties] == [german.split()[0] for _, german in ties]


def test_word_by_word_copies_unknown_words_and_punctuation():
    words = {"the": "der", "dog": "Hund", "with": "mit"}
    assert freedict.word_by_word("The dog, with Rex!", words) == "der Hund, mit Rex!"
    # The longest phrase starting at a word is translated whole, whatever its case.
    phrases = {**words, "dog house": "Hundehütte", "the dog house": "die Hundehütte"}
    assert freedict.word_by_word("with The Dog house.", phrases) == "mit die Hundehütte."
    assert freedict.word_by_word("a dog house dog", phrases) == "a Hundehütte Hund"


def test_a_missing_dictionary_names_the_package_and_the_alternative(tmp_path):
    with pytest.raises(UserError, match="dict-freedict-eng-deu.*--data"):
        freedict.read(tmp_path / "freedict-eng-deu.dict.dz")


def test_the_split_is_fixed_and_no_source_is_in_two_splits():
    pairs = [(f"Phrase {i}", f"Satz {i}") for i in range(400)] + [(f"phrase  {i}", f"anders {i}") for i in range(400)]
    splits = {name: split_pairs(pairs, name) for name in ("train", "valid", "test")}
    sources = [e["source"].lower() for examples in splits.values() for e in examples]
    assert len(sources) == len(set(sources)) == 400  # duplicates differing in case and spaces dropped
    assert all(e["target"].startswith("Satz") for examples in splits.values() for e in examples)  # first kept
    assert 320 <= len(splits["train"]) <= 390 and splits["valid"] and splits["test"]
    assert split_pairs(pairs, "test") == splits["test"]
    reverse = split_pairs(pairs, "test", "reverse")
    # Reversed, the German side is the source: all 800 differ, so none is dropped.
    assert reverse and all(e["target"].lower().startswith("phrase") for e in reverse)
    assert sum(len(split_pairs(pairs, name, "reverse")) for name in ("train", "valid", "test")) == 800


@pytest.fixture(scope="module")
def featurizer():
    tokenizer = Tokenizer.train(["a b c d e f g h", "b c d e", "g h a b"] * 20, 30)
    return Seq2SeqFeaturizer(TextSource(tokenizer, 12), tokenizer, target_len=6)


def test_features_of_a_pair_by_hand(featurizer, apps_log):
    pieces = featurizer.target.processor.encode
    arrays = featurizer([{"source": "a b", "target": "c d"}, {"source": "a b c d e f g", "target": "h a b c d"}])
    source, target, long_target = pieces("a b"), pieces("c d"), pieces("h a b c d")
    assert len(source) < 11 and len(target) < 5 and len(long_target) > 6  # the cases below

    def padded(ids, length):
        return ids + [PAD] * (length - len(ids))

    np.testing.assert_array_equal(arrays["inputs"][0], padded([*source, EOS], 12))
    np.testing.assert_array_equal(arrays["targets"][0], padded([*target, EOS], 6))
    np.testing.assert_array_equal(arrays["decoder_inputs"][0], padded([BOS, *target], 6))
    assert (arrays["decoder_mask"] == (arrays["targets"] != PAD)).all() and arrays["mask"][1].all()
    # Cut to the budgets, with a warning for each side.
    np.testing.assert_array_equal(arrays["targets"][1], long_target[:6])
    np.testing.assert_array_equal(arrays["decoder_inputs"][1], [BOS, *long_target[:5]])
    assert "1 of 2 sources are longer than data.source_len=12" in apps_log.text
    assert "1 of 2 targets are longer than data.target_len=6" in apps_log.text
    assert featurizer.text([*target, EOS, 5, 6]) == "c d"


def test_translation_and_rouge_scores_by_hand():
    perfect = translation_scores(["der Hund bellt laut ."], ["der Hund bellt laut ."])
    assert perfect["bleu"] == pytest.approx(100) and perfect["chrf"] == pytest.approx(100)
    assert perfect["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    # Unigrams: "love" and "dress" of 3 each side: F1 2/3; no shared bigram; LCS "love dress": 2/3.
    scores = rouge_scores(["love this dress", "great"], ["love the dress", "great"])
    assert scores["rouge1"] == pytest.approx(100 * (2 / 3 + 1) / 2)
    assert scores["rouge2"] == pytest.approx(100 * (0 + 0) / 2)  # a one-word summary has no bigram
    assert scores["rougeL"] == pytest.approx(scores["rouge1"])


@pytest.mark.parametrize(
    "content,message",
    [
        ("", "is empty: no header and no rows"),
        ("source\ttext\nhello\tHallo\n", "no column 'target'.*source, text.*data.target_column"),
        ("source\ttarget\n\tHallo\n \t \n", "has no row with both"),
    ],
)
def test_bad_pair_files(tmp_path, content, message):
    path = tmp_path / "pairs.tsv"
    path.write_text(content)
    with pytest.raises(UserError, match=message):
        read_pairs(str(path), "source", "target")


def test_non_utf8_pair_file_names_the_line(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_bytes(b"source\ttarget\nhello\tHallo\ncaf\xe9\tCaf\xe9\n")
    with pytest.raises(UserError, match="line 3: not valid UTF-8"):
        read_pairs(str(path), "source", "target")


def test_rows_without_both_texts_are_left_out_with_a_warning(tmp_path, apps_log):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"en": "hello", "de": "hallo"}\n{"en": "", "de": "leer"}\n{"en": "bye", "de": null}\n')
    assert read_pairs(str(path), "en", "de") == (("hello", "hallo"),)
    assert "left out 2 of 3 rows" in apps_log.text


def test_empty_predict_input_is_refused():
    task_type = tasks.get("translate")
    with pytest.raises(UserError, match="at least one non-empty text"):
        task_type(config=task_type.presets["tiny"]()).parse_inputs(["", "  "], {})


def test_a_glossary_puts_the_gloss_after_the_source_and_travels_with_the_featurizer(featurizer, tmp_path):
    source = dataclasses.replace(featurizer.source, glossary={"a": "g", "b": "h"}, length=20)
    glossed = dataclasses.replace(featurizer, source=source)
    assert source.text("a b c.") == "a b c. = g h c."
    pieces = featurizer.target.processor.encode
    [ids] = source([{"source": "a b", "target": ""}])
    np.testing.assert_array_equal(ids, [*pieces("a b = g h"), EOS])
    glossed.save(tmp_path)
    again = Seq2SeqFeaturizer.load_text(tmp_path, 20, 6)
    assert again.source.glossary == {"a": "g", "b": "h"} and again.source.text("b a") == "b a = h g"
    assert again.shared and again.source.vocabulary is again.target
    (tmp_path / "plain").mkdir()
    featurizer.save(tmp_path / "plain")
    assert Seq2SeqFeaturizer.load_text(tmp_path / "plain", 12, 6).source.glossary is None


def test_a_glossary_needs_english_sources():
    from tasks.nlp.translate import TranslateData

    with pytest.raises(UserError, match="data.glossary='words' glosses English sources"):
        TranslateData(glossary="words", direction="reverse")


def test_a_phrase_glossary_leaves_out_phrases_that_are_held_out_sources(monkeypatch):
    task_type = tasks.get("translate")
    config = task_type.presets["tiny"]()
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, glossary="phrases"))
    task = task_type(config=config, data="synthetic")
    held_out = task.examples("test")[0]["source"]
    monkeypatch.setattr(freedict, "senses", lambda: {"cat": ("Katze",)})
    monkeypatch.setattr(freedict, "phrases", lambda: {held_out.lower(): "X", "red cat": "Rotkatze"})
    train = task.examples("train")
    assert task.glossary(train) == {"cat": "Katze", "red cat": "Rotkatze"}
