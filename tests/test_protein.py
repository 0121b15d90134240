"""Protein tasks: sequence files, the residue vocabulary, masking, crops and windows, the species
split, --init-from, and users' bad input."""

import gzip
import json

import numpy as np
import pytest
from helpers import apps, plain

import tasks
from core import run
from core.errors import UserError
from core.training.steps import build_model
from tasks.protein import base, sequences
from tasks.protein import data as protein_data

FASTA = """>sp|P1|ONE_HUMAN Protein one OS=Homo sapiens OX=9606 GN=A PE=1 SV=1
mkTAyiak
QR*
>sp|P2|TWO_MOUSE Protein two OS=Mus musculus OX=10090 PE=2 SV=1
MUOBZJX
"""

SWISS = """ID   ONE_HUMAN               Reviewed;          12 AA.
AC   P11111;
DE   RecName: Full=Protein one;
OS   Homo sapiens (Human).
OC   Eukaryota.
SQ   SEQUENCE   12 AA;  1000 MW;  0000000000000000 CRC64;
     MKTAYIAKQR GG
//
"""


def test_fasta_plain_and_gzipped_lowercase_stop_and_header_fields(tmp_path):
    plain = tmp_path / "a.fasta"
    plain.write_text(FASTA)
    zipped = tmp_path / "a.fa.gz"
    zipped.write_bytes(gzip.compress(FASTA.encode()))
    for path in (plain, zipped):
        records = sequences.read_sequences(str(path))
        assert [r["id"] for r in records] == ["sp|P1|ONE_HUMAN", "sp|P2|TWO_MOUSE"]
        assert records[0]["sequence"] == "MKTAYIAKQR*" and records[0]["species"] == "Homo sapiens"
        assert records[0]["name"] == "Protein one" and records[1]["species"] == "Mus musculus"
    # Lower case reads as upper case; the trailing stop codon is dropped.
    assert sequences.decode(sequences.encode("mkTA*", "x")) == "MKTA"


def test_ambiguous_and_rare_letters_map_as_stated():
    # U -> C, O -> K; B, Z, J and X -> X.
    assert sequences.decode(sequences.encode("MUOBZJX", "x")) == "MCKXXXX"
    assert len(sequences.VOCAB) == 23 and sequences.VOCAB[:3] == ("<pad>", "<mask>", "X")


def test_an_invalid_letter_is_named_with_record_and_position():
    with pytest.raises(UserError, match=r"'seq7': '1' at position 4 is not an amino-acid letter"):
        sequences.encode("MKT1A", "seq7")
    with pytest.raises(UserError, match="'empty' has no sequence"):
        sequences.encode("  *", "empty")


def test_swissprot_flat_file(tmp_path):
    path = tmp_path / "one.dat"
    path.write_text(SWISS)
    [record] = sequences.read_sequences(str(path))
    assert record["sequence"] == "MKTAYIAKQRGG" and record["species"] == "Homo sapiens (Human)"
    assert record["name"] == "Protein one"


def test_tables_name_missing_columns_and_empty_files(tmp_path):
    table = tmp_path / "t.csv"
    table.write_text("seq,label\nMKTA,amp\n")
    with pytest.raises(UserError, match=r"no column 'sequence'.*columns are seq, label"):
        sequences.read_sequences(str(table))
    records = sequences.read_sequences(str(table), "seq", "label")
    assert records[0]["sequence"] == "MKTA" and records[0]["label"] == "amp"
    empty = tmp_path / "e.fasta"
    empty.write_text("")
    with pytest.raises(UserError, match="holds no sequence records"):
        sequences.read_sequences(str(empty))
    not_fasta = tmp_path / "n.fasta"
    not_fasta.write_text("MKTA\n")
    with pytest.raises(UserError, match="not FASTA"):
        sequences.read_sequences(str(not_fasta))
    no_sequence = tmp_path / "s.fasta"
    no_sequence.write_text(">a\nMK\n>b\n>c\nMM\n")
    with pytest.raises(UserError, match="record 'b' has no sequence"):
        sequences.read_sequences(str(no_sequence))


