"""The one shape of a config error: the field, its value, the rule and a fix."""

from __future__ import annotations

from dataclasses import fields


def require(ok: bool, name: str, value: object, rule: str, fix: str) -> None:
    """Raise ``ValueError("name=value: rule; fix")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}={value!r}: {rule}; {fix}")


def require_numbers(section: object, prefix: str) -> None:
    """Refuse a non-number in an ``int`` or ``float`` field (e.g. a symbolic ``"max_tokens/5"`` from Python)."""
    for spec in fields(section):
        value = getattr(section, spec.name)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        optional = spec.type.endswith("| None") and value is None
        if spec.type.split(" |")[0] in ("int", "float") and not (number or optional):
            require(False, f"{prefix}.{spec.name}", value, f"must be a number ({spec.type})",
                    "give the number itself (config.preset_values(name, max_tokens=N) for a preset)")  # fmt: skip
