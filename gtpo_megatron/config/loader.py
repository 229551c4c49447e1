"""YAML recipes + dotted overrides -> ``GTPOConfig`` (presets, shorthands, coercion, "did you mean" errors).

``load_config(path, overrides)`` reads a complete YAML recipe plus dotted overrides (``algorithm.group_size=4``),
applies the algorithm preset and coerces values to the annotated types; ``save_config`` writes the resolved config
back (``load_config`` of that file gives an equal config).

Shorthands: ``algorithm=NAME`` is ``algorithm.name=NAME``, ``data=NAME`` is ``data.source=NAME`` and
``model=NAME`` is ``model.name_or_path=NAME``.

Algorithm presets (docs/algorithm.md section 5): the fields in ``PRESET_FIELDS`` take the values of ``PRESETS[name]``
unless the user set them. Precedence, lowest first: preset < YAML < command-line overrides. When an override switches
``algorithm.name`` away from the YAML's, the YAML's preset fields described the other algorithm and are dropped (a
warning lists them); the YAML's other algorithm fields (group_size, ...) are kept.
"""

from __future__ import annotations

import difflib
import json
import types
import warnings
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from gtpo_megatron.config.rollout import RolloutConfig
from gtpo_megatron.config.run import GTPOConfig

PRESETS: dict[str, dict[str, object]] = {
    "gtpo": dict(
        advantage_estimator="group_mean",
        conflict_mode="prefix_suffix",
        entropy_filter="paper",
        entropy_penalty=0.1,
        aggregation="seq-mean-token-mean",
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        kl_coef=0.0,
        dynamic_sampling=False,
        overlong_buffer_len=0,
    ),
    "grpo": dict(
        advantage_estimator="group_mean_std",
        conflict_mode="off",
        entropy_filter="off",
        entropy_penalty=0.0,
        aggregation="seq-mean-token-mean",
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        kl_coef=0.0,
        dynamic_sampling=False,
        overlong_buffer_len=0,
    ),
    "dapo": dict(
        advantage_estimator="group_mean_std",
        conflict_mode="off",
        entropy_filter="off",
        entropy_penalty=0.0,
        aggregation="token-mean",
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        kl_coef=0.0,
        dynamic_sampling=True,
        overlong_buffer_len=300,  # dapo_overlong_buffer(RolloutConfig().max_tokens)
    ),
    "dr_grpo": dict(
        advantage_estimator="group_mean",
        conflict_mode="off",
        entropy_filter="off",
        entropy_penalty=0.0,
        aggregation="seq-mean-token-sum",
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        kl_coef=0.0,
        dynamic_sampling=False,
        overlong_buffer_len=0,
    ),
}
"""Per-algorithm values of ``PRESET_FIELDS`` (docs/algorithm.md sections 1-5), usable as
``AlgorithmConfig(**PRESETS[name])``. DAPO's overlong buffer is for the default ``rollout.max_tokens``;
:func:`preset_values` gives it for another."""
PRESET_FIELDS = frozenset(PRESETS["gtpo"])
SHORTHANDS = {"algorithm": "name", "data": "source", "model": "name_or_path"}
_NULLS = ("null", "none", "None", "~", "")