def test_rows_without_a_label_are_left_out_with_a_count_in_every_task_that_reads_labels(tmp_path, caplog):
    """A missing label, empty or NaN (how an empty number reads), drops its row with one warning
    that counts them, for protein and sentiment tables alike."""
    from tasks.nlp import data as text_data

    proteins, reviews = tmp_path / "p.csv", tmp_path / "r.csv"
    proteins.write_text("sequence,label\nMKTA,1\nMKTB,\nMKTC,0\nMKTD,\n")
    reviews.write_text("text,label\ngood,5\nbad,1\nhm,\n")
    with caplog.at_level("WARNING", logger="apps"):
        records = sequences.read_sequences(str(proteins), "sequence", "label")
        columns = text_data.load_table(str(reviews), "text", "label")
    assert [(r["sequence"], r["label"]) for r in records] == [("MKTA", "1.0"), ("MKTC", "0.0")]
    assert columns == {"text": ["good", "bad"], "label": [5.0, 1.0]}
    assert "2 of 4 rows have no label in column 'label' (the first: row 2)" in caplog.text
    assert "1 of 3 rows have no label in column 'label' (the first: row 3)" in caplog.text


def test_masking_spares_padding_specials_and_takes_about_15_percent():
    rng = np.random.default_rng(0)
    ids = rng.integers(sequences.UNKNOWN, len(sequences.VOCAB), (64, 200))
    ids[:, 150:] = sequences.PAD
    corrupted, chosen = base.corrupt(ids, 0.15, rng)
    standard = ids >= base.FIRST_RESIDUE
    assert not chosen[~standard].any()  # never padding, the mask token or X
    assert (corrupted[~chosen] == ids[~chosen]).all()
    assert abs(chosen.sum() / standard.sum() - 0.15) < 0.01
    # 80% of the chosen become the mask token, 10% a random residue, 10% stay.
    assert abs((corrupted[chosen] == sequences.MASK).mean() - 0.8) < 0.03
    assert (corrupted[chosen] >= sequences.MASK).all()


def test_windows_cover_every_residue_once_in_the_average():
    lengths = [5, 64, 65, 200]
    codes = [np.arange(n) % 20 + base.FIRST_RESIDUE for n in lengths]
    rows = sequences.windows({"inputs": codes}, 64)
    assert [sequences.window_offsets(n, 64) for n in lengths] == [[0], [0], [0, 1], [0, 32, 64, 96, 128, 136]]
    # Each row's values: the position in its sequence; averaging must give back 0..L-1 exactly.
    values = (rows["offset"][:, None] + np.arange(64)[None, :]).astype(float)
    merged = sequences.merge_windows(values, rows["sequence"], rows["offset"], lengths)
    for n, m in zip(lengths, merged):
        np.testing.assert_array_equal(m, np.arange(n))
    counts = sequences.merge_rows(np.ones(len(rows["sequence"])), rows["sequence"], len(lengths))
    np.testing.assert_array_equal(counts, 1.0)


def test_crops_keep_residue_labels_aligned():
    rng = np.random.default_rng(1)
    ids = np.zeros((3, 40), np.int32)
    ids[0, :40] = np.arange(40) + 3
    ids[1, :10] = np.arange(10) + 3
    ids[2, :25] = np.arange(25) + 3
    batch = {"inputs": ids, "mask": ids > 0, "targets": ids * 10, "target_mask": ids > 0}
    for _ in range(20):
        cut = sequences.crop(batch, ["inputs", "mask", "targets", "target_mask"], 16, rng)
        assert cut["inputs"].shape == (3, 16)
        np.testing.assert_array_equal(cut["targets"], cut["inputs"] * 10)  # labels move with their residues
        np.testing.assert_array_equal(cut["mask"], cut["inputs"] > 0)
        assert (np.diff(cut["inputs"][0]) == 1).all()  # a contiguous span
        np.testing.assert_array_equal(cut["inputs"][1, :10], np.arange(10) + 3)  # short rows stay whole


