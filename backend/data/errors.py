"""Data errors: one class tree, so callers catch ``DataError`` (a ``UserError`` and a ``ValueError``).

Every message is one line that starts with the file (``FILE:LINE`` for a JSONL row, ``FILE``
and the sample number for an index) and names the config key to change.
"""

from __future__ import annotations

from backend.errors import UserError


class DataError(UserError, ValueError):
    """A data file or data setting the user must fix."""


class DataFormatError(DataError):
    """A malformed data row: the message starts with FILE:LINE."""


class DataFileError(DataError):
    """A data file that is empty, truncated or inconsistent with its siblings (.bin/.idx)."""


class OverlongError(DataError):
    """A sample over data.max_seq_length while data.overlong=error."""


class TokenizerError(DataError):
    """A tokenizer file that does not load (data.tokenizer)."""


class DataNotFoundError(DataError, FileNotFoundError):
    """A data or tokenizer path that does not exist (also a FileNotFoundError)."""


class DataStreamError(DataError):
    """A saved data-stream position that does not fit this run's data or batch settings."""
