"""`report()` and `apps report` on hand-written metrics.jsonl and best.json files."""

import json
import logging
import re

import pytest
from helpers import apps, plain

from core.errors import UserError
from core.report import report


def train_record(step, loss):
    return {"step": step, "loss": loss, "grad_norm": 1.5, "examples_per_s": 100.0 + step, "tokens_per_s": 3200.0}


RECORDS = [
    train_record(1, 2.0),
    train_record(2, 1.5),
    {"step": 2, "valid_accuracy": 0.5, "valid_macro_f1": 0.25, "valid_loss": 1.25},
    train_record(3, 1.0),
    train_record(4, 0.75),
    {"step": 4, "valid_accuracy": 0.75, "valid_macro_f1": 0.5, "valid_loss": 1.0},
    train_record(5, 0.5),
    train_record(6, 0.25),
    {"step": 6, "valid_accuracy": 0.625, "valid_macro_f1": 0.375, "valid_loss": 1.125},
]


def write_run(workdir, records=RECORDS, best=(4, "accuracy", 0.75), extra_lines=()):
    workdir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(record, sort_keys=True) for record in records]
    for index, line in extra_lines:
        lines.insert(index, line)
    (workdir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if best is not None:
        step, metric, value = best
        (workdir / "best.json").write_text(json.dumps({"step": step, "metric": metric, "value": value}))
    return workdir


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > 0 and data.startswith(b"\x89PNG\r\n\x1a\n")


def test_report_returns_the_best_step_and_draws_the_curves(tmp_path):
    workdir = write_run(tmp_path / "run")
    result = report(workdir)
    assert result == {
        "best_step": 4,
        "metric": "accuracy",
        "value": 0.75,
        "metrics": {"accuracy": 0.75, "macro_f1": 0.5, "loss": 1.0},
        "picture": workdir / "curves.png",
    }
    assert_png(workdir / "curves.png")
    assert not (workdir / "curves.png.tmp").exists()


def test_without_best_json_the_last_validation_is_reported(tmp_path):
    workdir = write_run(tmp_path / "run", best=None)
    result = report(workdir)
    assert result["best_step"] == 6 and result["metric"] is None and result["value"] is None
    assert result["metrics"] == {"accuracy": 0.625, "macro_f1": 0.375, "loss": 1.125}
    assert_png(result["picture"])


def test_before_any_validation_the_loss_is_still_drawn(tmp_path):
    workdir = write_run(tmp_path / "run", records=RECORDS[:2], best=None)
    result = report(workdir)
    assert result["best_step"] is None and result["metrics"] == {}
    assert_png(result["picture"])


def test_a_resumed_run_keeps_the_later_record_of_a_step(tmp_path):
    # The run resumed from step 4 after logging step 6 once; the second step 6 is the one that counts.
    again = {"step": 6, "valid_accuracy": 0.875, "valid_macro_f1": 0.625, "valid_loss": 0.5}
    workdir = write_run(tmp_path / "run", records=[*RECORDS, again], best=(6, "accuracy", 0.875))
    assert report(workdir)["metrics"] == {"accuracy": 0.875, "macro_f1": 0.625, "loss": 0.5}


def test_malformed_lines_are_skipped_with_a_warning_naming_them(tmp_path, apps_log):
    # Line 4 is garbage in the middle; the last line is cut short as a killed run leaves it.
    workdir = write_run(tmp_path / "run", extra_lines=[(3, "{not json"), (10, '{"step": 7, "lo')])
    result = report(workdir)
    assert result["best_step"] == 4 and result["metrics"] == {"accuracy": 0.75, "macro_f1": 0.5, "loss": 1.0}
    warnings = [record.getMessage() for record in apps_log.records if record.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "metrics.jsonl line 4 is not a JSON record" in warnings[0]
    assert "line 11 (the last, cut short" in warnings[1]
    assert_png(result["picture"])


def test_best_json_pointing_past_the_log_keeps_its_value(tmp_path):
    workdir = write_run(tmp_path / "run", records=RECORDS[:5], best=(6, "accuracy", 0.875))
    result = report(workdir)
    assert result["best_step"] == 6 and result["metrics"] == {"accuracy": 0.875}


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda workdir: None, "holds no run (no metrics.jsonl): train one with `apps train TASK --workdir DIR`"),
        (lambda workdir: write_run(workdir, records=[], best=None), "metrics.jsonl is empty"),
        (
            lambda workdir: write_run(workdir, records=[], best=None, extra_lines=[(0, "oops"), (1, "[1]")]),
            "metrics.jsonl holds no usable record",
        ),
        (lambda workdir: (write_run(workdir), (workdir / "best.json").write_text("{}")), "best.json is not"),
    ],
    ids=["no workdir", "empty", "nothing usable", "bad best.json"],
)
def test_errors_name_the_path(tmp_path, setup, message):
    workdir = tmp_path / "run"
    setup(workdir)
    with pytest.raises(UserError) as error:
        report(workdir)
    assert message in str(error.value) and str(workdir) in str(error.value)


def test_cli_prints_the_best_step_and_the_picture(tmp_path):
    workdir = write_run(tmp_path / "run")
    result = apps("report", "--workdir", workdir)
    assert result.exit_code == 0, result.output
    output = plain(result.output)
    assert "best step 4, by accuracy" in output
    assert re.search(r"macro_f1 │ 0\.5000", output) and re.search(r"accuracy │ 0\.7500", output)
    assert f"Curves drawn in {workdir / 'curves.png'}" in output
    assert_png(workdir / "curves.png")


def test_cli_reports_a_missing_run(tmp_path):
    workdir = tmp_path / "nothing"
    result = apps("report", "-w", workdir)
    assert result.exit_code == 1
    assert f"{workdir} holds no run" in plain(result.output) and "Traceback" not in result.output


def test_cli_report_needs_a_workdir():
    result = apps("report")
    assert result.exit_code == 2 and "--workdir" in result.output
