"""The `apps` CLI through Typer's runner: help, overrides, every bad input, and a real round trip."""

import json
import re
from pathlib import Path

import pytest
from helpers import apps, plain, table_rows

import tasks
from core import run
from core.errors import UserError
from tasks.nlp.sentiment import SentimentTask

FIXTURE = "tests/fixtures/reviews.csv"
COLUMNS = ["--set", "data.text_column=review", "--set", "data.label_column=stars"]
# The `trained` run's command, less its workdir and data: resuming needs the same options.
TRAIN = ["train", "sentiment", "--preset", "tiny", *COLUMNS, "--set", "train.steps=40", "--set", "train.eval_every=20"]


def test_help_lists_commands():
    result = apps("--help")
    assert result.exit_code == 0
    for command in ("tasks", "train", "eval", "predict", "bench"):
        assert command in result.output


COMMANDS = [["tasks"], ["train"], ["seeds"], ["eval"], ["predict"], ["embed"], ["serve"], ["report"], ["bench"]]
BENCHES = ["train", "decode", "finetune", "transcribe", "serve", "translate", "summarize"]


@pytest.mark.parametrize("command", [[], *COMMANDS, *(["bench", name] for name in BENCHES)], ids=" ".join)
def test_help_reads_at_80_columns(command):
    """Every command's help fits 80 columns whole: no line wider, no text cut short with an ellipsis."""
    result = apps(*command, "--help", env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert max(map(len, result.output.splitlines())) <= 80 and "…" not in result.output, result.output


def test_bench_is_a_group_whose_subcommands_name_their_choices():
    result = apps("bench", "--help", env={"COLUMNS": "80"})
    assert all(name in result.output for name in BENCHES)
    for args, message in [
        (["train", "huge"], "Unknown train config huge; choose from small, big."),
        (["train", "--steps", "0"], "--steps 0: time at least 1 step."),
        (["decode", "tiny"], "Unknown decode model tiny; choose from small, gpt2."),
        (["decode", "small", "--model", "x.gguf"], "give shapes of random weights or --model, not both"),
        (["serve", "--clients", "1,x"], "--clients '1,x': expected counts separated by commas"),
        (["serve", "--dtype", "float16"], "--dtype float16: expected float32, bfloat16, int8 or int4"),
        (["serve", "--seconds", "0"], "seconds must be positive, slots at least 2"),
    ]:
        result = apps("bench", *args)
        assert result.exit_code == 1 and message in plain(result.output), (args, result.output)
    # One benchmark a subcommand: the serve benchmark's options are not the train step's.
    assert apps("bench", "train", "--clients", "4").exit_code == 2


def test_every_option_is_named_by_its_flag_whatever_typers_version():
    """Typer 0.27 named an option by its metavar where the two matched ("--SPLIT" for `split`
    with metavar SPLIT): an option whose metavar spells its name gives its flag itself."""
    import typer.main
    from typer.models import OptionInfo

    from cli import app

    def callbacks(typer_app):
        yield from (command.callback for command in typer_app.registered_commands)
        for group in typer_app.registered_groups:
            yield from callbacks(group.typer_instance)

    checked = 0
    for callback in callbacks(app):
        for name, meta in typer.main.get_params_from_function(callback).items():
            info = meta.default
            if isinstance(info, OptionInfo) and (info.metavar or "").lower() == name.replace("_", "-"):
                checked += 1
                assert info.param_decls, f"{callback.__name__}: give {name}'s flag (--{name.replace('_', '-')})"
    assert checked >= 3  # --split, --host, --port at least


def test_tasks_lists_every_registered_task_for_programs_and_at_80_columns(tmp_path):
    result = apps("tasks", "--format", "json", "--output", tmp_path / "tasks.json")
    assert result.exit_code == 0, result.output
    listed = json.loads((tmp_path / "tasks.json").read_text())["Tasks (* the default preset)"]
    assert [row["task"] for row in listed] == sorted(tasks.REGISTRY)
    for row in listed:
        task = tasks.get(row["task"])
        assert [row["what"], row["default data"], row["model"], row["metrics"]] == [
            task.summary,
            task.default_data,
            task.model_summary,
            ", ".join(task.metric_names),
        ]
        assert row["presets"].split(", ") == [f"{p}*" if p == task.default_preset else p for p in task.presets]
    narrow = apps("tasks", env={"COLUMNS": "80"})
    assert narrow.exit_code == 0 and max(map(len, narrow.output.splitlines())) <= 80
    listing = narrow.output.split("apps predict TASK options")[0]
    firsts = [line.split("│")[1].strip() for line in listing.splitlines() if line.startswith("│")]
    assert [first for first in firsts if first] == sorted(tasks.REGISTRY)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cli") / "run"
    result = apps(*TRAIN, "--workdir", workdir, "--data", FIXTURE)
    assert result.exit_code == 0, result.output
    return workdir


def test_overrides_reach_the_saved_config(trained):
    config = json.loads((trained / "config.json").read_text())
    assert config["train"]["steps"] == 40 and config["data"]["text_column"] == "review"


def test_eval_writes_metrics_protocol_and_baseline(trained):
    result = apps("eval", "sentiment", "--workdir", trained, "--split", "test", "--data", FIXTURE)
    assert result.exit_code == 0, result.output
    report = json.loads((trained / "eval_test.json").read_text())
    assert report["split"] == "test" and report["dataset"] == FIXTURE
    assert "stratified" in report["protocol"] and "macro_f1" in report["baselines"]["tfidf_logreg"]
    assert "tfidf_logreg" in result.output
    # The scores are those of the run's own predictions on the test split, counted here by hand.
    predictor = run.Predictor(SentimentTask, trained, data=FIXTURE)
    examples = predictor.task.examples("test")
    assert report["examples"] == len(examples)
    truth = [e["label"] for e in examples]
    predicted = [row["label"] for row in predictor.predict([e["text"] for e in examples])]
    f1 = []
    for label in sorted(set(truth)):
        hits = sum(t == p == label for t, p in zip(truth, predicted))
        f1.append(2 * hits / (truth.count(label) + predicted.count(label)))
    assert report["macro_f1"] == pytest.approx(sum(f1) / len(f1))
    assert report["accuracy"] == pytest.approx(sum(t == p for t, p in zip(truth, predicted)) / len(truth))
    # 40 steps learn the fixture's cue words: far above chance (0.5 for two balanced classes).
    assert report["macro_f1"] > 0.75


def test_predict_from_arguments_and_stdin(trained):
    texts = ["lovely soft perfect dress", "cheap scratchy top", "lovely fit"]
    rows = run.predict(SentimentTask, trained, texts)
    # The table rounds the probability for people (4 decimals); the rows hold the float.
    expected = [[row["text"], row["label"], f"{row['probability']:.4f}"] for row in rows]
    assert [row[1] for row in expected] == ["positive", "negative", "positive"]  # the fixture's cues, learned
    result = apps("predict", "sentiment", "--workdir", trained, texts[0])
    assert result.exit_code == 0 and table_rows(result.output) == expected[:1], result.output
    result = apps("predict", "sentiment", "--workdir", trained, input="\n".join(texts[1:]) + "\n")
    assert result.exit_code == 0 and table_rows(result.output) == expected[1:], result.output


def test_predictions_are_typed_values_written_in_full(trained, tmp_path):
    """Python and --format json, jsonl and csv give the same values: the probability a float at
    full precision (the softmax's largest, its row summing to 1); only the table rounds it."""
    import csv

    texts = ["lovely soft perfect dress", "cheap scratchy top"]
    predictor = run.Predictor(SentimentTask, trained)
    rows = predictor.predict(texts)
    _, outputs = predictor.outputs(texts)
    assert [type(row["probability"]) for row in rows] == [float, float]
    assert [row["probability"] for row in rows] == [float(p.max()) for p in outputs["probabilities"]]
    assert all(abs(float(p.sum()) - 1) < 1e-6 and p.max() >= 0.5 for p in outputs["probabilities"])
    assert tasks.pipeline("sentiment", workdir=trained).predict(texts) == rows
    result = apps("predict", "sentiment", "--workdir", trained, "--format", "json", *texts)
    assert result.exit_code == 0 and json.loads(result.stdout) == rows, result.output
    result = apps("predict", "sentiment", "--workdir", trained, "--format", "jsonl", *texts)
    assert [json.loads(line) for line in result.stdout.splitlines()] == rows
    result = apps("predict", "sentiment", "--workdir", trained, "--format", "csv", *texts)
    read = list(csv.DictReader(result.stdout.splitlines()))
    assert [float(row["probability"]) for row in read] == [row["probability"] for row in rows]


def test_predict_options_are_checked_in_one_place(trained):
    """Python, HTTP and the command line share `core.options.predict_option_values`: an unknown
    option or a value of another type is named, before the run loads."""
    from core.options import PredictOptionError, predict_option_values

    lm = tasks.get("lm")
    assert predict_option_values(lm, {"--max-new-tokens": "5", "--chat": "yes"}, command_line=True)["chat"] is True
    assert predict_option_values(lm, {"temperature": 1})["temperature"] == 1.0
    for given, command_line, message, name in [
        ({"temp": 1.0}, False, "lm predictions take no temp; the options are max_new_tokens", "temp"),
        ({"top_k": 2.5}, False, "top_k: expected int, got 2.5.", "top_k"),
        ({"chat": 1}, False, "chat: expected bool, got 1.", "chat"),
        ({"--top-k": "many"}, True, "--top-k 'many': expected int.", "top_k"),
        ({"--chat": "maybe"}, True, "--chat 'maybe': a switch takes no value", "chat"),
        ({"--size": "3"}, True, "apps predict lm does not take --size; its options: --max-new-tokens", "size"),
    ]:
        with pytest.raises(PredictOptionError, match=re.escape(message)) as raised:
            predict_option_values(lm, given, command_line=command_line)
        assert raised.value.name == name and raised.value.detail
    with pytest.raises(UserError, match="sentiment predictions take no beams; the options are none"):
        run.Predictor(SentimentTask, trained).predict(["fine"], beams=2)


@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "nosuch"], "Unknown task 'nosuch'"),
        (["train", "sentiment", "--preset", "huge"], "Unknown preset 'huge'"),
        (["train", "sentiment", "--set", "model.width=3"], "unknown key 'width'"),
        (["train", "sentiment", "--data", "missing.csv"], "missing.csv: no such file"),
        (["train", "sentiment", "--data", FIXTURE], "has no column 'text', 'label'"),
        (
            [
                "train",
                "sentiment",
                "--data",
                FIXTURE,
                *COLUMNS,
                "--set",
                "data.labels=binary",
                "--set",
                "data.label_column=review",
            ],
            "expects 1-5 ratings",
        ),
        (["eval", "sentiment", "--split", "dev"], "expected valid or test"),
    ],
)
def test_bad_input_is_a_clear_error(args, message, tmp_path):
    result = apps(*args, "--workdir", tmp_path / "run")
    assert result.exit_code == 1 and message in plain(result.output), result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.num_heads=3", "model.num_heads=3 must divide model.d_model=32"),
        ("train.log_every=0", "train.log_every=0 must be positive"),
        ("train.eval_every=0", "train.eval_every=0 must be positive"),
        ("train.grad_accum=0", "train.grad_accum=0 must be positive"),
        ("train.steps=-5", "train.steps=-5 must be positive"),
        ("train.batch_size=12", "train.batch_size=12 must be a positive multiple of 8"),
        ("model.dropout=1.0", "model.dropout=1.0 must be in [0, 1)"),
        ("optim.learning_rate=1e999", "optim.learning_rate=inf must be a positive finite number"),
        ("model.attention=cudnn", 'needs train.compute_dtype="bfloat16"'),
    ],
)
def test_config_mistakes_are_named_before_any_work(override, message, tmp_path):
    result = apps(
        "train", "sentiment", "--preset", "tiny", "--data", "synthetic", "--set", override, "--workdir", tmp_path
    )
    assert result.exit_code == 1 and message in plain(result.output), result.output
    assert "Traceback" not in result.output and not (tmp_path / "featurizer").exists()


