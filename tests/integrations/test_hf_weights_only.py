"""torch_mhc.hf.make_portable: weight files written by another tool, made a portable folder.

A converted model's state dict is written as plain transformers weight files (as torchtitan's
HF export writes them: the connections among the base model's tensors, no config.json), then
made portable with the base model's config.json: torch_mhc.hf.from_pretrained and
transformers (trust_remote_code=True) load it with the converted model's logits, exactly (the
same tensors, the same code). Weights that are not the described model's are refused in one
line, and nothing is written.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import safetensors.torch  # noqa: E402

import torch_mhc.hf as mhc_hf  # noqa: E402
from tests.helpers.hf_cases import COMMON, batch, logits, perturb_connections  # noqa: E402
from torch_mhc.integrations.hf.checkpoint import CONNECTIONS_FILE  # noqa: E402


def _converted(tie: bool = False, kind: str = "mhc", streams: int = 3, **options):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**COMMON, tie_word_embeddings=tie)
    model = transformers.LlamaForCausalLM(config).eval()
    mhc_hf.convert(model, kind, streams, **options)
    perturb_connections(model)
    return model


def _weights_only(model, folder: Path, shards: bool = False) -> Path:
    """The model's tensors as another trainer's HF export writes them: weight files only, the
    tied lm_head left out, in two shards with an index or one file."""
    folder.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    if not shards:
        safetensors.torch.save_file(state, str(folder / "model.safetensors"))
        return folder
    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in halves.items():
        safetensors.torch.save_file({k: state[k] for k in part}, str(folder / name))
    index = {"metadata": {}, "weight_map": {k: n for n, part in halves.items() for k in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _base_config(model, folder: Path) -> Path:
    """The base model's config.json, as its hub folder holds it."""
    values = {k: v for k, v in model.config.to_dict().items() if k != mhc_hf.CONFIG_KEY}
    transformers.LlamaConfig(**values).save_pretrained(folder)
    return folder / "config.json"


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("tie, shards", [(False, False), (True, True)])
def test_weights_made_portable_load_as_the_converted_model(tmp_path, tie, shards):
    model = _converted(tie=tie, sinkhorn_iters=7)
    folder = _weights_only(model, tmp_path / "export", shards=shards)
    weights = _digest(folder)
    config = _base_config(model, tmp_path / "base")
    assert mhc_hf.make_portable(folder, config, kind="mhc", streams=3,
                                sinkhorn_iters=7) == folder
    written = _digest(folder)
    assert {k: written[k] for k in weights} == weights  # the weights are not rewritten
    assert {"config.json", CONNECTIONS_FILE, "modeling_torch_mhc.py"} <= set(written)
    record = json.loads((folder / "config.json").read_text())
    assert record["model_type"] == "torch_mhc"
    assert record["mhc_conversion"]["options"] == {"sinkhorn_iters": 7}
    assert record["base_config"]["architectures"] == ["LlamaForCausalLM"]

    ids, mask = batch()
    ref = logits(model, ids, mask)
    library = mhc_hf.from_pretrained(folder)
    assert torch.equal(logits(library, ids, mask), ref)
    remote = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert torch.equal(logits(remote.eval(), ids, mask), ref)
    # made portable again (a second export into the same folder): the same files
    mhc_hf.make_portable(folder, config.parent, kind="mhc", streams=3, sinkhorn_iters=7)
    assert _digest(folder) == written


def _plain_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))


