"""The error every config check raises, and the check of a choice among names."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and the fix."""


def choice(where: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{where}={value!r} is not one of {', '.join(map(repr, allowed))}.")
