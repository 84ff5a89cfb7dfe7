"""RSFT's optimiser settings: chosen from the checkpoint when the config leaves them unset, recorded in the run's
config.yaml, kept on resume; the learner's warm-up, clipping and bf16 autocast."""

from __future__ import annotations

import math

import pytest
import yaml

from tests.helpers import small_config
from whale_ray.config import CONFIG_VERSION, WeightPhaseConfig, dump_config, load_config
from whale_ray.loop import RunDirectory
from whale_ray.rsft import RSFTLearner
from whale_ray.rsft_defaults import CheckpointFacts, describe_checkpoint, resolve_run_config, resolve_weight_phase

EXAMPLES = [([1, 2, 3], [4, 5, 6, 7]), ([8, 9], [10, 11]), ([12], [13, 14, 15, 16, 17])]


def settings(w: WeightPhaseConfig) -> tuple:
    return w.learning_rate, w.warmup_steps, w.max_grad_norm, w.precision


def test_the_embedded_policy_keeps_the_settings_its_results_were_made_with(tiny_policy):
    assert describe_checkpoint(tiny_policy).embedded and describe_checkpoint(None).embedded
    for use_gpu in (False, True):
        w = resolve_weight_phase(WeightPhaseConfig(use_gpu=use_gpu), describe_checkpoint(tiny_policy))
        assert settings(w) == (3e-4, 0, 1.0, "float32")


def test_a_real_checkpoint_gets_a_rate_for_its_size_and_bf16_on_a_gpu(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    facts = describe_checkpoint(tiny_model)  # a plain Hugging Face directory: no whale build record
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).parameters())
    assert not facts.embedded and facts.n_params == n  # read from the safetensors header alone
    assert settings(resolve_weight_phase(WeightPhaseConfig(), facts)) == (1e-5, 5, 1.0, "float32")
    assert settings(resolve_weight_phase(WeightPhaseConfig(use_gpu=True), facts)) == (1e-5, 5, 1.0, "bfloat16")
    two_b = CheckpointFacts(embedded=False, n_params=2_000_000_000)  # Qwen3.5-2B's band: the reference's 1e-6
    assert resolve_weight_phase(WeightPhaseConfig(), two_b).learning_rate == 1e-6
    unknown = CheckpointFacts(embedded=False, n_params=None)
    assert resolve_weight_phase(WeightPhaseConfig(), unknown).learning_rate == 1e-6
    given = WeightPhaseConfig(learning_rate=3e-4, warmup_steps=0, max_grad_norm=0.5, precision="float32", use_gpu=True)
    assert settings(resolve_weight_phase(given, facts)) == (3e-4, 0, 0.5, "float32")  # what the user sets stays


def test_the_size_comes_from_config_json_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, '
        '"num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "tie_word_embeddings": true}')
    assert describe_checkpoint(tmp_path).n_params == 134_479_872  # SmolLM2-135M: 134,515,008 with its norms


def test_a_run_records_what_it_chose_and_a_resume_keeps_it(tmp_path, tiny_model):
    cfg = small_config(tmp_path / "run", **{"policy.model": str(tiny_model)})
    resolved = resolve_run_config(cfg, tiny_model)
    RunDirectory(cfg.run_dir).create(resolved)
    recorded = yaml.safe_load((cfg.run_dir / "config.yaml").read_text())["weight"]
    assert (recorded["learning_rate"], recorded["warmup_steps"], recorded["precision"]) == (1e-5, 5, "float32")

    run = RunDirectory(cfg.run_dir)
    assert run.config_conflicts(cfg) == []  # left unset on relaunch: the run's own values
    cfg.weight.learning_rate = 1e-5
    assert run.config_conflicts(cfg) == []  # set to what the run has
    cfg.weight.learning_rate = 3e-4
    assert run.config_conflicts(cfg) == ["weight.learning_rate: 1e-05 -> 0.0003"]
    # a later whale-ray may choose otherwise for this checkpoint: a resumed run still trains as it began
    (cfg.run_dir / "config.yaml").write_text(dump_config(resolve_run_config(cfg, tiny_model)).replace(
        "learning_rate: 0.0003", "learning_rate: 2.0e-05"))
    cfg.weight.learning_rate = None
    assert resolve_run_config(cfg, tiny_model, run.recorded_config()).weight.learning_rate == 2e-5


def test_a_config_from_before_the_keys_resumes_with_what_it_trained_with(tmp_path):
    old = dump_config(load_config(None, {"run_dir": str(tmp_path)})).replace(f"config_version: {CONFIG_VERSION}",
                                                                             "config_version: 2")
    tree = yaml.safe_load(old)
    for key in ("learning_rate", "warmup_steps", "max_grad_norm", "precision"):
        tree["weight"].pop(key)
    tree["weight"]["learning_rate"] = 3e-4  # every earlier run wrote its rate
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tree))
    w = RunDirectory(tmp_path).recorded_config().weight
    assert settings(w) == (3e-4, 0, 1.0, "float32")


def test_warm_up_ramps_the_rate_over_the_first_updates_and_goes_on_after_a_resume(tiny_model, tmp_path):
    a = RSFTLearner(tiny_model, lr=1e-3, micro_batch=2, warmup_steps=4, epochs_per_step=2)
    m = a.train_step(EXAMPLES)
    assert m["updates"] == 2 and m["lr"] == pytest.approx(1e-3 * 2 / 4)  # the step's last update: the 2nd of 4
    a.save(tmp_path / "ckpt")
    b = RSFTLearner(tiny_model, lr=1e-3, micro_batch=2, warmup_steps=4, epochs_per_step=2)
    b.load(tmp_path / "ckpt")
    assert b.updates == 2
    assert [b.train_step(EXAMPLES)["lr"], b.train_step(EXAMPLES)["lr"]] == pytest.approx([1e-3, 1e-3])
    assert b.updates == 6


def test_the_gradient_norm_is_reported_before_clipping(tiny_model):
    loose = RSFTLearner(tiny_model, lr=1e-3, micro_batch=2, max_grad_norm=1e6).train_step(EXAMPLES)
    tight = RSFTLearner(tiny_model, lr=1e-3, micro_batch=2, max_grad_norm=1e-3).train_step(EXAMPLES)
    assert tight["grad_norm"] == pytest.approx(loose["grad_norm"], rel=1e-5) and tight["grad_norm"] > 1e-3
    assert tight["clipped"] and not loose["clipped"] and tight["max_grad_norm"] == 1e-3


def test_bf16_autocast_trains_float32_weights(tiny_model):
    import torch

    lrn = RSFTLearner(tiny_model, lr=1e-2, micro_batch=2, precision="bfloat16")
    before = lrn.evaluate_loss(EXAMPLES)
    m = lrn.train_step(EXAMPLES)
    assert m["precision"] == "bfloat16" and math.isfinite(m["loss"]) and lrn.evaluate_loss(EXAMPLES) < before
    assert all(p.dtype == torch.float32 for p in lrn.model.parameters())
