"""Recommendation: ordering, split, filters, exclusion, masking, metrics protocol, CLI round trip."""

import json

import numpy as np
import pytest
from helpers import apps, plain

from core.config import apply_overrides
from core.errors import UserError
from tasks.recsys import data
from tasks.recsys.sequential import MASK, PAD, Recommender, RecsysTask, tiny

FIXTURE = "tests/fixtures/interactions.csv"
COLUMNS = ["--set", "data.user_column=user", "--set", "data.item_column=item", "--set", "data.time_column=time"]


def log_of(rows, source="hand"):
    users, items, times = (np.asarray(c) for c in zip(*rows))
    return data.Log(users, items, times.astype(float), np.full(len(rows), np.nan), source)


def test_stable_tie_break_and_duplicates():
    # u1 has three items at time 5 (kept in log order), one duplicate row, one earlier item.
    log = log_of([("u1", "b", 5), ("u1", "a", 5), ("u1", "b", 5), ("u1", "z", 1), ("u1", "c", 5), ("u2", "x", 1)])
    sequences = data.build_sequences(log)
    assert sequences.by_user == {"u1": ["z", "b", "a", "c"]}
    assert sequences.dropped == {"duplicate_rows": 1, "users_under_3_interactions": 1}


def test_leave_one_out_by_hand():
    sequences = {"u": ["a", "b", "c", "d", "e"]}
    assert data.leave_one_out(sequences, "train") == [{"user": "u", "history": ["a", "b", "c"], "target": None}]
    assert data.leave_one_out(sequences, "valid") == [{"user": "u", "history": ["a", "b", "c"], "target": "d"}]
    assert data.leave_one_out(sequences, "test") == [{"user": "u", "history": ["a", "b", "c", "d"], "target": "e"}]


def test_k_core_and_min_rating():
    rows = [("u1", "a", 1), ("u1", "b", 2), ("u1", "c", 3), ("u2", "a", 1), ("u2", "b", 2), ("u2", "d", 3)]
    log = log_of(rows)
    with pytest.raises(UserError, match="no user has 3"):
        data.build_sequences(log, k_core=2)  # c and d appear once: both users fall to 2 items
    log.ratings = np.array([5, 5, 5, 1, 5, 5], float)
    assert data.build_sequences(log, min_rating=4).by_user == {"u1": ["a", "b", "c"]}


