"""Typed errors. Every message says what went wrong and what to do; CLIs print it on one line and exit 2."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping


def library_spelling(name: str, value: object) -> str:
    """A setting as a library call spells it: `quantize='int8'`, `mesh={'data': 1, 'tensor': 2}`; the name alone
    where the message gives no value."""
    return name if value is None else f"{name}={value!r}"


class SpecjaxError(Exception):
    """Base class for every error specjax raises on bad input.

    A message whose advice is to change a setting names it as a `{name}` field and passes `settings={name: value}`
    (value None: the setting named alone); other braces in the message are text. `str(error)` spells each setting
    in library terms (`library_spelling`); a command line spells the same error in its own flags (`spelled`).
    """

    def __init__(self, message: str, settings: Mapping[str, object] | None = None):
        self.template = message
        self.settings = dict(settings or {})
        super().__init__(self.spelled(library_spelling))

    def spelled(self, spelling: Callable[[str, object], str]) -> str:
        """The message with each of its settings spelled by `spelling(name, value)`.

        Args:
          spelling: how one setting reads: `library_spelling`, or a command line's flag for it and its value.
        Returns:
          The message.
        """
        settings = self.settings
        return re.sub(
            r"\{(\w+)\}", lambda m: spelling(m[1], settings[m[1]]) if m[1] in settings else m[0], self.template
        )


class CheckpointError(SpecjaxError):
    """A checkpoint is missing, incomplete, corrupt or does not match its config."""


class UnsupportedModelError(SpecjaxError):
    """The checkpoint describes an architecture or feature specjax does not implement."""


class InputError(SpecjaxError):
    """A prompt, option or sampling value is out of range."""


class OutputError(SpecjaxError):
    """A file cannot be written: a full or read-only disk, a missing permission, or a link where a file goes."""
