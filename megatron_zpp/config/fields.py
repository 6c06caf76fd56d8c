"""How a config field is declared (`opt`: its default, CLI flag and help) and the error every
check raises. Shared by the config package and the section modules it re-exports; imports nothing of ours."""

from __future__ import annotations

from dataclasses import field


class ConfigError(ValueError):
    """An inconsistent or unsupported setting. The message says what to change."""


def opt(default, flag: str, help: str, **kw):
    """A config field with its CLI flag. kw: choices, nargs, type (element type for lists), metavar, renamed_from
    (the field's former name: its flag --former-name and YAML key former_name still set it, and a checkpoint's
    config with the former key loads)."""
    meta = {"flag": flag, "help": help, **kw}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)