def test_data_and_workdir_mistakes(tmp_path):
    one_class = tmp_path / "one.csv"
    one_class.write_text("text,label\nlovely,5\ngreat,4\nperfect,5\n")
    a_file = tmp_path / "taken"
    a_file.write_text("not a folder")
    cases = [
        (["--data", one_class, "--workdir", tmp_path / "run"], "has one class only ('positive'"),
        (["--data", tmp_path, "--workdir", tmp_path / "run"], f"--data {tmp_path} is a folder"),
        (["--data", "synthetic", "--workdir", a_file], f"--workdir {a_file} is a file, not a folder"),
    ]
    for args, message in cases:
        result = apps("train", "sentiment", "--preset", "tiny", *args)
        assert result.exit_code == 1 and message in plain(result.output), result.output


@pytest.mark.parametrize(
    "damage,message",
    [
        (("config.json", b'{"task": "sentiment", "model": {'), "config.json is not valid JSON"),
        (("config.json", b'["sentiment"]'), "config.json is not a run's configuration"),
        (("config.json", b'{"task": "recsys"}'), "holds a recsys run, not sentiment"),
        (("featurizer/classes.json", b'["neg'), "The featurizer in"),
        (("featurizer", None), "the run's featurizer is gone"),
    ],
)
def test_a_damaged_workdir_file_is_named_with_what_to_do(trained, tmp_path, damage, message):
    """A file of the run that a crash or a hand edit damaged: eval and predict name it."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    name, content = damage
    if content is None:
        shutil.rmtree(copy / name)
    else:
        (copy / name).write_bytes(content)
    for command in (["eval", "sentiment", "--data", FIXTURE], ["predict", "sentiment", "lovely"]):
        result = apps(*command, "--workdir", copy)
        assert result.exit_code == 1 and message in plain(result.output), result.output
        assert "Traceback" not in result.output


def test_a_damaged_best_json_stops_a_resumed_run_with_its_name(trained, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    (copy / "best.json").write_text('{"step": 20, "value": ')
    result = apps(*TRAIN, "--workdir", copy, "--data", FIXTURE)
    assert result.exit_code == 1 and "best.json is not valid JSON" in plain(result.output), result.output


def test_a_run_is_scored_on_the_data_it_was_trained_on(trained, tmp_path, apps_log):
    """Without --data, eval reads the file the run was trained on and names it; a file that
    changed since is named in a warning, one that vanished in an error; resuming on other data
    is refused. --data still overrides."""
    import shutil

    result = apps("eval", "sentiment", "--workdir", trained, env={"COLUMNS": "1000"})
    assert result.exit_code == 0 and str(Path(FIXTURE).resolve()) in plain(result.output), result.output

    copy, table = tmp_path / "run", tmp_path / "reviews.csv"
    shutil.copytree(trained, copy)
    shutil.copy(FIXTURE, table)
    record = json.loads((copy / "data.json").read_text())
    stat = table.stat()
    (copy / "data.json").write_text(json.dumps({**record, "data": str(table), "modified": stat.st_mtime}))
    table.write_text(table.read_text() + "an extra lovely review,5\n")
    assert apps("predict", "sentiment", "--workdir", copy, "lovely").exit_code == 0
    assert f"{table} changed since {copy} was trained on it" in apps_log.text
    table.unlink()
    result = apps("predict", "sentiment", "--workdir", copy, "lovely")
    assert result.exit_code == 1 and f"was trained on {table}, which is gone" in plain(result.output)
    result = apps("eval", "sentiment", "--workdir", copy, "--data", FIXTURE)
    assert result.exit_code == 0, result.output
    result = apps(*TRAIN, "--workdir", trained, "--data", "synthetic")
    assert result.exit_code == 1 and f"holds a run trained on {Path(FIXTURE).resolve()}" in plain(result.output)


def test_predict_and_eval_write_every_field_in_full_for_a_program(trained, tmp_path):
    """--format jsonl / csv / json, to stdout or --output: each input whole (a table would cut
    it at the terminal's width), and eval's JSON is the report it writes into the workdir."""
    import csv

    long = "lovely " * 40 + "flattering " + "x" * 200
    result = apps(
        "predict", "sentiment", "--workdir", trained, "--format", "jsonl", long, "awful", env={"COLUMNS": "60"}
    )
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["text"] for row in rows] == [long, "awful"] and all("label" in row for row in rows)
    result = apps("predict", "sentiment", "--workdir", trained, "--format", "csv", "--output", tmp_path / "p.csv", long)
    assert result.exit_code == 0, result.output
    with open(tmp_path / "p.csv", newline="") as file:
        [row] = list(csv.DictReader(file))
    assert row["text"] == long and row["label"] == rows[0]["label"]
    result = apps("eval", "sentiment", "--workdir", trained, "--split", "test", "--format", "json")
    assert result.exit_code == 0, result.output
    full = json.loads(result.stdout)
    assert full == json.loads((trained / "eval_test.json").read_text()) and full["baselines"]
    result = apps("eval", "sentiment", "--workdir", trained, "--split", "test", "--format", "json", "--no-baselines")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {name: value for name, value in full.items() if name != "baselines"}
    result = apps("eval", "sentiment", "--workdir", trained, "--format", "yaml")
    assert result.exit_code == 1 and "--format 'yaml': expected one of table, json, jsonl, csv" in plain(result.output)


def test_eval_and_predict_without_a_run(tmp_path):
    for command in (["eval", "sentiment"], ["predict", "sentiment", "text"]):
        result = apps(*command, "--workdir", tmp_path)
        assert result.exit_code == 1 and "holds no trained run" in plain(result.output)


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("threes.csv", b"text,label\nok fine,3\nso so,3\n", "No examples are left"),
        ("latin1.csv", "text,label\ngood,5\nd\xe9cevant,1\n".encode("latin-1"), "line 3: not valid UTF-8"),
        ("bad.jsonl", b'{"text": "good", "label": 5}\n{"text": oops}\n', "line 2: not valid JSON"),
        ("inf.csv", b"text,label\ngood,5\nbad,1\nodd,inf\n", "row 3: the label inf in column 'label'"),
        ("empty.csv", b"", "is empty: no header and no rows"),
        ("header.csv", b"text,label\n", "has a header line and no rows"),
        ("corrupt.parquet", b"PAR1 not really a parquet file", "not a readable parquet file"),
    ],
)
def test_bad_data_file_is_named(tmp_path, name, content, message, caplog):
    """Each in one paragraph that names the file, with none of `datasets`' own log lines."""
    path = tmp_path / name
    path.write_bytes(content)
    result = apps("train", "sentiment", "--data", path, "--workdir", tmp_path / "run")
    assert result.exit_code == 1 and message in plain(result.output), result.output
    assert str(path) in plain(result.output)
    assert not [record for record in caplog.records if record.name.startswith("datasets")]


def test_empty_predict_input(trained):
    result = apps("predict", "sentiment", "--workdir", trained, input="\n  \n")
    assert result.exit_code == 1 and "at least one non-empty text" in plain(result.output)


def test_binary_labels_take_ratings_or_a_zero_one_column():
    """Under the default data.labels=binary, 1-5 ratings split at 3 (dropped), and a column of
    0/1 labels reads as negative/positive rather than as two low ratings; anything else is
    named."""
    from core.errors import UserError
    from tasks.nlp.sentiment import SentimentTask, tiny

    task = SentimentTask(config=tiny(), data="synthetic")
    zero_one = task._map_labels({"text": ["a", "b", "c"], "label": ["0", "1", "1.0"]})
    assert zero_one["label"] == ["negative", "positive", "positive"]
    ratings = task._map_labels({"text": list("abcde"), "label": [1, 2, 3, 4, 5]})
    assert ratings == {"text": list("abde"), "label": ["negative", "negative", "positive", "positive"]}
    with pytest.raises(UserError, match="expects 1-5 ratings or 0/1 labels in the label column, found 7"):
        task._map_labels({"text": ["a", "b"], "label": [1, 7]})