def dapo_overlong_buffer(max_tokens: int) -> int:
    """DAPO's overlong buffer: a fifth of the completion length limit (DAPO: 4096 of 20480 tokens)."""
    return max(1, max_tokens // 5)


def preset_values(name: str, *, max_tokens: int = RolloutConfig().max_tokens) -> dict[str, object]:
    """``PRESETS[name]`` for completions of at most ``max_tokens`` tokens (``rollout.max_tokens``)."""
    values = dict(PRESETS[name])
    if name == "dapo":
        values["overlong_buffer_len"] = dapo_overlong_buffer(max_tokens)
    return values


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> GTPOConfig:
    """Read a YAML recipe (or nothing when ``path`` is None) plus ``key.sub=value`` overrides into a config.

    Override values are parsed as YAML (``[a, b]``, ``null``, ``true``) and then coerced like file values.

    Raises:
        ValueError: unknown key (with "did you mean"), a value of the wrong type or outside its choices, a missing
            required field, or a section check failing; the message names the field, value, rule and fix.
    """
    raw = _read_yaml(path) if path is not None else {}
    _expand_shorthands(raw)
    yaml_name = raw.get("algorithm", {}).get("name", "gtpo")
    overridden: set[tuple[str, ...]] = set()
    for item in overrides:
        keys, value = _parse_override(item)
        _set_path(raw, keys, value)
        overridden.add(keys)
    algorithm = raw.setdefault("algorithm", {})
    name = algorithm.get("name", "gtpo")
    if name != yaml_name and name in PRESETS:  # an unknown name is reported by the Literal check
        dropped = sorted(k for k in PRESET_FIELDS & set(algorithm) if ("algorithm", k) not in overridden)
        for key in dropped:
            del algorithm[key]
        if dropped:
            warnings.warn(
                f"algorithm.name={name!r} (was {yaml_name!r} in the YAML): the YAML's {dropped} are "
                f"replaced by the {name} preset; override them on the command line to keep them",
                stacklevel=2,
            )
    raw["algorithm"] = {**_preset(name, raw), **algorithm}
    return _build(GTPOConfig, raw, "")


def save_config(cfg: GTPOConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (every field, tuples as lists); ``load_config(path)`` reproduces it."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def config_to_dict(cfg: GTPOConfig) -> dict[str, Any]:
    """Plain nested dict of the config (YAML/JSON serialisable)."""
    return json.loads(json.dumps(asdict(cfg)))


def _read_yaml(path: str | Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--config {str(path)!r}: file not found; give a path such as configs/cpu_demo.yaml") from None
    except IsADirectoryError:
        raise ValueError(
            f"--config {str(path)!r}: is a folder; give a YAML file such as configs/cpu_demo.yaml"
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(
            f"--config {str(path)!r}: invalid YAML{where} ({problem}); fix the syntax there, "
            "see configs/cpu_demo.yaml for the layout"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {str(path)!r}: top level must be a mapping of sections; see configs/cpu_demo.yaml")
    return data


def _expand_shorthands(raw: dict) -> None:
    for section, key in SHORTHANDS.items():
        if section in raw and not isinstance(raw[section], dict):
            raw[section] = {key: raw[section]}


def _parse_override(item: str) -> tuple[tuple[str, ...], object]:
    name, sep, text = item.partition("=")
    if not sep or not name:
        raise ValueError(
            f"override {item!r}: expected key=value (e.g. trainer.max_steps=5); "
            "dotted keys address sections: optim.lr=2e-6"
        )
    keys = tuple(name.strip().split("."))
    if len(keys) == 1 and keys[0] in SHORTHANDS:
        keys = (keys[0], SHORTHANDS[keys[0]])
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    return keys, text if value is None and text not in _NULLS else value


def _set_path(raw: dict, keys: tuple[str, ...], value: object) -> None:
    node = raw
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ValueError(
                f"override {'.'.join(keys)}: {'.'.join(keys[: i + 1])} is a value, not a section; "
                f"use {'.'.join(keys[: i + 1])}=VALUE"
            )
        node = child
    node[keys[-1]] = value


def _preset(name: object, raw: dict) -> dict[str, object]:
    if name not in PRESETS:
        return {}  # the Literal check on algorithm.name reports the bad value with the choices
    max_tokens = raw.get("rollout", {}).get("max_tokens", RolloutConfig().max_tokens)
    return preset_values(name, max_tokens=_coerce(max_tokens, int, "rollout.max_tokens"))


def _all_keys(cls: type, prefix: str) -> list[str]:
    out = []
    for name, hint in get_type_hints(cls).items():
        out.append(prefix + name)
        if isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
            out += _all_keys(hint, f"{prefix}{name}.")
    return out


def _suggest(full: str) -> str | None:
    """Nearest valid dotted key: the same leaf name in another section first, then the closest spelling."""
    keys = _all_keys(GTPOConfig, "")
    leaf = full.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    near = same_leaf or difflib.get_close_matches(full, keys, n=1, cutoff=0.6)
    return near[0] if near else None


def _build(cls: type, data: object, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(data, dict):
        raise ValueError(f"{where}={data!r}: must be a mapping of fields; write it as a YAML section")
    hints = get_type_hints(cls)
    for key in data:
        if key not in hints:
            full = prefix + str(key)
            near = _suggest(full)
            hint = f"did you mean {near!r}?" if near else f"valid keys of {where}: {sorted(hints)}"
            raise ValueError(f"unknown config key {full!r}: not a field of {where}; {hint}")
    kwargs = {}
    for f in fields(cls):
        if f.name in data:
            hint = hints[f.name]
            sub = hint if isinstance(hint, type) and hasattr(hint, "__dataclass_fields__") else None
            kwargs[f.name] = (
                _build(sub, data[f.name], f"{prefix}{f.name}.") if sub else _coerce(data[f.name], hint, prefix + f.name)
            )
    missing = [
        f.name for f in fields(cls) if f.name not in kwargs and f.default is MISSING and f.default_factory is MISSING
    ]
    if missing:
        raise ValueError(
            f"missing required config field(s) {[prefix + m for m in missing]}; give them in the YAML "
            f"or on the command line, e.g. {prefix + missing[0]}=VALUE"
        )
    return cls(**kwargs)


def _coerce(value: object, hint: Any, name: str) -> Any:
    """``value`` converted to the annotated type ``hint``; ValueError naming ``name`` when it cannot be."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        if isinstance(value, bool) and ("off" if not value else "on") in args:
            value = "off" if not value else "on"  # YAML 1.1 reads a bare off/on as a boolean
        if value in args:
            return value
        near = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        fix = f"did you mean {near[0]!r}?" if near else "pick one of them"
        raise ValueError(f"{name}={value!r}: must be one of {list(args)}; {fix}")
    if origin in (Union, types.UnionType):
        if value is None or (isinstance(value, str) and value in _NULLS):
            if type(None) in args:
                return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:  # e.g. ``int | Literal["auto"]``: the first type that takes the value
            try:
                return _coerce(value, option, name)
            except ValueError as err:
                errors.append(str(err).split(": ", 1)[-1].split(";")[0])
        raise ValueError(f"{name}={value!r}: {' or '.join(errors)}; write e.g. {name}={_example(options)}")
    if origin is tuple:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"{name}={value!r}: must be a list; write [a, b] in YAML")
        return tuple(_coerce(v, args[0], name) for v in items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{name}={value!r}: must be a mapping; write {{key: value}} in YAML")
        return dict(value)
    return _coerce_scalar(value, hint, name)


def _example(options: list[Any]) -> str:
    """A value of the first option of a union, for error messages."""
    first = options[0]
    return str(get_args(first)[0]) if get_origin(first) is Literal else {int: "4", float: "0.5"}.get(first, "...")


def _coerce_scalar(value: object, hint: type, name: str) -> Any:
    if hint is bool:
        text = str(value).lower()
        if isinstance(value, bool) or text in ("true", "false", "1", "0", "yes", "no"):
            return value if isinstance(value, bool) else text in ("true", "1", "yes")
        raise ValueError(f"{name}={value!r}: must be a boolean; use true or false")
    if hint is int:
        try:
            number = float(value) if isinstance(value, str) else value
            if isinstance(number, (int, float)) and not isinstance(number, bool) and float(number).is_integer():
                return int(number)
        except ValueError:
            pass
        raise ValueError(f"{name}={value!r}: must be an integer; write e.g. {name}=4")
    if hint is float:
        try:
            if not isinstance(value, bool):
                return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            pass
        raise ValueError(f"{name}={value!r}: must be a number; write e.g. {name}=0.5 or 1e-6")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"{name}={value!r}: must be a string; quote it in YAML")
    raise TypeError(f"config field {name} has an unsupported annotation {hint!r}")