def test_the_featurizer_pairs_labels_and_names_a_length_mismatch():
    featurizer = base.ResidueFeaturizer("residue", ("C", "E", "H"), 8, 32, 0.15)
    rows = featurizer([{"id": "a", "sequence": "MKTAYIAKQR", "label": "CCHHHHEECC"}])
    assert rows["inputs"].shape == (2, 8) and list(rows["offset"]) == [0, 2]
    np.testing.assert_array_equal(rows["targets"][1], [2, 2, 2, 2, 1, 1, 0, 0])
    with pytest.raises(UserError, match="'b': its label string has 3 letters, its sequence 4 residues"):
        featurizer([{"id": "b", "sequence": "MKTA", "label": "CCH"}])


def test_the_family_split_keeps_species_apart():
    records = protein_data.families(protein_data.uniprot())
    assert len({r["label"] for r in records}) >= 50
    assert not any(v in r["label"].lower() for r in records for v in ("uncharacterized", "putative"))
    task_type = tasks.get("protein-class")
    task = task_type(config=task_type.presets["family"]())
    species = {split: {r["species"] for r in task.examples(split)} for split in ("train", "valid", "test")}
    assert all(species.values())
    assert not (species["train"] & species["valid"]) and not (species["train"] & species["test"])
    assert not (species["valid"] & species["test"])


def test_mlm_split_keeps_identical_sequences_in_one_split():
    task_type = tasks.get("protein-mlm")
    task = task_type(config=task_type.presets["tiny"]())
    splits = {split: {r["sequence"] for r in task.examples(split)} for split in ("train", "valid", "test")}
    assert not (splits["train"] & splits["test"]) and not (splits["train"] & splits["valid"])
    assert 16000 < len(splits["train"]) < 17500


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mlm")
    run.train(tasks.get("protein-mlm"), workdir=workdir, preset="tiny", data="synthetic")
    return workdir


def test_init_from_restores_the_body_and_leaves_the_head_fresh(mlm_run, tmp_path):
    from core.training.checkpoints import Checkpoints
    from core.training.transfer import flatten
    from tasks.protein.classify import ProteinClassTask

    config = run.make_config(ProteinClassTask, "tiny", [f"model.init_from={str(mlm_run)!r}"])
    task = ProteinClassTask(config=config, data="synthetic")
    featurizer = task.fit_featurizer(task.examples("train"))
    model = build_model(task, featurizer, config, from_pretrained=True)
    fresh = build_model(task, featurizer, run.make_config(ProteinClassTask, "tiny"))
    saved = flatten(Checkpoints(mlm_run, read_only=True).read_params().value)
    from core.checkpoints.rules import flat_params

    params, initial = flat_params(model), flat_params(fresh)
    for name, value in params.items():
        if name.startswith(("embedder.", "body.")):
            np.testing.assert_array_equal(np.asarray(value), np.asarray(saved[name]))
        else:
            np.testing.assert_array_equal(np.asarray(value), np.asarray(initial[name]))  # the head as initialized


def test_init_from_a_run_of_another_size_names_the_parameters(mlm_run):
    from tasks.protein.classify import ProteinClassTask

    config = run.make_config(ProteinClassTask, "tiny", [f"model.init_from={str(mlm_run)!r}", "model.d_model=64"])
    task = ProteinClassTask(config=config, data="synthetic")
    featurizer = task.fit_featurizer(task.examples("train"))
    with pytest.raises(UserError, match=r"embedder.embedding.embedding is \[23, 32\] there, \[23, 64\] here"):
        build_model(task, featurizer, config, from_pretrained=True)
    config = run.make_config(ProteinClassTask, "tiny", ["model.init_from='/nonexistent/run'"])
    with pytest.raises(UserError, match="no trained run there"):
        build_model(task, featurizer, config, from_pretrained=True)


