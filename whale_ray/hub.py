"""A checkpoint named by its Hugging Face hub id: `--model Qwen/Qwen3-1.7B` is the snapshot of that model that the
local hub cache holds (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub; refs/main names it), found by
huggingface_hub's own offline lookup. Nothing is downloaded: a run never waits on the network, and a cluster's nodes
read the same files. A local directory of the same name wins over the hub id. Outside whale_ray.policy, whose
package imports torch: the config resolves an id here.
"""

from __future__ import annotations

from pathlib import Path


def hub_id(model: Path | str) -> str | None:
    """`model` as a hub id ("ORG/NAME", or a bare "NAME"), when it can be one and no local path has that name."""
    text = str(model)
    if text.startswith((".", "~", "/")) or Path(text).exists():
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return None
    return text


def cached_snapshot(repo_id: str) -> Path | None:
    """The local cache's snapshot of the model `repo_id` (its main revision), or None when the cache has none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        return None


def resolve_model(model: Path) -> Path:
    """The cached snapshot when `model` is a hub id the cache holds, else `model` as it is (a local directory, or a
    name that check_checkpoint_dir then refuses, saying how to get it)."""
    repo = hub_id(model)
    return (cached_snapshot(repo) if repo else None) or model


def not_cached(repo_id: str) -> str:
    """Why a hub id is no checkpoint here and how to make it one, for the end of a one-line error."""
    from huggingface_hub import constants

    return (f"no such directory, and the Hugging Face hub cache {constants.HF_HUB_CACHE} holds no model {repo_id} "
            f"(whale-ray never downloads: on a machine with internet run `hf download {repo_id}` (older "
            f"huggingface_hub: `huggingface-cli download {repo_id}`) and bring that cache here, with HF_HUB_CACHE "
            "pointing at it; or point --model at a checkpoint directory)")
