"""Config loading: coercion, unknown keys, presets, shorthands, round trip and cross-section validation."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml

from gtpo_megatron.config import PRESETS, AlgorithmConfig, GTPOConfig, load_config, preset_values, save_config
from gtpo_megatron.megatron_adapter.validation import validate_config

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "cpu_demo.yaml"
BASE = ["model=builtin:tiny-qwen2", "output_dir=/tmp/run"]


def test_defaults_from_overrides_only():
    cfg = load_config(None, BASE)
    assert cfg.model.name_or_path == "builtin:tiny-qwen2"
    assert cfg.algorithm.name == "gtpo" and cfg.algorithm.entropy_filter == "paper"
    assert cfg.algorithm.entropy_threshold == pytest.approx(math.log(2))


def test_values_are_coerced_to_annotated_types():
    cfg = load_config(
        None,
        [
            *BASE,
            "optim.lr=1e-6",
            "trainer.max_steps=7.0",
            "parallel.sequence_parallel=false",
            "data.limit=null",
            "rollout.stop=a",
            "algorithm.logprob_chunk_size=128",
            "reward.timeout_s=3",
        ],
    )
    assert cfg.optim.lr == 1e-6 and isinstance(cfg.optim.lr, float)
    assert cfg.trainer.max_steps == 7 and isinstance(cfg.trainer.max_steps, int)
    assert cfg.parallel.sequence_parallel is False and cfg.data.limit is None
    assert cfg.rollout.stop == ("a",)
    assert cfg.algorithm.logprob_chunk_size == 128 and isinstance(cfg.reward.timeout_s, float)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("trainer.max_step=3", "did you mean 'trainer.max_steps'"),
        ("rollout.lr=3", "did you mean 'optim.lr'"),
        ("algorithm.name=gtp0", "did you mean 'gtpo'"),
        ("trainer.max_steps=2.5", "trainer.max_steps=2.5: must be an integer"),
        ("optim.lr=fast", "optim.lr='fast': must be a number"),
        ("parallel.sequence_parallel=maybe", "must be a boolean"),
        ("algorithm.group_size=1", "algorithm.group_size=1: must be >= 2"),
        ("algorithm.clip_eps_high=0.1", "clip_eps_low <= clip_eps_high"),
        ("trainer=3", "trainer=3: must be a mapping"),
        ("no_equals_sign", "expected key=value"),
    ],
)
def test_errors_name_field_value_and_fix(override, fragment):
    with pytest.raises(ValueError) as err:
        load_config(None, [*BASE, override])
    assert fragment in str(err.value)


def test_missing_required_field_is_named():
    with pytest.raises(ValueError, match=r"missing required config field\(s\) \['output_dir'\]"):
        load_config(None, ["model=builtin:tiny-qwen2"])


def test_yaml_syntax_error_and_folder_are_config_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  name_or_path: x\n  bad: [1, 2\noutput_dir: y\n")
    with pytest.raises(ValueError, match=r"invalid YAML at line 4, column 11 \(expected ',' or '\]'"):
        load_config(path)
    with pytest.raises(ValueError, match="is a folder; give a YAML file"):
        load_config(tmp_path)


def test_unknown_algorithm_name_does_not_warn_about_a_preset(recwarn):
    with pytest.raises(ValueError, match=r"algorithm.name='foo': must be one of"):
        load_config(DEMO, ["algorithm=foo"])
    assert not [w for w in recwarn if "preset" in str(w.message)]


def test_unknown_yaml_key_in_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"output_dir": "x", "model": {"name_or_path": "m"}, "algorithm": {"group_sise": 4}}))
    with pytest.raises(ValueError, match="did you mean 'algorithm.group_size'"):
        load_config(path)


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo"])
def test_algorithm_shorthand_applies_preset_over_yaml(name):
    with pytest.warns(UserWarning, match="replaced by the"):
        cfg = load_config(DEMO, [f"algorithm={name}"])
    expected = preset_values(name, max_tokens=cfg.rollout.max_tokens)
    assert {k: getattr(cfg.algorithm, k) for k in expected} == expected
    # Fields outside the preset (group size) keep the YAML value.
    assert cfg.algorithm.group_size == yaml.safe_load(DEMO.read_text())["algorithm"]["group_size"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_an_algorithm_section_from_python(name):
    section = AlgorithmConfig(name=name, **PRESETS[name], group_size=8)
    assert {k: getattr(section, k) for k in PRESETS[name]} == PRESETS[name]


def test_the_dapo_buffer_is_a_fifth_of_max_tokens():
    assert PRESETS["dapo"]["overlong_buffer_len"] == 300 and preset_values("dapo") == PRESETS["dapo"]  # 1500 tokens
    assert preset_values("dapo", max_tokens=20480)["overlong_buffer_len"] == 4096  # DAPO's 4096 of 20480
    with pytest.warns(UserWarning, match="replaced by the dapo preset"):
        cfg = load_config(DEMO, ["algorithm=dapo", "rollout.max_tokens=64"])
    assert cfg.algorithm.overlong_buffer_len == 12


def test_a_symbolic_number_is_refused_with_the_field():
    with pytest.raises(ValueError, match=r"algorithm.overlong_buffer_len='max_tokens/5': must be a number \(int\); "
                                         r"give the number itself \(config.preset_values"):  # fmt: skip
        AlgorithmConfig(name="dapo", **{**PRESETS["dapo"], "overlong_buffer_len": "max_tokens/5"})


def test_explicit_override_wins_over_preset():
    with pytest.warns(UserWarning, match="replaced by the dapo preset"):
        cfg = load_config(DEMO, ["algorithm=dapo", "algorithm.clip_eps_high=0.3", "algorithm.overlong_buffer_len=7"])
    assert cfg.algorithm.clip_eps_high == 0.3 and cfg.algorithm.overlong_buffer_len == 7
    assert cfg.algorithm.aggregation == "token-mean"


def test_yaml_fields_win_over_preset_of_same_name(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {"output_dir": "x", "model": "m", "algorithm": {"name": "grpo", "conflict_mode": "prefix_suffix"}}
        )
    )
    cfg = load_config(path)
    assert cfg.algorithm.conflict_mode == "prefix_suffix"  # set in the YAML
    assert cfg.algorithm.advantage_estimator == "group_mean_std"  # from the grpo preset
    assert cfg.model.name_or_path == "m"  # model: NAME shorthand inside YAML


def test_data_shorthand_and_path():
    cfg = load_config(DEMO, ["data=gsm8k", "data.path=my/gsm8k/train.jsonl"])
    assert cfg.data.source == "gsm8k" and cfg.data.path.endswith("train.jsonl")


def test_megatron_overrides_dotted_key():
    cfg = load_config(None, [*BASE, "model.megatron_overrides.attention_dropout=0.0"])
    assert cfg.model.megatron_overrides == {"attention_dropout": 0.0}


def test_save_then_load_round_trips(tmp_path):
    with pytest.warns(UserWarning):
        cfg = load_config(DEMO, ["algorithm=dapo", "rollout.stop=[x, y]", "optim.lr=3e-5"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_sections_are_frozen():
    cfg = load_config(None, BASE)
    with pytest.raises(AttributeError):
        cfg.optim.lr = 1.0  # type: ignore[misc]


def _cfg(*overrides: str) -> GTPOConfig:
    return load_config(None, [*BASE, *overrides])


@pytest.mark.parametrize(
    "overrides, world, fragment",
    [
        (["parallel.tp_size=2", "parallel.pp_size=2"], 6, "tp_size*pp_size must divide the world size"),
        (["rollout.num_prompts=3", "algorithm.group_size=2"], 4, "use rollout.num_prompts=4"),
        (
            ["algorithm.group_size=4", "optim.micro_batch_size=3"],
            2,
            "must divide the 2 sequences per data-parallel rank",
        ),
    ],
)
def test_validate_world_arithmetic(overrides, world, fragment):
    with pytest.raises(ValueError) as err:
        validate_config(_cfg(*overrides), world, check_registries=False)
    assert fragment in str(err.value)


def test_validate_heads_against_local_model():
    # tiny-qwen2 has 4 query heads and 2 KV heads (gtpo_megatron/builtin_models.py): TP=4 cannot split 2 KV heads.
    from gtpo_megatron.builtin_models import resolve_model_path

    resolve_model_path("builtin:tiny-qwen2")
    validate_config(_cfg("parallel.tp_size=2", "rollout.max_tokens=64"), 2, check_registries=False)
    with pytest.raises(ValueError, match="parallel.tp_size=4 must divide num_attention_heads=4 and num_query_groups=2"):
        validate_config(_cfg("parallel.tp_size=4"), 4, check_registries=False)
    validate_config(_cfg("parallel.tp_size=4", "model.pad_attention_heads=true"), 4, check_registries=False)
    with pytest.raises(ValueError, match="max_position_embeddings=2048"):
        validate_config(_cfg("rollout.max_tokens=2000"), 1, check_registries=False)


def test_validate_applies_the_planner_rules(monkeypatch):
    # one owner: GTPOConfig.validate raises whatever plan.layout's rules report, all at once
    from gtpo_megatron.plan import layout

    monkeypatch.setattr(layout, "world_problems", lambda *args, **kw: ["world rule"])
    monkeypatch.setattr(layout, "batch_problems", lambda **kw: [f"batch rule dp_size={kw['dp_size']}"])
    with pytest.raises(ValueError, match=r"layout does not divide:\n  - world rule\n  - batch rule dp_size=1$"):
        validate_config(_cfg("model=/no/local/model"), 1, check_registries=False)


def test_validate_rejects_unknown_megatron_override():
    pytest.importorskip("megatron.core")
    with pytest.raises(ValueError, match="not a field of megatron TransformerConfig"):
        validate_config(_cfg("model.megatron_overrides.not_a_field=1"), 1)


def test_dapo_overlong_buffer_is_a_fifth_of_max_tokens():
    assert load_config(None, [*BASE, "algorithm=dapo"]).algorithm.overlong_buffer_len == 300  # 1500 // 5
    assert load_config(None, [*BASE, "algorithm=dapo", "rollout.max_tokens=50"]).algorithm.overlong_buffer_len == 10


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("algorithm.kl_coef=1e-6", "the dapo objective has no KL term"),
        ("algorithm.aggregation=seq-mean-token-mean", "the dapo loss is defined with aggregation 'token-mean'"),
    ],
)
def test_algorithm_combinations_rejected_at_load_time(override, fragment):
    with pytest.raises(ValueError, match=fragment):
        load_config(None, [*BASE, "algorithm=dapo", override])


def test_offload_train_state_needs_colocated_placement():
    assert load_config(None, BASE).rollout.offload_train_state is False
    assert load_config(None, [*BASE, "rollout.offload_train_state=true"]).rollout.offload_train_state is True
    with pytest.raises(ValueError) as err:
        load_config(None, [*BASE, "rollout.placement=separate", "rollout.offload_train_state=true"])
    message = str(err.value)
    assert "rollout.offload_train_state/rollout.placement=(True, 'separate')" in message
    assert "set rollout.offload_train_state=false, or rollout.placement=colocated" in message


def test_reward_extraction_choices_match_the_rewards_owner():
    """The config's Literal lists exactly the modes ``rewards.answer_text`` implements."""
    from typing import get_args, get_type_hints

    from gtpo_megatron.config import RewardConfig
    from gtpo_megatron.rewards import EXTRACTION_MODES

    literal = get_args(get_type_hints(RewardConfig)["extraction"])[0]
    assert set(get_args(literal)) == set(EXTRACTION_MODES)


