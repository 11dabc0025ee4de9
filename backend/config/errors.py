"""The config's error type, in a module of its own so that every config module (load, resolve,
validate) imports it from below and none of them imports another to get it."""

from __future__ import annotations

from backend.errors import UserError


class ConfigError(UserError, ValueError):
    """A bad config: the message names the dotted key and what is allowed."""
