"""Hugging Face Hub ids as models and heads: `ORG/NAME`, where no local path of that name exists, resolved by
`hub_folder` to its snapshot folder in huggingface_hub's cache (`HF_HUB_CACHE`), downloading only the files a model
or heads folder needs. Offline (`HF_HUB_OFFLINE=1`, or the Hub unreachable after one quick try), a repository that
is not cached is one `HubError` at once."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")
HEADS_FILES = ("*.json", "*.safetensors", "*.pt", "*.bin")
_TRUE = ("1", "true", "yes", "on")


class HubError(FileNotFoundError):
    """A Hub id that cannot be resolved here (not cached and offline, unreachable, or no such repository)."""


def is_hub_id(arg: str | os.PathLike) -> bool:
    """`ORG/NAME` that is not an existing local path (a local folder of that name wins)."""
    text = str(arg)
    return bool(_HUB_ID.match(text)) and not text.endswith((".json", ".jsonl")) and not Path(text).exists()


def offline() -> bool:
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def cache_dir() -> str | None:
    """HF_HUB_CACHE (or HUGGINGFACE_HUB_CACHE), read now: None lets huggingface_hub use HF_HOME's default."""
    return os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or None


def cached_folder(repo_id: str, repo_type: str = "model") -> Path | None:
    """The cached snapshot of `repo_id` (its refs/main), or None; never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, cache_dir=cache_dir(), local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def reachable(timeout: float = 3.0) -> bool:
    """One TCP connection to the Hub's endpoint (no retries): False at once on a machine without a network."""
    url = urlparse(endpoint())
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout):
            return True
    except OSError:
        return False


def check_online(what: str) -> None:
    """Raises HubError unless the Hub may be and can be reached: for `what` (e.g. 'model foo/bar')."""
    if offline():
        raise HubError(f"{what} is not in the Hugging Face cache ({cache_dir() or 'the default HF_HOME cache'}) and "
                       f"HF_HUB_OFFLINE is set: download it once online, or give a local folder")
    if not reachable():
        raise HubError(f"{what} is not in the Hugging Face cache and the Hub ({endpoint()}) cannot be reached: "
                       f"download it once online, set HF_HUB_CACHE to a cache that holds it, or give a local folder")


def hub_folder(repo_id: str, kind: str = "model") -> Path:
    """The local folder of Hub repository `repo_id` (kind 'model' or 'heads'): cached, else downloaded."""
    folder = cached_folder(repo_id)
    if folder is not None:
        return folder
    check_online(f"{kind} {repo_id}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    patterns = list(MODEL_FILES if kind == "model" else HEADS_FILES)
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir(), allow_patterns=patterns))
    except RepositoryNotFoundError:
        raise HubError(f"{kind} {repo_id}: no such local folder, and no such (public) Hub repository") from None
    except (HfHubHTTPError, OSError) as e:
        raise HubError(f"{kind} {repo_id}: download from the Hub failed ({str(e).splitlines()[0]})") from None
