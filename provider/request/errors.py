"""`InvalidBody`: the one error of a request body we cannot run, raised by every parser below the
front doors (body.py, response_format.py) and turned into a 400 by each door."""

from __future__ import annotations


class InvalidBody(ValueError):
    """The body is not a chat-completions request we can run. ``field`` (the parameter's path) and
    ``rule`` (fixed text) are safe to show; the value is never kept."""

    def __init__(self, field: str, rule: str = "is not valid") -> None:
        super().__init__(field)
        self.field = field
        self.rule = rule

    @property
    def message(self) -> str:
        """What a client is told: the parameter and the rule, e.g. ``'max_tokens' must be an integer >= 1``."""
        if self.field == "body":
            return f"The request body {self.rule}."
        return f"Invalid parameter '{self.field}': {self.rule}."