def test_mlm_fills_masked_residues_and_embeds(mlm_run):
    predictor = run.Predictor(tasks.get("protein-mlm"), mlm_run)
    [row] = predictor.predict(["MKT?AYIAK"])
    assert row["sequence"][3] in sequences.AMINO_ACIDS and row["filled"] == [4]  # positions count from 1
    [probability] = row["probabilities"]
    assert type(probability) is float and 1 / len(sequences.AMINO_ACIDS) <= probability <= 1
    examples = [{"id": "a", "sequence": "MKTAYIAK" * 20, "label": None}, {"id": "b", "sequence": "MK", "label": None}]
    pooled = predictor.task.embed(predictor.model, predictor.featurizer, examples)
    residues = predictor.task.embed(predictor.model, predictor.featurizer, examples, per_position=True)
    assert [r.shape for r in residues] == [(160, 32), (2, 32)]
    np.testing.assert_allclose(pooled[0], residues[0].mean(0), rtol=1e-6)


def test_bad_predict_input_is_named(mlm_run):
    predictor = run.Predictor(tasks.get("protein-mlm"), mlm_run)
    with pytest.raises(UserError, match=r"'input 1': '1' at position 3"):
        predictor.predict(["MK1"])
    with pytest.raises(UserError, match="needs sequences"):
        predictor.predict(["  "])


def test_predict_reads_fasta_from_lines(mlm_run):
    rows = run.Predictor(tasks.get("protein-mlm"), mlm_run).predict([">x desc", "MKTA", "YIAK", ">y", "MM?"])
    assert [r["id"] for r in rows] == ["x", "y"] and rows[0]["sequence"] == "MKTAYIAK"
    assert json.dumps(rows)


def test_cli_init_from_embed_and_mistakes(mlm_run, tmp_path):
    def train_class(workdir, *more):
        return apps("train", "protein-class", "--preset", "tiny", "--data", "synthetic", "--workdir", workdir, *more)

    workdir = tmp_path / "class"
    result = train_class(workdir, "--init-from", mlm_run, "--set", "train.steps=10", "--set", "model.head_init=probe")
    assert result.exit_code == 0, result.output
    assert "Head fitted as a logistic-regression probe" in plain(result.output)
    assert json.loads((workdir / "config.json").read_text())["model"]["init_from"] == str(mlm_run)

    fasta = tmp_path / "q.fasta"
    fasta.write_text(">a\nMKTAYIAK\n>b\nMMKT\n")
    out = tmp_path / "emb.npz"
    result = apps("embed", "protein-mlm", "--workdir", mlm_run, fasta, "--out", out)
    assert result.exit_code == 0, result.output
    saved = np.load(out)
    assert sorted(saved.files) == ["a", "b"] and saved["a"].shape == (32,)
    result = apps("embed", "protein-mlm", "--workdir", mlm_run, fasta, "--out", out, "--per-position")
    assert result.exit_code == 0 and np.load(out)["b"].shape == (4, 32)

    for result, message in [
        (
            train_class(tmp_path / "x", "--init-from", mlm_run, "--set", "model.num_layers=2"),
            "that run has no body.blocks.1",
        ),
        (train_class(tmp_path / "y", "--init-from", tmp_path / "nothing"), "no trained run there"),
        (train_class(tmp_path / "w", "--set", "model.head_init=probe"), "give --init-from RUN_DIR or model.pretrained"),
        (apps("embed", "--workdir", mlm_run), "needs the run's task first"),
        (apps("embed", "sentiment", "--workdir", mlm_run, "MKT"), "holds a protein-mlm run, not sentiment"),
        (apps("train", "protein-mlm", "--data", tmp_path / "none.fasta", "--workdir", tmp_path / "z"), "no such file"),
    ]:
        assert result.exit_code == 1 and message in plain(result.output), (message, result.output)
        assert "Traceback" not in result.output


