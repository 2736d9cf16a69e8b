"""Reading converted checkpoints from the Hugging Face Hub through huggingface_hub's cache.

    model = torch_mhc.hf.from_pretrained("me/llama-mhc")   # downloaded (or cached), then loaded

A repository's files are fetched whole with `snapshot_download` before anything is read, so
loading checks the same files in the same order as for a local folder; offline
(HF_HUB_OFFLINE=1 or local_files_only=True) the cache alone is used. Uploading is
checkpoint.push_to_hub: the folder save_pretrained writes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["HUB_KWARGS", "is_repo_id", "resolve_folder"]

# from_pretrained's keyword arguments that say where and how to download, not what to build
HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "proxies")
# "name" or "owner/name": letters, digits, "-", "_", "."; no "..", no leading "." or "-"
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def is_repo_id(path: str | os.PathLike) -> bool:
    """A string that names a Hub repository and no existing local path."""
    text = os.fspath(path)
    return (isinstance(path, str) and bool(_REPO_ID.match(text)) and ".." not in text
            and not Path(text).exists())


def resolve_folder(repo_id: str, kwargs: dict) -> tuple[Path, dict]:
    """(the local snapshot folder of repo_id, kwargs without the download options)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    hub = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    rest = {k: v for k, v in kwargs.items() if k not in HUB_KWARGS}
    try:
        folder = snapshot_download(repo_id, repo_type="model", **hub)
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(
            f"{repo_id!r} is neither a local folder nor a Hub repository that can be read here "
            f"({first})"
        ) from None
    return Path(folder), rest
