"""Bad input to the CLI is refused before Prefect or Ray start, naming the option and the fix."""

import re

import pytest

from flows.cli import build_parser, main


def refusal(argv: list[str], capsys) -> str:
    """The CLI's error message for `argv`; it must exit non-zero (argparse's 2, or main's 2)."""
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code if isinstance(exit_info.code, int) else 2
        message = "" if isinstance(exit_info.code, int) else str(exit_info.code)
    else:
        message = ""
    assert code == 2
    return message + capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["distill", "--run-id", "../evil"], "invalid --run-id '../evil'"),
    (["distill", "--recipe", "missing.toml"], "--recipe missing.toml does not exist"),
    (["distill", "--rollouts", "0"], "--rollouts must be >= 1"),
    (["distill", "--set", "train.rollouts=many"], r"\[train\] rollouts: expected int, got 'many'"),
    (["distill", "--set", "train.rolouts=5"], r"\[train\] has no option 'rolouts'"),
    (["distill", "--set", "rollouts"], "write SECTION.KEY=VALUE"),
    (["distill", "--set", "model.family=video"], r"\[model\] family = 'video' is not a model family"),
    (["distill", "--output-dir", "artifacts/out"], "--output-dir artifacts/out and --store .* overlap"),
    (["evaluate", "--student", "no/such/student"], "--student no/such/student is not a directory"),
])
def test_bad_options_are_refused_with_the_option_named(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert re.search(message, refusal(argv, capsys))
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "artifacts").exists()


def test_an_invalid_recipe_names_the_option(tmp_path, capsys):
    recipe = tmp_path / "bad.toml"
    recipe.write_text('[model]\nteacher = "builtin:digits"\n[dmd2]\nteacher_guidance_scale = 0.5\n')
    assert "[dmd2] teacher_guidance_scale must be >= 1" in refusal(["distill", "--recipe", str(recipe)], capsys)


def test_a_malformed_recipe_names_the_file(tmp_path, capsys):
    recipe = tmp_path / "broken.toml"
    recipe.write_text("[model\nteacher = 1\n")
    assert f"{recipe} is not valid TOML" in refusal(["distill", "--recipe", str(recipe)], capsys)


def test_a_teacher_of_no_family_is_refused(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    assert "no model family recognises [model] teacher" in refusal(
        ["distill", "--set", f"model.teacher={tmp_path / 'model'}"], capsys)


def test_every_command_has_help_that_mentions_set(capsys):
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == {"run", "distill", "evaluate", "serve", "plan", "pretrain", "sample", "table",
                             "text-table"}
    for name in commands:
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert "usage: dmd2 " + name in out and "--set" in out, name


def test_ctrl_c_ends_the_cli_with_one_line_and_the_shells_code_for_sigint(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt  # what Python makes of SIGINT in whatever call the command is waiting in

    monkeypatch.setattr("flows.cli.cmd_plan", interrupted)
    try:
        code = main(["plan", "--gpu-memory", "80"])
    except KeyboardInterrupt:  # escaping, it would stop pytest's whole session instead of failing this test
        pytest.fail("KeyboardInterrupt escaped the CLI")
    assert code == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "resumes it from the last" in err and "Traceback" not in err
