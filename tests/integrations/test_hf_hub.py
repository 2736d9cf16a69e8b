"""torch_mhc.hf and the Hub, offline: from_pretrained reads a repository id through
huggingface_hub's cache (a cache laid out here as the Hub client lays it out), and push_to_hub
uploads exactly the folder save_pretrained writes (the upload itself replaced by a recorder)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

import transformers  # noqa: E402
from huggingface_hub import HfApi  # noqa: E402

import torch_mhc.hf as mhc_hf  # noqa: E402
from tests.helpers.hf_cases import COMMON, batch, logits, perturb_connections  # noqa: E402

REVISION = "0123456789abcdef0123456789abcdef01234567"


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def converted():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval()
    mhc_hf.convert(model, "mhc", streams=2)
    perturb_connections(model)
    return model


def cache_with(folder: Path, cache: Path, repo_id: str) -> None:
    """The cache the Hub client leaves after downloading repo_id at its main branch."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)


def test_from_pretrained_reads_a_repository_from_the_cache(converted, tmp_path):
    saved = mhc_hf.save_pretrained(converted, tmp_path / "saved")
    cache_with(saved, tmp_path / "cache", "me/tiny-mhc")
    model = mhc_hf.from_pretrained("me/tiny-mhc", cache_dir=tmp_path / "cache",
                                   local_files_only=True)
    ids, mask = batch()
    assert torch.equal(logits(model, ids, mask), logits(converted, ids, mask))
    assert model.config.mhc_conversion["kind"] == "mhc"
    # the download options went to the download, not to the model
    assert not hasattr(model.config, "cache_dir")


def test_a_repository_that_cannot_be_read_is_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="'me/absent' is neither a local folder nor a "
                       "Hub repository that can be read here") as info:
        mhc_hf.from_pretrained("me/absent", cache_dir=tmp_path, local_files_only=True)
    assert "\n" not in str(info.value)
    # a path that exists is never taken for a repository id
    (tmp_path / "me").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        mhc_hf.from_pretrained(str(tmp_path / "me"))


def test_push_to_hub_uploads_what_save_pretrained_writes(converted, tmp_path, monkeypatch):
    calls = {}

    def create_repo(self, repo_id, **kwargs):
        calls["repo"] = (repo_id, kwargs.get("private"), kwargs.get("exist_ok"))

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        calls["upload"] = (repo_id, digest(Path(folder_path)), kwargs.get("commit_message"))
        return "commit-info"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    assert mhc_hf.push_to_hub(converted, "me/tiny-mhc", private=True) == "commit-info"
    saved = mhc_hf.save_pretrained(converted, tmp_path / "saved")
    assert calls["repo"] == ("me/tiny-mhc", True, True)
    repo_id, uploaded, message = calls["upload"]
    assert repo_id == "me/tiny-mhc" and uploaded == digest(saved)
    assert {"config.json", "mhc_connections.safetensors", "modeling_torch_mhc.py",
            "connections.py"} <= set(uploaded)
    assert "torch-mhc" in message
