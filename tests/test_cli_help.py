"""Short help per command, and one place that lists every setting.

Every subcommand's `--help` was ~180 lines: all the settings, repeated, even for `service status`,
which refuses them. Each command's help now shows the flags that command uses and points at
`--help-settings`, which lists every setting (its flag, variable and default); every setting is still
accepted as a flag wherever it was.
"""

from __future__ import annotations

import pytest

from provider import cli
from provider.config import FIELDS, Settings, env_name, flag_name

SETTING_FLAGS = [flag_name(f) for f in FIELDS if f != "auth_token"]
OWN_FLAGS = {
    (): ["--version", "--help-settings", "--config"],
    ("serve",): ["--local", "--help-settings", "--config"],
    ("doctor",): ["--json", "--no-coordinator", "--timeout", "--machine-gb", "--help-settings"],
    ("models",): ["--json", "--hash", "--model-dirs", "--model-aliases", "--hf-cache-dir", "--help-settings"],
    ("status",): ["--json", "--state-dir", "--local-port", "--help-settings"],
    ("runtime-hash",): ["--runtime-hash", "--help-settings"],
    ("service", "install"): ["--no-load", "--local", "--system", "--user", "--help-settings"],
    ("service", "uninstall"): ["--no-load", "--system"],
    ("service", "status"): ["--system"],
}
# Commands whose flags include every setting (the others refuse them).
SETTING_COMMANDS = [("serve",), ("doctor",), ("models",), ("status",), ("runtime-hash",), ("service", "install")]


def help_of(capsys, *words: str) -> str:
    with pytest.raises(SystemExit) as done:
        cli.build_parser().parse_args([*words, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("words", list(OWN_FLAGS), ids=lambda w: " ".join(w) or "top")
def test_each_command_help_is_short_and_names_its_own_flags(capsys, words):
    text = help_of(capsys, *words)
    assert len(text.splitlines()) <= 40, text
    for flag in OWN_FLAGS[words]:
        assert flag in text, (words, flag)
    shown = [f for f in SETTING_FLAGS if f" {f} " in f" {text} ".replace(",", " ").replace("\n", " ")]
    assert len(shown) <= 9, shown  # a handful of the settings this command is about, not all of them
    if words in SETTING_COMMANDS or words == ():
        assert "--help-settings" in text


@pytest.mark.parametrize("words", [("service", "uninstall"), ("service", "status")], ids=" ".join)
def test_service_status_and_uninstall_show_no_settings(capsys, words):
    text = help_of(capsys, *words)
    assert not [f for f in SETTING_FLAGS if f in text.split()]


def test_help_settings_lists_every_setting_with_its_variable_and_default(capsys):
    with pytest.raises(SystemExit) as done:
        cli.build_parser().parse_args(["--help-settings"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for field in FIELDS:
        assert env_name(field) in text, field
        info = Settings.model_fields[field]
        assert " ".join(str(info.description).split()[:4]) in " ".join(text.split()), field
    for flag in SETTING_FLAGS:
        assert flag in text.split(), flag
    assert "--auth-token" not in text  # a secret: environment or file only
    assert "deploy/README.md" in text
    with pytest.raises(SystemExit):  # also after a command
        cli.build_parser().parse_args(["serve", "--help-settings"])
    assert capsys.readouterr().out == text


@pytest.mark.parametrize("words", SETTING_COMMANDS, ids=" ".join)
def test_every_setting_is_still_a_flag_before_and_after_each_command(words):
    parser = cli.build_parser()
    for field in FIELDS:
        if field == "auth_token":
            continue
        value = "org/m=/srv/m" if field == "model_aliases" else "1"
        for argv in ([*words, flag_name(field), value], [flag_name(field), value, *words]):
            assert field in cli.overrides_from(parser.parse_args(argv)), argv
