"""Typed errors. Every message says what went wrong and what to do; CLIs print it on one line and exit 2."""


class SpecjaxError(Exception):
    """Base class for every error specjax raises on bad input."""


class CheckpointError(SpecjaxError):
    """A checkpoint is missing, incomplete, corrupt or does not match its config."""


class UnsupportedModelError(SpecjaxError):
    """The checkpoint describes an architecture or feature specjax does not implement."""


class InputError(SpecjaxError):
    """A prompt, option or sampling value is out of range."""


class OutputError(SpecjaxError):
    """A file cannot be written: a full or read-only disk, a missing permission, or a link where a file goes."""