def structure_db_bytes(chains, flags=0x08):
    """A ProMod3 structure database in the layout tasks/protein/structure_db.py reads."""
    import struct

    header = struct.pack("<II11IIfBHQhi", 1234, 2, 4, 4, 2, 8, 2, 6, 88, 40, 24, 6, 4, 1, 1.0, 1, 1, 1, 1, flags)
    records, sequence, dssp = b"", "", ""
    for pdb, chain, residues, states in chains:
        records += struct.pack("<I", len(pdb)) + pdb.encode() + struct.pack("<I", len(chain)) + chain.encode()
        records += struct.pack("<IHH3f", len(sequence), len(residues), 1, 0, 0, 0)
        sequence, dssp = sequence + residues, dssp + states
    n = len(sequence)
    arrays = struct.pack("<Q", n) + sequence.encode() + struct.pack("<Q", n) + bytes(24 * n)
    arrays += struct.pack("<Q", n) + dssp.encode()
    return header + struct.pack("<Q", len(chains)) + records + arrays


def test_structure_db_reader_and_its_errors(tmp_path):
    from tasks.protein import structure_db

    path = tmp_path / "structure_db.dat"
    data = structure_db_bytes([("1ABC", "A", "MKTAY", "CHHEC"), ("2XYZ", "B", "GG", "TS")])
    path.write_bytes(data)
    assert structure_db.read_structure_db(path) == [("1ABC", "A", "MKTAY", "CHHEC"), ("2XYZ", "B", "GG", "TS")]
    path.write_bytes(data[:-1])
    with pytest.raises(ValueError, match="truncated"):
        structure_db.read_structure_db(path)
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="not a ProMod3 structure database"):
        structure_db.read_structure_db(path)


def test_secondary_structure_default_reduces_dssp_to_q3(monkeypatch, tmp_path):
    path = tmp_path / "structure_db.dat"
    path.write_bytes(structure_db_bytes([("1ABC", "A", "MKTAYIAKQR" * 3, "HGIEBTSCCC" * 3), ("2XYZ", "B", "GG", "TS")]))
    monkeypatch.setattr(protein_data, "PROMOD3_PATH", path)
    protein_data.secondary_structure.cache_clear()
    try:
        [chain] = protein_data.secondary_structure("q3")  # the 2-residue chain is too short
        assert chain["id"] == "1ABC_A" and chain["label"] == "HHHEECCCCC" * 3
        assert protein_data.secondary_structure("q8")[0]["label"] == "HGIEBTSCCC" * 3
        monkeypatch.setattr(protein_data, "PROMOD3_PATH", tmp_path / "missing.dat")
        protein_data.secondary_structure.cache_clear()
        with pytest.raises(UserError, match="install the Debian package promod3-data"):
            protein_data.secondary_structure("q3")
    finally:
        protein_data.secondary_structure.cache_clear()


@pytest.mark.parametrize("num_classes", [2, 4])
def test_the_linear_probe_folds_the_standardization_into_the_layer(num_classes):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from core.training.transfer import linear_probe

    rng = np.random.default_rng(0)
    targets = rng.integers(0, num_classes, 300)
    # Features with a large shared offset and classes apart by little: the case that needs scaling.
    features = 5.0 + 0.05 * rng.normal(size=(300, 6)) + 0.02 * targets[:, None] * rng.normal(size=6)
    weights = np.ones(300)
    weights[:10] = 0  # rows without weight take no part
    kernel, bias, accuracy = linear_probe(features, targets, weights, num_classes + 1)  # one class absent
    reference = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)).fit(features[10:], targets[10:])
    logits = features @ kernel + bias
    probabilities = np.exp(logits - logits.max(1, keepdims=True))
    probabilities /= probabilities.sum(1, keepdims=True)
    np.testing.assert_allclose(probabilities[:, :num_classes], reference.predict_proba(features), atol=1e-6)
    assert probabilities[:, num_classes].max() < 1e-4 and accuracy == reference.score(features[10:], targets[10:])