@pytest.mark.parametrize("value", [0.0, 1.5])
def test_reward_max_error_frac_out_of_range_is_refused(value):
    from gtpo_megatron.config import RewardConfig

    with pytest.raises(ValueError, match=r"reward.max_error_frac.*must be in \(0, 1\]"):
        RewardConfig(max_error_frac=value)


def test_kl_coef_is_accepted_for_grpo_only():
    cfg = load_config(None, [*BASE, "algorithm=grpo", "algorithm.kl_coef=1e-6", "algorithm.kl_estimator=k2"])
    assert (cfg.algorithm.kl_coef, cfg.algorithm.kl_estimator) == (1e-6, "k2")
    assert load_config(None, [*BASE, "algorithm=dr_grpo", "algorithm.kl_coef=1e-6"]).algorithm.kl_coef == 1e-6
    with pytest.raises(
        ValueError, match="the gtpo objective has no KL term.*set algorithm.kl_coef=0, or algorithm=grpo"
    ):
        load_config(None, [*BASE, "algorithm.kl_coef=1e-6"])
    with pytest.raises(ValueError, match="algorithm.kl_coef=-1.0: must be >= 0"):
        load_config(None, [*BASE, "algorithm=grpo", "algorithm.kl_coef=-1"])


def test_fidelity_switches_defaults_and_values():
    cfg = load_config(None, BASE)
    algorithm = cfg.algorithm
    assert (algorithm.conflict_sign, algorithm.loss_temperature, algorithm.initial_entropy_steps) == (
        "raw",
        "sampling",
        1,
    )
    assert cfg.model.fp32_output_layer is True and cfg.data.system_prompt == "concise"
    cfg = load_config(
        None,
        [
            *BASE,
            "algorithm.conflict_sign=penalized",
            "algorithm.loss_temperature=1.0",
            "algorithm.initial_entropy_steps=3",
        ],
    )
    assert (cfg.algorithm.conflict_sign, cfg.algorithm.loss_temperature) == ("penalized", 1.0)
    assert cfg.algorithm.initial_entropy_steps == 3


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("algorithm.loss_temperature=0.9", r"algorithm.loss_temperature=0.9: must be one of \['sampling', 1.0\]"),
        ("algorithm.loss_temperature=true", "algorithm.loss_temperature=True: must be 'sampling' or 1.0"),
        ("algorithm.initial_entropy_steps=0", "algorithm.initial_entropy_steps=0: must be >= 1"),
        ("algorithm.conflict_sign=positive", "algorithm.conflict_sign='positive': must be one of"),
        ("data.system_prompt=mine", "data.system_prompt='mine': must be one of"),
    ],
)
def test_fidelity_switches_refuse_bad_values(override, fragment):
    with pytest.raises(ValueError, match=fragment):
        load_config(None, [*BASE, override])


