"""`--model ORG/NAME`: a Hugging Face hub id resolves to the snapshot the local hub cache holds, offline, for every
command (the config, the up-front check, serve, study), and the run's config.yaml records the snapshot; an id the
cache lacks is one line naming the id, the cache and how to get it there. The cache is made here: a small random
checkpoint saved with transformers into the hub's layout (models--ORG--NAME/refs/main, snapshots/<rev>/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from whale_ray.config import dump_config, load_config
from whale_ray.hub import hub_id
from whale_ray.policy.checkpoint import CheckpointError, check_checkpoint
from whale_ray.study import model_override

REPO = "tiny-org/Tiny-Qwen3"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def save_tiny_checkpoint(path: Path) -> None:
    """A random Qwen3 with a word-level tokenizer, a chat template and an eos: what check_checkpoint asks for."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    words = ["<pad>", "<eos>", "<unk>", "what", "is", "2", "+", "3", "?", "5"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>",
                                        unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    config = Qwen3Config(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, eos_token_id=1, pad_token_id=0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("hub")
    model = cache / f"models--{REPO.replace('/', '--')}"
    save_tiny_checkpoint(model / "snapshots" / REVISION)
    (model / "refs").mkdir()
    (model / "refs" / "main").write_text(REVISION)
    return cache


@pytest.fixture
def in_cache(hub_cache, monkeypatch, tmp_path) -> Path:
    """HF_HUB_CACHE pointed at the made cache (huggingface_hub reads it at import: its constant too), run from an
    empty folder; the snapshot's path."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.chdir(tmp_path)
    return hub_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / REVISION


def test_a_cached_hub_id_is_its_snapshot_for_the_check_and_the_config(in_cache, tmp_path):
    assert check_checkpoint(REPO) == in_cache
    cfg = load_config(None, {"policy.model": REPO})
    assert cfg.policy.model == in_cache
    assert f"model: {in_cache}" in dump_config(cfg)  # what the run's config.yaml records: the revision pinned
    assert load_config(None, {"policy.model": str(in_cache)}).policy.model == in_cache  # a resume reads it back
    assert model_override(Path(REPO)) == REPO  # a study's pairs resolve it in their own configs


def test_a_local_directory_of_the_same_name_wins(in_cache, tmp_path):
    local = tmp_path / REPO
    save_tiny_checkpoint(local)
    assert hub_id(REPO) is None
    assert check_checkpoint(REPO) == Path(REPO)
    assert load_config(None, {"policy.model": REPO}).policy.model == Path(REPO)
    assert model_override(Path(REPO)) == str(local)


def test_serve_takes_a_hub_id(in_cache):
    from whale_ray.serve.start import SERVE_FLAGS, endpoint_spec

    spec = endpoint_spec(None, Path(REPO), "math_reasoning", None, None, dict.fromkeys(SERVE_FLAGS),
                         base_model=lambda cfg: "unused")
    assert [m.path for m in spec.models] == [str(in_cache)]


def test_a_missing_hub_id_is_one_line_saying_how_to_get_it(in_cache, hub_cache):
    with pytest.raises(CheckpointError) as e:
        check_checkpoint("nobody/No-Such-Model")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("policy checkpoint nobody/No-Such-Model: no such directory, and the Hugging Face hub "
                              f"cache {hub_cache} holds no model nobody/No-Such-Model")
    assert "`hf download nobody/No-Such-Model`" in message and "point --model at a checkpoint directory" in message
    assert load_config(None, {"policy.model": "nobody/No-Such-Model"}).policy.model == Path("nobody/No-Such-Model")
    with pytest.raises(CheckpointError, match=r"policy checkpoint /no/such/dir: no such directory$"):
        check_checkpoint("/no/such/dir")  # a path is no hub id

