"""Options declared once: config keys derived from the commands' own declarations, the
project config applied as Click's default_map, and option objects keeping their defaults."""

from __future__ import annotations

import csv
import io
import json
import typing
from collections.abc import Callable
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from hookcli.cli import app
from hookcli.cli.params import config_keys, registered
from hookcli.options import DEFAULTS, RuleOptions, pick
from tests.support.cli import assert_one_line_error, run
from tests.support.paths import CAT, ROOT

runner = CliRunner()
NET = ROOT / "examples" / "tiny" / "net.py"


def _long_options(function: Callable[..., None]) -> set[str]:
    hints = typing.get_type_hints(function, include_extras=True)
    names = set()
    for hint in hints.values():
        for info in typing.get_args(hint)[1:]:
            if isinstance(info, typer.models.OptionInfo):
                decls = [info.default, *(info.param_decls or ())]
                names |= {d[2:] for d in decls if isinstance(d, str) and d.startswith("--")}
    return names


def test_every_long_option_of_a_config_command_is_a_config_key() -> None:
    keys = config_keys("inspect")
    commands = [f for f, _ in registered().values() if "config" in _long_options(f)]
    assert {f.__name__ for f in commands} == {
        "layers", "inspect", "grads", "check", "diff", "maps", "cam", "attn", "lens", "calib",
    }  # fmt: skip
    for command in commands:
        missing = _long_options(command) - {"config", "no-config"} - set(keys)
        assert not missing, (command, missing)
    assert keys["image"].param == "image_index"  # --image feeds MapOptions.image_index
    assert keys["input"].param == "input_spec" and keys["input"].kind == "list"
    assert keys["output"].kind == "path" and keys["tol"].kind == "float"


def test_a_choice_is_checked_against_the_running_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "hookcli.toml").write_text(
        f'model = "{NET}:Net"\ninput = "ones:2x2"\nformat = "csv"\n'
    )
    monkeypatch.chdir(tmp_path)
    ran = runner.invoke(app, ["inspect"])
    assert ran.exit_code == 0, ran.stderr
    header = next(csv.reader(io.StringIO(ran.stdout)))
    assert "layer" in header  # csv: inspect's --format admits it
    listed = runner.invoke(app, ["layers"])
    assert listed.exit_code == 2
    assert "hookcli.toml:3" in listed.stderr and "table, json" in listed.stderr
    assert runner.invoke(app, ["layers", "-f", "json"]).exit_code == 0  # the flag wins


def test_a_config_value_reaches_the_option_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "hookcli.toml").write_text(
        f'model = "{NET}:Net"\ninput = "ones:2x2"\n[check]\nmax-abs = 1e-9\n'
    )
    monkeypatch.chdir(tmp_path)
    failed = runner.invoke(app, ["check", "-f", "json"])
    assert failed.exit_code == 1, failed.stderr  # the config's bound, far below the outputs
    rules = {c["rule"] for c in json.loads(failed.stdout)["checks"] if not c["passed"]}
    assert rules == {"max-abs"}, rules
    assert runner.invoke(app, ["check", "--max-abs", "1e9"]).exit_code == 0


def test_pick_keeps_the_field_default_for_what_is_not_given() -> None:
    assert pick(RuleOptions, {}) == RuleOptions() == DEFAULTS.rules
    assert pick(RuleOptions, {"dead_frac": None, "tol": 5.0}) == RuleOptions()
    picked = pick(RuleOptions, {"fail_on": ["dead"], "rtol": 0.5}, atol=0.25)
    assert picked == RuleOptions(fail_on=("dead",), rtol=0.5, atol=0.25)


# ------------------------------------------------- found by a sweep of bad inputs (stop 70)


def test_a_model_arg_torch_cannot_take_is_one_line_without_a_cpp_stack() -> None:
    """An integer past 64 bits reaches torch's C++, whose error carries its stack in the
    quoted message (escaped newlines): cut off, one line."""
    res = run(
        "inspect", "tests/support/models.py:Wide", "--input", "randn:2x3",
        "--model-arg", "width=99999999999999999999999",
    )  # fmt: skip
    assert_one_line_error(res, 2, "Overflow when unpacking long long", "--model-arg")
    assert "frame #" not in res.stderr and "Exception raised from" not in res.stderr


def test_a_torchvision_builder_refusing_a_model_arg_value_is_exit_2() -> None:
    res = run("layers", "resnet18", "--model-arg", "num_classes=-3")
    assert_one_line_error(res, 2, "cannot build resnet18(num_classes=-3)", "negative dimension")


def test_per_image_is_range_checked_in_a_one_batch_run() -> None:
    res = run("inspect", "resnet18", str(CAT), "--per-image", "-1")
    assert_one_line_error(res, 2, "--per-image must be 0 or more")


def test_per_image_sets_each_images_predictions_in_a_one_batch_run() -> None:
    """--per-image K in a one-batch run: each image's top-K (it was accepted and ignored: each
    image got --topk's rows). Oracle: the same run with --topk K; refused beside another
    --topk."""
    from tests.support.paths import COFFEE

    two = ["inspect", "resnet18", str(CAT), str(COFFEE), "-l", "fc", "-f", "json"]
    per = json.loads(run(*two, "--per-image", "2").stdout)["predictions"]
    top = json.loads(run(*two, "--topk", "2").stdout)["predictions"]
    assert [(p["image"], p["index"]) for p in per] == [(p["image"], p["index"]) for p in top]
    assert sorted(p["image"] for p in per) == [0, 0, 1, 1]
    res = run(*two, "--per-image", "1", "--topk", "3")
    assert_one_line_error(res, 2, "--per-image 1 and --topk 3 ask for different numbers")


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["grads", "tests/support/models.py:NoClasses", "--input", "randn:2x2"],
         ["no classes (2x0)", "--target sum"]),
        (["grads", "tests/support/models.py:Wide", "--input", "randn:2x3", "--loss", "l1:bogus"],
         ["--loss target 'bogus'", "--loss mse:ones"]),
        (["inspect", "tests/support/models.py:Wide", "--input", "randn:2x3", "--output-key",
          "out["], ["--output-key 'out[' cannot be read from the model's output"]),
        (["inspect", "tests/support/models.py:Wide", "--input", "randn:2x3", "--input",
          "randn:2x3"], ["the inputs do not fit Wide.forward(x", "takes 2 positional"]),
        (["inspect", "tests/support/models.py:Wide", "--input", "foo=randn:2x3"],
         ["the inputs do not fit Wide.forward(x", "unexpected keyword argument 'foo'"]),
    ],
)  # fmt: skip
def test_a_hint_names_the_option_at_fault_and_a_possible_next_step(
    args: list[str], needles: list[str]
) -> None:
    res = run(*args)
    assert_one_line_error(res, 2, *needles)
    assert "from 0 to -1" not in res.stderr and "--input 'bogus'" not in res.stderr


def test_a_folder_or_a_pipe_given_as_a_file_is_called_what_it_is(tmp_path: Path) -> None:
    import os

    folder = tmp_path / "weights"
    folder.mkdir()
    model = ["inspect", "tests/support/models.py:Wide", "--input", "randn:2x3"]
    assert_one_line_error(run(*model, "--weights", str(folder)), 2, "is a folder")
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    assert_one_line_error(run(*model, "--weights", str(fifo)), 2, "is not a regular file")
    assert_one_line_error(run(*model, "--weights", str(tmp_path / "gone.pt")), 2, "not found")