BAD = {
    "other streams": (dict(kind="mhc", streams=4), None,
                      r"not those of LlamaForCausalLM converted with kind='mhc', streams=4 "
                      r"\(from the base config\): model\.layers\.0\.mhc_attn\.b_post has "
                      r"shape \(3,\), expected \(4,\); .* \(and 10 more\); the weights' "
                      r"model\.layers\.0\.mhc_attn holds alpha \(3,\), b_post \(3,\), "
                      r"b_pre \(3,\), b_res \(3, 3\), phi \(96, 15\)\. Pass the base"),
    "other kind": (dict(kind="hc", streams=3), None,
                   r"kind='hc'.*missing model\.layers\.0\.mhc_attn\.s_alpha"),
    "other base": (dict(kind="mhc", streams=3), {"num_hidden_layers": 1},
                   r"unexpected model\.layers\.1\."),
    "unconverted weights": (dict(kind="mhc", streams=3), "plain",
                            r"hold no connection tensors"),
    "unknown option": (dict(kind="mhc", streams=3, sinkhorn_iter=7), None,
                       r"unknown connection option\(s\) \['sinkhorn_iter'\]"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_weights_of_another_model_are_refused_and_nothing_is_written(tmp_path, name):
    conversion, change, message = BAD[name]
    model = _converted()
    source = _plain_llama() if change == "plain" else model
    folder = _weights_only(source, tmp_path / "export")
    config = _base_config(model, tmp_path / "base")
    if isinstance(change, dict):
        values = {**json.loads(config.read_text()), **change}
        config.write_text(json.dumps(values))
    before = _digest(folder)
    with pytest.raises(ValueError, match=message) as err:
        mhc_hf.make_portable(folder, config, **conversion)
    assert "\n" not in str(err.value)
    assert _digest(folder) == before and not any(p.is_dir() for p in folder.iterdir())


def test_bad_paths_are_named(tmp_path):
    model = _converted()
    folder = _weights_only(model, tmp_path / "export")
    with pytest.raises(FileNotFoundError, match=r"nope: no such folder; make_portable expects"):
        mhc_hf.make_portable(tmp_path / "nope", tmp_path, kind="mhc", streams=3)
    with pytest.raises(NotADirectoryError, match=r"model\.safetensors is a file; make_portable "
                                                 r"expects the folder"):
        mhc_hf.make_portable(folder / "model.safetensors", tmp_path, kind="mhc", streams=3)
    with pytest.raises(TypeError, match=r"base_config must be a transformers PretrainedConfig, "
                                        r"the path .*; got dict"):
        mhc_hf.make_portable(folder, {"model_type": "llama"}, kind="mhc", streams=3)
    with pytest.raises(FileNotFoundError, match=r"a folder without config\.json"):
        mhc_hf.make_portable(folder, tmp_path, kind="mhc", streams=3)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty holds no model\.safetensors or "
                                                r"model\.safetensors\.index\.json \(it holds "
                                                r"\[\]\)"):
        mhc_hf.make_portable(tmp_path / "empty", tmp_path, kind="mhc", streams=3)
    portable = mhc_hf.save_pretrained(model, tmp_path / "saved")
    with pytest.raises(ValueError, match=r"is a converted checkpoint's config; expected the "
                                         r"base model's"):
        mhc_hf.make_portable(folder, portable / "config.json", kind="mhc", streams=3)


def test_a_folder_recording_another_conversion_is_refused(tmp_path):
    """A portable folder records its conversion, options included, and its base config,
    which the weights cannot show (sinkhorn_iters, the rotary base): made portable again, it
    takes the same ones only."""
    model = _converted(sinkhorn_iters=7)
    folder = mhc_hf.save_pretrained(model, tmp_path / "saved")
    config = _base_config(model, tmp_path / "base")
    before = _digest(folder)
    with pytest.raises(ValueError, match=r"config\.json already records the conversion "
                                         r"\{.*'sinkhorn_iters': 7.*\}; got \{'kind': 'mhc', "
                                         r"'streams': 3, 'options': \{\}\}"):
        mhc_hf.make_portable(folder, config, kind="mhc", streams=3)
    assert _digest(folder) == before
    other = json.loads(config.read_text())
    other["rope_parameters"]["rope_theta"] = 500.0
    (tmp_path / "other").mkdir()
    (tmp_path / "other/config.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match=r"config\.json already records another base config: "
                                         r"rope_parameters is \{.*'rope_theta': 10000\.0.*\} "
                                         r"there, \{.*'rope_theta': 500\.0.*\} in the one given"):
        mhc_hf.make_portable(folder, tmp_path / "other", kind="mhc", streams=3,
                             sinkhorn_iters=7)
    assert _digest(folder) == before
    mhc_hf.make_portable(folder, config, kind="mhc", streams=3, sinkhorn_iters=7)
    ids, mask = batch()
    assert torch.equal(logits(mhc_hf.from_pretrained(folder), ids, mask),
                       logits(model, ids, mask))


def test_the_residual_kind_has_no_connection_tensors_to_find(tmp_path):
    """A model converted to the residual kind (one stream, no parameters) is made portable
    as well: its connections' file is empty, as save_pretrained writes it."""
    model = _converted(kind="residual", streams=1, check_finite=True)
    folder = _weights_only(model, tmp_path / "export")
    mhc_hf.make_portable(folder, _base_config(model, tmp_path / "base"), kind="residual",
                         streams=1, check_finite=True)
    ids, mask = batch()
    loaded = mhc_hf.from_pretrained(folder)
    assert loaded.config.mhc_conversion["options"] == {"check_finite": True}
    assert torch.equal(logits(loaded, ids, mask), logits(model, ids, mask))
