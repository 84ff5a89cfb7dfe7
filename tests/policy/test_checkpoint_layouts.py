"""Checkpoints of the layouts whale-ray takes (Llama, Qwen2, Qwen3, Gemma 3; tied and untied heads) through the CPU
path a run takes: the up-front check, TransformersEngine, one RSFT step, its saved checkpoint and an in-place reload
that answers as a fresh load of it. Small random models of each layout (no hub), with the embedded policy's
tokenizer and chat template; SmolLM2 (tests/policy/test_real_model.py) is the real Llama one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from whale_ray.policy.checkpoint import check_checkpoint
from whale_ray.policy.engine import GenerationRequest
from whale_ray.policy.transformers_engine import TransformersEngine
from whale_ray.records import SamplingParams
from whale_ray.rsft import RSFTLearner

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256}


def layout_config(name: str, vocab: int, eos: int, pad: int):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = {**SMALL, "vocab_size": vocab, "eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None}
    return {
        "llama-tied": lambda: LlamaConfig(**common, tie_word_embeddings=True),
        "llama-untied": lambda: LlamaConfig(**common, tie_word_embeddings=False),
        "qwen2-untied": lambda: Qwen2Config(**common, tie_word_embeddings=False),
        "qwen3-tied": lambda: Qwen3Config(**common, tie_word_embeddings=True),
        "gemma3-tied": lambda: Gemma3TextConfig(**common, sliding_window=64, query_pre_attn_scalar=16),
    }[name]()


@pytest.mark.parametrize("layout", ["llama-tied", "llama-untied", "qwen2-untied", "qwen3-tied", "gemma3-tied"])
def test_a_layout_loads_trains_and_reloads_as_a_fresh_load(layout, tiny_policy, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_policy)
    cfg = layout_config(layout, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    path = tmp_path / layout
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    check_checkpoint(path)
    tied = json.loads((path / "config.json").read_text()).get("tie_word_embeddings", cfg.tie_word_embeddings)
    assert bool(tied) == layout.endswith("-tied")

    engine = TransformersEngine(path, device="cpu")
    chat = [{"role": "system", "content": "Solve the problem."}, {"role": "user", "content": "What is 2 + 3?"}]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    out = engine.generate([GenerationRequest(chat, greedy)])[0]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert out.completion_ids and out.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]

    learner = RSFTLearner(str(path), lr=1e-3, micro_batch=4)
    example = (out.prompt_ids, tokenizer("2 + 3 = 5. \\boxed{5}", add_special_tokens=False)["input_ids"]
               + [tokenizer.eos_token_id])
    metrics = learner.train_step([example])
    assert metrics["trained"] and learner.evaluate_loss([example]) < metrics["loss"]
    saved = learner.save(tmp_path / "v00001")
    engine.load_weights(learner.state_dict(), 1)
    probes = [GenerationRequest(chat, greedy), GenerationRequest([{"role": "user", "content": "Hi"}], greedy)]
    reloaded, fresh = engine.generate(probes), TransformersEngine(saved, device="cpu").generate(probes)
    assert [o.weight_version for o in reloaded] == [1, 1]
    assert [(o.completion_ids, o.logprobs) for o in reloaded] == [(o.completion_ids, o.logprobs) for o in fresh]
    if layout.endswith("-tied"):  # the head is the embedding after training and after the reload
        assert engine.model.lm_head.weight.data_ptr() == engine.model.get_input_embeddings().weight.data_ptr()
    shutil.rmtree(saved)
    assert not any(Path(tmp_path).glob("v00001"))
