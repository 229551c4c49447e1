"""The job's first check: ``GTPOConfig.validate`` with the model's ``config.json``, then what only this edge knows.

``validate_config`` runs in ``gtpo-train`` and ``gtpo-plan`` before any process group, engine or model exists: the
model is found (a local folder, a built-in, materialised, or a hub name, whose ``config.json`` alone is fetched),
then the config's own rules, the model's load-time refusals (``model.check_hf_model``), a resumed checkpoint's
padded heads, Megatron's field names for ``model.megatron_overrides`` and the registries' names; it warns of
:func:`routing_replay_caveat`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from gtpo_megatron.builtin_models import BUILTIN_PREFIX, check_model, local_model_folder, resolve_model_path
from gtpo_megatron.config.checks import require
from gtpo_megatron.megatron_adapter.head_padding import padded_num_query_groups, resume_padding_error
from gtpo_megatron.megatron_adapter.settings import policy_settings
from gtpo_megatron.plan.architectures import architecture_from_hf_config
from gtpo_megatron.run_dir import checkpoints_dir, newest_checkpoint

if TYPE_CHECKING:
    from gtpo_megatron.config import GTPOConfig

logger = logging.getLogger(__name__)
DEFERRED = (
    "parallel.tp_size/pp_size against the heads and layers, parallel.ep_size against the experts, "
    "rollout.routing_replay, the sequence length and the model's load-time refusals"
)


def find_hf_config(name_or_path: str, *, fetch: bool) -> Path | None:
    """The model's ``config.json``: a local folder's, a built-in's, or a hub name's from the hub cache or the hub.

    Without ``fetch`` only what is on disk; with it a built-in is materialised and a hub name's ``config.json`` alone
    is read from the hub cache or fetched (one request, no retries). None: not found, or a hub server error.

    Raises:
        ValueError: (``fetch``) naming ``model.name_or_path``, its value and a fix, for a model found nowhere.
    """
    if not fetch:
        path = local_model_folder(name_or_path) / "config.json"
        return path if path.is_file() else None
    check_model(name_or_path)
    folder = Path(resolve_model_path(name_or_path)).expanduser()
    if name_or_path.startswith(BUILTIN_PREFIX) or folder.is_dir():
        require(
            (folder / "config.json").is_file(),
            "model.name_or_path",
            name_or_path,
            f"the folder {folder} has no config.json",
            "give a Hugging Face model folder (config.json, weights, tokenizer)",
        )
        return folder / "config.json"
    return _hub_config_file(name_or_path)


def _hub_config_file(repo_id: str) -> Path | None:
    """``config.json`` of the hub model ``repo_id``: the hub cache's, else one HEAD request and that file's download.

    Raises:
        ValueError: ``repo_id`` is no hub name, unknown or gated on the hub, has no config.json, or is not in the
            hub cache while the hub cannot be reached (offline mode, no network).
    """
    import huggingface_hub as hub
    from huggingface_hub import errors

    def refuse(rule: str, fix: str) -> ValueError:
        return ValueError(f"model.name_or_path={repo_id!r}: {rule}; {fix}")

    download = (
        f"check its spelling; on a machine with network `hf download {repo_id}` fills the hub cache (HF_HOME; "
        "copy it here, HF_HUB_OFFLINE=1 then reads only the cache), or give a local Hugging Face model folder"
    )
    try:
        cached = hub.try_to_load_from_cache(repo_id, "config.json")
        if isinstance(cached, str):
            return Path(cached)
        hub.get_hf_file_metadata(hub.hf_hub_url(repo_id, "config.json"))  # one request, no retries
        return Path(hub.hf_hub_download(repo_id, "config.json"))
    except errors.HFValidationError as err:
        raise refuse(f"neither a local folder, a built-in nor a hub name ({err})", download) from None
    except errors.GatedRepoError:
        raise refuse("is gated on the hub", "request access on its hub page, then `hf auth login`") from None
    except errors.RepositoryNotFoundError:
        raise refuse("no such model on the hub (or it is private)", download) from None
    except errors.RemoteEntryNotFoundError:
        raise refuse("the hub repository has no config.json", "give a Hugging Face transformers model") from None
    except errors.HfHubHTTPError as err:
        logger.warning("%s: config.json not fetched (%s); deferred to the model's load: %s", repo_id, err, DEFERRED)
        return None
    except Exception as err:  # noqa: BLE001 - the hub's HTTP client's connection errors (the client varies)
        raise refuse(f"not in the hub cache, and the hub cannot be reached ({err})", download) from None


def validate_config(cfg: GTPOConfig, world_size: int, *, check_registries: bool = True) -> None:
    """``cfg.validate(world_size)`` with the model's ``config.json``, then Megatron's and the registries' names.

    ``check_registries`` (``gtpo-train``): find the model (``find_hf_config``), run its load-time refusals and, with
    ``resume``, the checkpoint's head padding check; without it (``gtpo-plan``) only a config.json on disk is read.

    Raises:
        ValueError: naming the fields, the values, the rule and a fix.
    """
    path = find_hf_config(cfg.model.name_or_path, fetch=check_registries)
    hf = json.loads(path.read_text()) if path is not None else None
    cfg.validate(world_size, hf_config=hf)
    caveat = routing_replay_caveat(cfg)
    if caveat is not None:
        logger.warning(caveat)
    if not check_registries:
        return
    if hf is not None:
        from transformers import AutoConfig

        from gtpo_megatron.megatron_adapter.model import check_hf_model

        check_hf_model(AutoConfig.from_pretrained(path.parent), policy_settings(cfg))
        _check_resume_padding(cfg, hf)
    from megatron.core.transformer import TransformerConfig

    from gtpo_megatron.ops import advantages
    from gtpo_megatron.rewards import registry

    known = {f.name for f in fields(TransformerConfig)}
    for key in cfg.model.megatron_overrides:
        require(
            key in known,
            "model.megatron_overrides",
            key,
            "is not a field of megatron TransformerConfig",
            f"use one of its fields, e.g. {sorted(known)[:5]}",
        )
    advantages.get_advantage_estimator(cfg.algorithm.advantage_estimator)
    registry.get_reward(cfg.reward.name)


def routing_replay_caveat(cfg: GTPOConfig) -> str | None:
    """The warning of routing replay with async rollouts and a TIS/MIS correction (docs/moe.md); None otherwise."""
    correction = cfg.algorithm.off_policy_correction
    if cfg.rollout.routing_replay == "off" or cfg.rollout.mode != "async" or correction == "none":
        return None
    return (
        f"rollout.routing_replay={cfg.rollout.routing_replay!r} with rollout.mode='async' and "
        f"algorithm.off_policy_correction={correction!r}: the training forward replays the experts the engine chose "
        f"with weights up to rollout.max_staleness={cfg.rollout.max_staleness} steps old, so pi_prox and mu share "
        "that routing and the importance weight pi_prox / mu cannot see how the current router would route "
        "differently (routing drift); the update trains under the stale routing. Use rollout.mode=sync or "
        "rollout.routing_replay=off where routing drift matters (docs/moe.md, routing replay with async rollouts)"
    )


def _check_resume_padding(cfg: GTPOConfig, hf: dict) -> None:
    """With ``resume``, refuse the newest checkpoint if its padded heads are not this ``tp_size``'s.

    Before the run folder's config.yaml is replaced; the load checks every shape again.
    """
    from megatron.core import dist_checkpointing

    folder = newest_checkpoint(checkpoints_dir(cfg.output_dir)) if cfg.resume else None
    if folder is None:
        return
    arch = architecture_from_hf_config(hf, name=cfg.model.name_or_path)
    heads, groups = arch.num_attention_heads, arch.num_query_groups
    error = resume_padding_error(
        str(folder),
        saved_tp_size=dist_checkpointing.load_common_state_dict(str(folder))["layout"]["tp_size"],
        tp_size=cfg.parallel.tp_size,
        num_heads=heads,
        num_query_groups=groups,
        padded_groups=padded_num_query_groups(
            num_heads=heads,
            num_query_groups=groups,
            tp_size=cfg.parallel.tp_size,
            pad_attention_heads=cfg.model.pad_attention_heads,
        ),
    )
    if error is not None:
        raise error
