"""The one shape of a config error: the field, its value, the rule and a fix."""

from __future__ import annotations


def require(ok: bool, name: str, value: object, rule: str, fix: str) -> None:
    """Raise ``ValueError("name=value: rule; fix")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}={value!r}: {rule}; {fix}")
