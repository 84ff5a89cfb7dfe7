import pytest

from whale_ray.config import ConfigError, load_config


def test_defaults_are_the_papers_schedule():
    cfg = load_config()
    assert (cfg.condition, cfg.E, cfg.I, cfg.domain) == ("whale", 0.6, 6, "math_reasoning")
    assert cfg.harness_phase.candidates_per_iteration == 3
    assert cfg.eval.test_samples == 8


@pytest.mark.parametrize("cpus, evaluators", [(2, 1), (4, 1), (7, 1), (8, 2), (16, 4), (128, 32), (0, 1)])
def test_the_default_pool_is_one_evaluator_per_four_cores(cpus, evaluators):
    sandbox = load_config().sandbox
    assert sandbox.evaluators == "cores" and sandbox.pool_bounds(cpus) == (evaluators, evaluators, False)
    assert load_config(None, {"sandbox.evaluators": 3}).sandbox.pool_bounds(cpus) == (3, 3, False)  # a count stays


def test_a_pool_of_cores_without_the_cluster_is_an_error_that_names_the_key():
    with pytest.raises(ValueError, match="sandbox.evaluators 'cores'"):
        load_config().sandbox.pool_bounds()


def test_flags_override_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("E: 0.2\nI: 2\nweight:\n  samples_per_prompt: 4\n")
    cfg = load_config(path, {"I": 6, "weight.prompts_per_step": 8})
    assert (cfg.E, cfg.I, cfg.weight.samples_per_prompt, cfg.weight.prompts_per_step) == (0.2, 6, 4, 8)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"E": 0}, "E must be a positive"),
        ({"E": -1}, "E must be a positive"),
        ({"I": 0}, "I must be a positive"),
        ({"condition": "bogus"}, "unknown condition 'bogus'"),
        ({"domain": "chemistry"}, "unknown domain 'chemistry'"),
        ({"weight.samples_per_prompt": 0}, "weight.samples_per_prompt"),
        ({"weight.nonsense": 1}, "weight.nonsense"),
        ({"data.source": "files"}, "needs data.train_path"),
        ({"sandbox.evaluators": "many"}, "sandbox.evaluators"),
        ({"sandbox.evaluators": 0}, "sandbox.evaluators"),
        ({"weight.max_staleness": 2}, "weight.max_staleness: Input should be less than or equal to 1"),
        ({"eval.overlap": "maybe"}, "eval.overlap"),
    ],
)
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("E: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(scalar)
    typo = tmp_path / "typo.yaml"
    typo.write_text("condtion: whale\n")
    with pytest.raises(ConfigError, match=str(typo)):
        load_config(typo)


@pytest.mark.parametrize("key, says", [
    ("engine_layout", "serve.preset chooses where the engine runs"),
    ("ingress", "serve.preset chooses how requests reach the replicas"),
    ("user_code_thread", "always run on Serve's main event loop"),
    ("access_log", "access log is off in both presets"),
    ("replica_cpus", "serve.engine_cpus holds it"),
    ("replica_gpus", "serve.engine_gpus holds it"),
])
def test_a_serve_key_that_is_no_setting_names_what_replaces_it(tmp_path, key, says):
    path = tmp_path / "c.yaml"
    path.write_text(f"serve:\n  {key}: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}: serve: {key} is no longer a setting: ") and says in str(e.value)
    assert "\n" not in str(e.value)
