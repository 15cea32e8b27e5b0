"""Bad input to the CLI is refused before Prefect or Ray start, naming the option and the fix."""

import pytest

from flows.cli import build_parser, main


@pytest.mark.parametrize("argv, message", [
    (["distill", "--run-id", "../evil"], "invalid --run-id '../evil'"),
    (["distill", "--recipe", "missing.toml"], "--recipe missing.toml does not exist"),
    (["distill", "--rollouts", "0"], "--rollouts must be >= 1"),
])
def test_bad_options_are_refused_with_the_option_named(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_an_invalid_recipe_names_the_option(tmp_path):
    recipe = tmp_path / "bad.toml"
    recipe.write_text('[model]\nteacher = "builtin:digits"\n[dmd2]\nteacher_guidance_scale = 0.5\n')
    with pytest.raises(SystemExit, match=r"\[dmd2\] teacher_guidance_scale must be >= 1"):
        main(["distill", "--recipe", str(recipe)])


def test_every_command_has_help(capsys):
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == {"run", "distill", "evaluate", "serve", "pretrain", "sample", "table"}
    for name in commands:
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        assert "usage: dmd2 " + name in capsys.readouterr().out
