"""A stand-in for ``subprocess.run`` handed to provider/service as its runner: launchctl and systemctl are
never run, their answers are scripted."""

from __future__ import annotations

import subprocess


class Recorder:
    """A ``subprocess.run`` stand-in: records argv, answers from a script keyed by the subcommand."""

    def __init__(self, answers: dict[str, tuple[int, str, str]] | None = None) -> None:
        self.calls: list[list[str]] = []
        self.answers = answers or {}

    def __call__(self, argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert kwargs.get("check") is False and kwargs.get("capture_output") is True
        self.calls.append(argv)
        verb = next((a for a in argv[1:] if not a.startswith("-")), "")
        code, out, err = self.answers.get(verb, (0, "", ""))
        return subprocess.CompletedProcess(argv, code, out, err)