def test_system_prompt_choices_match_the_prompts_owner():
    from typing import get_args, get_type_hints

    from gtpo_megatron.config import DataConfig
    from gtpo_megatron.data import SYSTEM_PROMPTS

    assert set(get_args(get_type_hints(DataConfig)["system_prompt"])) == set(SYSTEM_PROMPTS)


def test_engine_fields_take_a_number_or_auto():
    assert load_config(None, BASE).rollout.num_engines == "auto"
    cfg = load_config(None, [*BASE, "rollout.num_engines=2", "rollout.timeout_s=60"])
    assert cfg.rollout.num_engines == 2 and isinstance(cfg.rollout.num_engines, int)
    assert cfg.rollout.weight_sync == "auto" and cfg.rollout.timeout_s == 60.0
    assert load_config(None, [*BASE, "rollout.num_engines=2", "rollout.weight_sync=sharded"]).rollout.num_engines == 2
    with pytest.raises(ValueError, match=r"rollout.num_engines='two': must be an integer or must be one of \['auto'\]"):
        load_config(None, [*BASE, "rollout.num_engines=two"])


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["rollout.num_engines=0"], "rollout.num_engines=0: must be >= 1 or auto"),
        (["rollout.num_engine_gpus=2"], "rollout.num_engine_gpus=2: needs rollout.placement=separate"),
        (
            ["rollout.placement=separate", "rollout.engine_tp_size=2", "rollout.num_engine_gpus=3"],
            "rollout.num_engine_gpus=3: needs rollout.placement=separate and a multiple of rollout.engine_tp_size=2",
        ),
        (
            ["rollout.weight_sync=files", "rollout.num_engines=2"],
            "rollout.weight_sync='files': the files path feeds one engine, not rollout.num_engines=2",
        ),
        (["rollout.timeout_s=0"], "rollout.timeout_s=0.0: must be > 0 seconds"),
    ],
)
def test_engine_fields_are_checked(overrides, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        load_config(None, [*BASE, *overrides])


def test_num_engines_must_tile_the_world():
    cfg = load_config(None, [*BASE, "rollout.num_engines=3"])
    with pytest.raises(ValueError, match=r"rollout.num_engines=3 x rollout.engine_tp_size=1 = 3 GPUs must divide the "
                                         r"world size \(2, rollout.placement=colocated\)"):  # fmt: skip
        validate_config(cfg, 2, check_registries=False)
    validate_config(load_config(None, [*BASE, "rollout.num_engines=2"]), 2, check_registries=False)
    separate = load_config(None, [*BASE, "rollout.placement=separate", "rollout.num_engines=2"])
    with pytest.raises(ValueError, match=r"must divide the engine pool \(1,"):
        validate_config(separate, 2, check_registries=False)


def test_off_policy_correction_rules():
    cfg = load_config(DEMO, ["algorithm.off_policy_correction=mis", "algorithm.off_policy_cap=3"])
    assert (cfg.algorithm.off_policy_correction, cfg.algorithm.off_policy_cap) == ("mis", 3.0)
    with pytest.raises(ValueError, match=r"algorithm.off_policy_cap=0.5: must be >= 1"):
        load_config(DEMO, ["algorithm.off_policy_correction=tis", "algorithm.off_policy_cap=0.5"])
    with pytest.raises(ValueError, match=r"algorithm.off_policy_correction/loss_temperature=\('tis', 1.0\)"):
        load_config(DEMO, ["algorithm.off_policy_correction=tis", "algorithm.loss_temperature=1.0"])


@pytest.mark.parametrize("field", ["moe_aux_loss_coeff", "moe_z_loss_coeff"])
@pytest.mark.parametrize("value", ["-0.1", "inf"])
def test_router_loss_coefficients_must_be_finite_and_non_negative(field, value):
    with pytest.raises(ValueError, match=rf"model.{field}=(-0.1|inf): must be finite and >= 0"):
        load_config(None, [*BASE, f"model.{field}={value}"])


@pytest.mark.parametrize(
    ("overrides", "longest_s"),
    [
        ([], 1800 + 4 * (5 + 2)),  # one round, then P*G = 8 answers on 2 graders, 5 s + 2 s kill grace each
        (["rollout.timeout_s=7200", "rollout.num_prompts=3", "reward.num_workers=5"], 7200 + 5 * 7),
        (["rollout.placement=separate", "rollout.mode=async", "rollout.max_staleness=3", "rollout.timeout_s=7200"],
         3 * 7200),  # the drain: max_staleness batches, grading included
        (["rollout.fault_tolerance=true", "rollout.num_engines=2"], 2 * (1800 + 4 * (5 + 2))),  # a second pass
    ],
)  # fmt: skip
def test_the_world_timeout_covers_the_longest_wait_for_an_engine(overrides, longest_s):
    cfg = load_config(None, ["model=builtin:tiny-qwen2", "output_dir=/tmp/unused", *overrides])
    assert cfg.longest_wait_s == longest_s
    assert cfg.world_timeout_s == longest_s + 1800  # the former fixed 30 minutes stay as the margin