def test_non_numeric_timestamps_are_named(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("user_id,item_id,timestamp\n1,2,100\n1,3,yesterday\n")
    with pytest.raises(UserError, match="first at data row 2 .'yesterday'"):
        data.load_log(str(path))


def test_missing_columns_are_listed(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("who,what,when\n1,2,3\n")
    with pytest.raises(UserError, match="no column 'user_id', 'item_id', 'timestamp'; its columns are who, what, when"):
        data.load_log(str(path))


def test_movielens_100k_is_embedded():
    sequences = data.build_sequences(data.load_log(None))
    assert len(sequences.by_user) == 943 and sum(map(len, sequences.by_user.values())) == 100_000


@pytest.fixture(scope="module")
def featurized():
    task = RecsysTask(config=tiny(), data="synthetic")
    train = task.examples("train")
    featurizer = task.fit_featurizer(train)
    return task, featurizer, task.featurize_train(featurizer, train), featurizer(task.examples("test"))


def test_sasrec_windows_predict_the_next_item(featurized):
    _, featurizer, train, _ = featurized
    inputs, targets, mask = train["inputs"], train["targets"], train["mask"]
    # Within a window, each target is the next input: the shift by one of SASRec.
    np.testing.assert_array_equal(targets[:, :-1][mask[:, 1:]], inputs[:, 1:][mask[:, 1:]])
    assert (inputs[~mask] == PAD).all() and (inputs[mask] >= 2).all()


def test_ranking_rows_exclude_seen_items(featurized):
    task, featurizer, _, test = featurized
    example = task.examples("test")[0]
    seen = set(test["seen"][0][test["seen"][0] != PAD])
    assert seen == {featurizer.index[i] for i in example["history"]}
    assert test["targets"][0] == featurizer.index[example["target"]]


def test_bert4rec_masking_never_touches_padding(featurized):
    _, featurizer, _, _ = featurized
    task = RecsysTask(
        config=apply_overrides(tiny(), ["data.model_type=bert4rec", "model.causal=False", "data.mask_ratio=0.5"]),
        data="synthetic",
    )
    batch = featurizer.__class__(
        featurizer.items, {}, featurizer.popularity, featurizer.sequences, featurizer.max_len, task.config.data
    ).training(task.examples("train"))
    masked = task.augment(batch, np.random.default_rng(0), featurizer)
    chosen = masked["target_mask"]
    assert not chosen[~batch["mask"]].any() and chosen.any(1).all()
    assert (masked["inputs"][chosen] == MASK).all()
    np.testing.assert_array_equal(masked["inputs"][~chosen], batch["inputs"][~chosen])


def test_cli_round_trip(tmp_path):
    workdir = tmp_path / "run"
    result = apps(
        "train",
        "recsys",
        "--preset",
        "tiny",
        "--data",
        FIXTURE,
        "--workdir",
        workdir,
        *COLUMNS,
        "--set",
        "train.steps=30",
    )
    assert result.exit_code == 0, result.output
    result = apps("eval", "recsys", "--workdir", workdir, "--data", FIXTURE)
    assert result.exit_code == 0, result.output
    report = json.loads((workdir / "eval_test.json").read_text())
    assert "full ranking" in report["protocol"] and "seen items excluded" in report["protocol"]
    assert {"hr@10", "ndcg@10", "mrr@10"} <= set(report) and "most_popular" in report["baselines"]
    result = apps("predict", "recsys", "--workdir", workdir, "--history", "i3,i4,nosuch")
    assert result.exit_code == 0 and "i5" in result.output, result.output
    result = apps("predict", "recsys", "--workdir", workdir, "--user", "u7", "--format", "json")
    assert result.exit_code == 0, result.output
    # Typed values: ranks as ints from 1, scores as floats, best first.
    rows = json.loads(result.stdout)
    assert [row["rank"] for row in rows] == list(range(1, len(rows) + 1)) and len(rows) > 1
    assert all(type(row["score"]) is float for row in rows)
    assert [row["score"] for row in rows] == sorted((row["score"] for row in rows), reverse=True)
    recommendations = Recommender(workdir).recommend(["i3", "i4"], k=3)
    assert len(recommendations) == 3 and all(r["item"] not in ("i3", "i4") for r in recommendations)
    assert all(type(r["score"]) is float for r in recommendations)
    for args, message in [
        (["--history", ","], "A history is empty"),
        (["--size", "3"], "does not take --size; its options: --user, --history"),
        (["--user", "ghost"], "Unknown user 'ghost'"),
    ]:
        result = apps("predict", "recsys", "--workdir", workdir, *args)
        assert result.exit_code == 1 and message in result.output, result.output


def test_sampled_ranking_candidates_are_unseen_negatives(featurized):
    task, featurizer, _, _ = featurized
    options = apply_overrides(tiny(), ["data.ranking=sampled", "data.candidates=10", "data.sampling=popularity"]).data
    sampled = featurizer.__class__(
        featurizer.items, {}, featurizer.popularity, featurizer.sequences, featurizer.max_len, options
    )(task.examples("test"))
    candidates, seen = sampled["candidates"], sampled["seen"]
    np.testing.assert_array_equal(candidates[:, 0], sampled["targets"])
    for row in range(len(candidates)):
        negatives = set(candidates[row, 1:])
        assert len(negatives) == 10 and not negatives & set(seen[row]) and sampled["targets"][row] not in negatives


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.steps=40", "data.loss=bce", "data.negatives=3"],
        ["train.steps=40", "data.tie_embeddings=False"],
        # Cloze training sees a fraction of the positions per step: it needs more steps.
        ["train.steps=150", "data.model_type=bert4rec", "model.causal=False", "data.mask_ratio=0.3"],
    ],
)
def test_variants_learn(tmp_path, overrides):
    from core import run

    run.train(RecsysTask, workdir=tmp_path, preset="tiny", overrides=overrides, data="synthetic")
    result = run.evaluate(RecsysTask, tmp_path, split="test", data="synthetic")
    assert result["ndcg@10"] > result["baselines"]["most_popular"]["ndcg@10"]


def test_model_type_must_match_attention():
    with pytest.raises(UserError, match="bert4rec needs model.causal=False"):
        RecsysTask(config=apply_overrides(tiny(), ["data.model_type=bert4rec"]))


def test_more_candidates_than_unseen_items_is_refused(tmp_path):
    # The synthetic catalogue has 30 items: 1,000 unseen negatives per user cannot exist.
    args = ["train", "recsys", "--preset", "tiny", "--data", "synthetic", "--workdir", tmp_path]
    result = apps(*args, "--set", "data.ranking=sampled", "--set", "data.candidates=1000")
    assert result.exit_code == 1, result.output
    assert "data.candidates=1000, but a user has only" in plain(result.output)
    assert "lower data.candidates to at most" in plain(result.output)
