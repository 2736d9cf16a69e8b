"""torch_mhc.hf.save_pretrained / from_pretrained: what a save leaves in its folder, the
connections' own file, the model class, device maps and bad input.

Tiny models (hidden 32, 2 layers) with random weights drawn at initializer_range 0.2 and
perturbed connections, so that a wrong or missing tensor shows in the logits; nothing is
downloaded.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch_mhc.hf as mhc_hf  # noqa: E402
from tests.helpers.hf_cases import COMMON  # noqa: E402
from tests.helpers.hf_cases import batch as _batch  # noqa: E402
from tests.helpers.hf_cases import logits as _logits  # noqa: E402
from tests.helpers.hf_cases import perturb_connections as _perturb_connections  # noqa: E402
from torch_mhc.integrations.hf.checkpoint import CONNECTIONS_FILE  # noqa: E402
from torch_mhc.integrations.hf.portable import CODE_FILES  # noqa: E402


def _converted(cls=transformers.LlamaForCausalLM, config=None, seed: int = 0, streams: int = 3):
    torch.manual_seed(seed)
    model = cls(config or transformers.LlamaConfig(**COMMON)).eval()
    mhc_hf.convert(model, "mhc", streams=streams)
    _perturb_connections(model)
    return model


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _keys(file: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as st:
        return set(st.keys())


# ------------------------------------------------------------------------------------------
# What a save leaves in its folder


def test_save_keeps_other_files_and_removes_stale_weights(tmp_path):
    model = _converted()
    ids, mask = _batch()
    ref = _logits(model, ids, mask)
    folder = tmp_path / "ckpt"
    mhc_hf.save_pretrained(model, folder, max_shard_size="20KB")
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    (folder / "README.md").write_text("# my model\n")
    (folder / "notes").mkdir()
    (folder / "notes" / "run.txt").write_text("lr 1e-4\n")

    assert mhc_hf.save_pretrained(model, folder) == folder  # one file now: the shards go
    assert sorted(p.name for p in folder.iterdir()) == sorted([
        "README.md", "config.json", "generation_config.json", CONNECTIONS_FILE,
        "model.safetensors", "notes", "tokenizer.json", *CODE_FILES])
    assert (folder / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (folder / "README.md").read_text() == "# my model\n"
    assert (folder / "notes" / "run.txt").read_text() == "lr 1e-4\n"
    assert torch.equal(_logits(mhc_hf.from_pretrained(folder), ids, mask), ref)


def test_new_folder_gets_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        folder = mhc_hf.save_pretrained(_converted(), tmp_path / "runs" / "ckpt")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert stat.S_IMODE((folder / CONNECTIONS_FILE).stat().st_mode) == 0o644
    assert stat.S_IMODE((folder / "model.safetensors").stat().st_mode) == 0o644


def test_save_into_the_working_directory_and_relative_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('train')\n")
    model = _converted()
    ids, mask = _batch()
    ref = _logits(model, ids, mask)

    assert mhc_hf.save_pretrained(model, ".") == Path(".")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        "config.json", "generation_config.json", CONNECTIONS_FILE, "model.safetensors",
        "train.py", *CODE_FILES])  # no temporary folder left, the user's file kept
    assert (tmp_path / "train.py").read_text() == "print('train')\n"
    assert torch.equal(_logits(mhc_hf.from_pretrained("."), ids, mask), ref)

    mhc_hf.save_pretrained(model, "runs/ckpt")
    assert torch.equal(_logits(mhc_hf.from_pretrained("runs/ckpt"), ids, mask), ref)


def test_failed_save_changes_nothing(tmp_path, monkeypatch):
    model = _converted()
    folder = mhc_hf.save_pretrained(model, tmp_path / "ckpt")
    (folder / "tokenizer.json").write_text("{}")
    before = _files(folder)

    def broken(self, path, **kwargs):  # transformers' save, failing half-way
        (Path(path) / "config.json").write_text("{half")
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        mhc_hf.save_pretrained(model, folder)
    assert _files(folder) == before
    assert sorted(p.name for p in folder.iterdir()) == sorted(before)  # no temporary folder
    with pytest.raises(OSError, match="disk full"):
        mhc_hf.save_pretrained(model, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the new folder is gone


def test_failure_among_the_renames_leaves_whole_files(tmp_path, monkeypatch):
    """A failure while the files are renamed into place (what a crash at that moment would
    leave): each file is the old one or the new one, complete, and no temporary folder stays."""
    model = _converted()
    folder = mhc_hf.save_pretrained(model, tmp_path / "ckpt")
    old = _files(folder)
    _perturb_connections(model, seed=9)
    new = _files(mhc_hf.save_pretrained(model, tmp_path / "reference"))
    assert old[CONNECTIONS_FILE] != new[CONNECTIONS_FILE]

    replace, calls = os.replace, []

    def replace_once(src, dst):
        if Path(dst).parent == folder:  # the renames into the checkpoint folder
            calls.append(dst)
        if len(calls) == 2:
            raise OSError("interrupted")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_once)
    with pytest.raises(OSError, match="interrupted"):
        mhc_hf.save_pretrained(model, folder)
    monkeypatch.undo()
    now = _files(folder)
    assert sorted(p.name for p in folder.iterdir()) == sorted(old)
    renamed = Path(calls[0]).name  # the one rename before the failure
    assert now[renamed] == new[renamed]
    assert all(now[name] == old[name] for name in now if name != renamed)


def test_save_checks_the_keys_written(tmp_path, monkeypatch):
    import safetensors.torch

    model = _converted()
    folder = mhc_hf.save_pretrained(model, tmp_path / "ckpt")
    before = _files(folder)
    save_file = safetensors.torch.save_file

    def dropping(tensors, filename, metadata=None):  # a writer that loses a tensor
        if filename.endswith(CONNECTIONS_FILE):
            tensors = {k: v for k, v in tensors.items() if k != "model.layers.1.mhc_mlp.phi"}
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", dropping)
    with pytest.raises(ValueError, match=r"mhc_connections.safetensors was written without the "
                                         r"connection tensors \['model.layers.1.mhc_mlp.phi'\]"):
        mhc_hf.save_pretrained(model, folder)
    assert _files(folder) == before


def test_a_state_dict_without_the_connections_is_refused(tmp_path, monkeypatch):
    """save_pretrained(state_dict=...) of a converted model must hold its connections'
    tensors, each of them: without them the folder saved would not load (its connections'
    file empty or short). The check does not call model.state_dict() (under FSDP that
    gathers, and only the main process saves)."""
    model = _converted()
    folder = mhc_hf.save_pretrained(model, tmp_path / "ckpt")
    before = _files(folder)
    full = model.state_dict()
    monkeypatch.setattr(model, "state_dict", lambda *a, **k: pytest.fail("state_dict called"))
    cases = {
        r"10 of 20 missing \(e\.g\. \['model\.layers\.0\.mhc_mlp\.alpha', ": {
            k: v for k, v in full.items() if ".mhc_mlp." not in k},
        r"4 of 20 missing \(e\.g\. \['model\.layers\.0\.mhc_attn\.alpha', ": {
            k: v for k, v in full.items() if not k.endswith(".alpha")},
        r"0 of 20 missing \(e\.g\. \[\]\), 1 not the model's \(e\.g\. \['model\.layers\."
        r"0\.mhc_attn\.extra'\]\)": {**full, "model.layers.0.mhc_attn.extra": full[
            "model.layers.0.mhc_attn.alpha"]},
    }
    for message, state in cases.items():
        for save in (model.save_pretrained,
                     lambda path, **kw: mhc_hf.save_pretrained(model, path, **kw)):
            with pytest.raises(ValueError, match=r"the state_dict passed to save_pretrained "
                                                 r"does not hold the model's connection "
                                                 r"tensors: " + message + r".*nothing was saved"):
                save(folder, state_dict=state)
            assert _files(folder) == before
    # the whole state dict given: saved, without calling model.state_dict()
    model.save_pretrained(folder, state_dict=full)


# ------------------------------------------------------------------------------------------
# The connections' own file


FAMILIES = {  # the converter's families whose keys transformers saves as they are
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**COMMON)),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig(**COMMON)),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**COMMON)),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**COMMON, head_dim=8)),
    "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=COMMON["vocab_size"], n_embd=32, n_layer=2, n_head=4, n_positions=64)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_weight_files_hold_the_connections(tmp_path, family):
    """Tools that load transformers' weight files back into a converted model restore the
    connections with the rest: transformers.Trainer resuming a checkpoint reads
    model.safetensors, or every file its index names (one file, and sharded)."""
    from safetensors.torch import load_file
    from transformers.trainer_utils import load_sharded_checkpoint

    cls, config = FAMILIES[family]
    model = _converted(cls, config)
    want = {k: v for k, v in model.state_dict().items() if ".mhc_" in k}
    for name, kwargs in (("single", {}), ("sharded", {"max_shard_size": "20KB"})):
        folder = mhc_hf.save_pretrained(model, tmp_path / name, **kwargs)
        fresh = _converted(cls, config, seed=1)
        if name == "single":
            result = fresh.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
        else:
            assert (folder / "model.safetensors.index.json").is_file()
            result = load_sharded_checkpoint(fresh, folder, strict=False)
        assert not result.unexpected_keys and not set(want) & set(result.missing_keys)
        got = fresh.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items()), name
        assert _keys(folder / CONNECTIONS_FILE) == set(want)


def test_mixtral_round_trip(tmp_path):
    """transformers renames Mixtral's keys on save with `.mlp.` -> `.block_sparse_moe.`, a
    pattern that also matches `_mlp.` in the connections' keys: its weight files are written
    without the connections (half of them renamed would restore half), which load from their
    own file."""
    config = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    model = _converted(transformers.MixtralForCausalLM, config)
    ids, mask = _batch()
    ref = _logits(model, ids, mask)
    folder = mhc_hf.save_pretrained(model, tmp_path / "mixtral")

    connection_keys = {k for k in model.state_dict() if ".mhc_" in k}
    assert len(connection_keys) > 0
    assert _keys(folder / CONNECTIONS_FILE) == connection_keys
    assert not any("mhc" in k for k in _keys(folder / "model.safetensors"))
    loaded = mhc_hf.from_pretrained(folder)
    assert type(loaded) is type(model)
    assert torch.equal(_logits(loaded, ids, mask), ref)
    # an experts implementation chosen in the Auto call reaches the base model (transformers
    # sets it on the folder's config, which passes it on), as an attention one does
    for remote in ({}, {"trust_remote_code": True}):
        auto = transformers.AutoModelForCausalLM.from_pretrained(
            folder, experts_implementation="eager", **remote)
        assert auto.config._experts_implementation == "eager", remote
        got = _logits(auto, ids, mask)
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), remote


def test_each_save_gets_a_state_dict_of_its_own(tmp_path, monkeypatch):
    """transformers' save pops the entries of the state_dict it is given (for an offloaded
    model, from that very dict): Mixtral's second save, without the connections, still gets
    every weight."""
    config = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    model = _converted(transformers.MixtralForCausalLM, config)
    ids, mask = _batch()
    ref = _logits(model, ids, mask)
    save = type(model).save_pretrained

    def emptying(self, path, state_dict=None, **kwargs):
        given = dict(state_dict)
        state_dict.clear()
        return save(self, path, state_dict=given, **kwargs)

    monkeypatch.setattr(type(model), "save_pretrained", emptying)
    folder = mhc_hf.save_pretrained(model, tmp_path / "mixtral")
    monkeypatch.undo()
    assert torch.equal(_logits(mhc_hf.from_pretrained(folder), ids, mask), ref)


def test_earlier_format_still_loads(tmp_path):
    """Checkpoints whose connection tensors are in transformers' weight files (what the base
    class's save_pretrained writes for a converted model), one file or sharded."""
    model = _converted()
    ids, mask = _batch()
    ref = _logits(model, ids, mask)
    for name, kwargs in (("single", {}), ("sharded", {"max_shard_size": "20KB"})):
        type(model).save_pretrained(model, tmp_path / name, **kwargs)
        assert not (tmp_path / name / CONNECTIONS_FILE).exists()
        assert torch.equal(_logits(mhc_hf.from_pretrained(tmp_path / name), ids, mask), ref)


# ------------------------------------------------------------------------------------------
# The model class


def test_the_task_auto_classes_build_their_task_s_class(tmp_path):
    """AutoModelFor<task>.from_pretrained(folder) builds the base model type's class for the
    task, as transformers does for a plain folder: a saved classifier comes back with its
    trained head, a causal LM's folder gives a classifier with a new head and the folder's
    decoder and connections; a head class that keeps its decoder under another name than the
    saved class (whose weights transformers would not load at all) is refused."""
    ids, mask = _batch()
    classifier = _converted(transformers.LlamaForSequenceClassification,
                            transformers.LlamaConfig(**COMMON, num_labels=3))
    cls_folder = mhc_hf.save_pretrained(classifier, tmp_path / "cls")
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(cls_folder)
    assert type(loaded) is transformers.LlamaForSequenceClassification
    assert torch.equal(_logits(loaded, ids, mask), _logits(classifier, ids, mask))
    # AutoModelForCausalLM builds the saved class, whatever it is (as it always has)
    assert type(transformers.AutoModelForCausalLM.from_pretrained(cls_folder)) \
        is transformers.LlamaForSequenceClassification

    lm = _converted()
    lm_folder = mhc_hf.save_pretrained(lm, tmp_path / "lm")
    saved = dict(mhc_hf.connection_parameters(lm))
    for auto, cls in ((transformers.AutoModelForSequenceClassification,
                       transformers.LlamaForSequenceClassification),
                      (transformers.AutoModelForTokenClassification,
                       transformers.LlamaForTokenClassification)):
        model = auto.from_pretrained(lm_folder)
        assert type(model) is cls
        got = dict(mhc_hf.connection_parameters(model))
        assert got.keys() == saved.keys()
        assert all(torch.equal(got[k], saved[k]) for k in saved)
        assert torch.equal(model.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    # the head's labels given to the load reach the base config
    five = transformers.AutoModelForSequenceClassification.from_pretrained(lm_folder,
                                                                           num_labels=5)
    assert five.config.num_labels == 5 and five.score.out_features == 5
    named = transformers.AutoModelForSequenceClassification.from_pretrained(
        lm_folder, id2label={0: "neg", 1: "pos", 2: "mid"},
        problem_type="multi_label_classification")
    assert named.config.id2label == {0: "neg", 1: "pos", 2: "mid"}
    assert named.score.out_features == 3
    assert named.config.problem_type == "multi_label_classification"
    with pytest.raises(ValueError, match=r"AutoModelForQuestionAnswering builds "
                                         r"LlamaForQuestionAnswering, which keeps its decoder "
                                         r"under 'transformer'.*load it as the LlamaForCausalLM "
                                         r"it was saved as, with AutoModelForCausalLM"):
        transformers.AutoModelForQuestionAnswering.from_pretrained(lm_folder)
    # the bare decoder's folder: its connections lack the heads' prefix
    bare_folder = mhc_hf.save_pretrained(_converted(transformers.LlamaModel), tmp_path / "bare")
    assert type(transformers.AutoModelForCausalLM.from_pretrained(bare_folder)) \
        is transformers.LlamaModel
    with pytest.raises(ValueError, match=r"holds the bare decoder LlamaModel, whose connections "
                                         r"are stored without the prefix 'model' that"):
        transformers.AutoModelForSequenceClassification.from_pretrained(bare_folder)


def test_model_class_comes_from_the_config(tmp_path):
    ids, mask = _batch()
    config = transformers.LlamaConfig(**COMMON, num_labels=3)
    classifier = _converted(transformers.LlamaForSequenceClassification, config)
    ref = _logits(classifier, ids, mask)
    loaded = mhc_hf.from_pretrained(mhc_hf.save_pretrained(classifier, tmp_path / "cls"))
    assert type(loaded) is transformers.LlamaForSequenceClassification
    assert torch.equal(_logits(loaded, ids, mask), ref)  # the trained head, not a new one

    base = _converted(transformers.LlamaModel)
    with torch.no_grad():
        ref = base(ids, attention_mask=mask).last_hidden_state
    loaded = mhc_hf.from_pretrained(mhc_hf.save_pretrained(base, tmp_path / "base"))
    assert type(loaded) is transformers.LlamaModel
    with torch.no_grad():
        assert torch.equal(loaded(ids, attention_mask=mask).last_hidden_state, ref)

    config_file = tmp_path / "cls" / "config.json"
    for architectures in (["NoSuchModelForCausalLM"], None):
        config = json.loads(config_file.read_text())
        config["base_config"]["architectures"] = architectures
        config_file.write_text(json.dumps(config))
        with pytest.raises(ValueError, match=r"expected 'architectures' to name the transformers"
                                             r" model class .*, got "
                                             + (r"\['NoSuchModelForCausalLM'\]" if architectures
                                                else r"\[\]")):
            mhc_hf.from_pretrained(tmp_path / "cls")


# ------------------------------------------------------------------------------------------
# Device maps


def test_single_device_maps_load_and_offloading_maps_are_refused(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    model = _converted()
    ids, mask = _batch()
    ref = _logits(model, ids, mask)
    folder = mhc_hf.save_pretrained(model, tmp_path / "ckpt")
    for device_map in ("cpu", {"": "cpu"}):
        loaded = mhc_hf.from_pretrained(folder, device_map=device_map)
        assert torch.equal(_logits(loaded, ids, mask), ref), device_map

    # transformers would place the layers on disk behind accelerate hooks
    with pytest.raises(ValueError, match=r"loads a converted model onto one device; "
                                         r"device_map='auto' places it on \['disk'\] with "
                                         r"accelerate hooks.*then dispatch the converted model"):
        mhc_hf.from_pretrained(folder, device_map="auto", max_memory={"cpu": "30KB"},
                               offload_folder=tmp_path / "offload")
    spread = {"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu",
              "model.rotary_emb": "cpu", "lm_head": "cpu"}
    with pytest.raises(ValueError, match=r"places it on \['cpu', 'disk'\]"):
        mhc_hf.from_pretrained(folder, device_map=spread, offload_folder=tmp_path / "offload")

    # what the error advises: load onto one device, then dispatch the converted model
    loaded = mhc_hf.from_pretrained(folder)
    device_map = accelerate.infer_auto_device_map(
        loaded, max_memory={"cpu": "100KB"},
        no_split_module_classes=list(loaded._no_split_modules))
    assert set(device_map.values()) == {"cpu", "disk"}
    accelerate.dispatch_model(loaded, device_map, offload_dir=str(tmp_path / "offload2"))
    assert torch.equal(_logits(loaded, ids, mask), ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_single_gpu_device_maps(tmp_path):
    model = _converted()
    folder = mhc_hf.save_pretrained(model, tmp_path / "ckpt")
    ids, mask = (t.cuda() for t in _batch())
    ref = _logits(model.cuda(), ids, mask)  # the same model on the same device
    for device_map in ("cuda:0", {"": 0}, "auto"):
        loaded = mhc_hf.from_pretrained(folder, device_map=device_map)
        assert loaded.model.layers[0].mhc_attn.phi.device.type == "cuda"
        assert torch.equal(_logits(loaded, ids, mask), ref), device_map


# ------------------------------------------------------------------------------------------
# Bad input


def test_missing_folder_and_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope: no such folder; from_pretrained expects a"
                                                r" folder written by torch_mhc.hf.save_pretrained"
                                                r" .* or the id of a Hub repository"):
        mhc_hf.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"^\./nope: no such folder"):  # as given
        mhc_hf.from_pretrained("./nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty has no config.json \(it holds \[\]\)"):
        mhc_hf.from_pretrained(tmp_path / "empty")
    folder = mhc_hf.save_pretrained(_converted(), tmp_path / "ckpt")
    with pytest.raises(NotADirectoryError, match=r"ckpt/config.json is a file, not a folder; "
                                                 r"from_pretrained expects a folder .*"
                                                 r" \(here: .*ckpt\)$"):
        mhc_hf.from_pretrained(folder / "config.json")
    with pytest.raises(TypeError, match=r"takes no config=: the config is read from the "
                                        r"checkpoint's config.json"):
        mhc_hf.from_pretrained(folder, config=transformers.LlamaConfig(**COMMON))

    # config attributes as keyword arguments reach the config, as in transformers
    loaded = mhc_hf.from_pretrained(folder, output_hidden_states=True)
    ids, mask = _batch()
    with torch.no_grad():
        assert len(loaded(ids, attention_mask=mask).hidden_states) == 3  # embeddings + 2 layers
    with pytest.raises(ValueError, match="does not push"):
        mhc_hf.save_pretrained(loaded, tmp_path / "pushed", push_to_hub=True)


@pytest.mark.parametrize("record", ["mhc", {"streams": 3, "options": {}},
                                    {"kind": "mhc", "streams": "3"},
                                    {"kind": "mhc", "streams": 3, "options": [1]}])
def test_damaged_conversion_record(tmp_path, record):
    folder = mhc_hf.save_pretrained(_converted(), tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    config["mhc_conversion"] = record
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: 'mhc_conversion' is damaged: expected "
                                         r"\{'kind': str, 'streams': int, 'options': dict\}"):
        mhc_hf.from_pretrained(folder)


def test_unreadable_connection_file(tmp_path):
    folder = mhc_hf.save_pretrained(_converted(), tmp_path / "ckpt")
    (folder / CONNECTIONS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=r"mhc_connections.safetensors: expected a safetensors "
                                         r"file, cannot read it"):
        mhc_hf.from_pretrained(folder)


# ------------------------------------------------------------------------------------------
# Values checked on load


def _rewrite_connections(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / CONNECTIONS_FILE))
    edit(tensors)
    save_file(tensors, str(folder / CONNECTIONS_FILE))


def _set(key, value):
    def edit(tensors):
        tensors[key] = value(tensors[key])
    return edit


def _with(t: torch.Tensor, index: int, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[index] = value
    return t


@pytest.mark.parametrize("edit,message", [
    (_set("model.layers.0.mhc_attn.phi", lambda t: _with(t, 5, float("nan"))),
     r"mhc_attn.phi holds 1 NaN and 0 infinite values of 1440; expected finite values"),
    (_set("model.layers.1.mhc_mlp.b_res", lambda t: _with(_with(t, 0, float("inf")), 1,
                                                         -float("inf"))),
     r"mhc_mlp.b_res holds 0 NaN and 2 infinite values of 9; expected finite values"),
    (_set("model.layers.0.mhc_attn.alpha", lambda t: t.to(torch.int32)),
     r"mhc_attn.alpha has dtype torch.int32; expected a floating-point tensor .*torch.float32"),
    (_set("model.layers.0.mhc_mlp.b_pre", lambda t: t > 0),
     r"mhc_mlp.b_pre has dtype torch.bool; expected a floating-point tensor"),
    (_set("model.layers.0.mhc_mlp.b_pre", lambda t: t[:2]),
     r"mhc_mlp.b_pre has shape \(2,\), the recorded conversion .* expects \(3,\)"),
])
def test_connection_tensors_must_be_finite_floats_of_the_right_shape(tmp_path, edit, message):
    folder = mhc_hf.save_pretrained(_converted(), tmp_path / "ckpt")
    _rewrite_connections(folder, edit)
    with pytest.raises(ValueError, match=rf"ckpt.*: model.layers.\d.{message}"):
        mhc_hf.from_pretrained(folder)


@pytest.mark.parametrize("record,message", [
    ({"kind": "mhc", "streams": 3, "options": {"norm_eps": -1}},
     r"ManifoldHyperConnection expects norm_eps to be a finite number > 0, got -1.0"),
    ({"kind": "mhc", "streams": 3, "options": {"norm_eps": 0}}, r"norm_eps .*> 0, got 0.0"),
    ({"kind": "mhc", "streams": 3, "options": {"sinkhorn_eps": float("inf")}},
     r"sinkhorn_eps to be a finite number >= 0, got inf"),
    ({"kind": "mhc", "streams": 3, "options": {"pre_eps": float("nan")}},
     r"pre_eps to be a finite number >= 0, got nan"),
    ({"kind": "mhc", "streams": 3, "options": {"sinkhorn_iters": 0}},
     r"expects sinkhorn_iters >= 1, got 0"),
    ({"kind": "mhc", "streams": 3, "options": {"sinkhorn_iters": True}},
     r"sinkhorn_iters to be an int, got True"),
    ({"kind": "mhc", "streams": 3, "options": {"norm_eps": "1e-6"}},
     r"norm_eps to be a float, got '1e-6'"),
    ({"kind": "hc", "streams": 3, "options": {"dynamic": "false"}},
     r"dynamic to be True or False, got 'false'"),
    ({"kind": "mhc", "streams": True, "options": {}}, r"streams must be an int >= 1, got True"),
    ({"kind": "mhc", "streams": 0, "options": {}}, r"streams must be an int >= 1, got 0"),
    ({"kind": "mhcc", "streams": 3, "options": {}}, r"unknown connection kind 'mhcc'"),
    ({"kind": "mhc", "streams": 3, "options": {"norm": 1}}, r"unknown connection option"),
])
def test_conversion_record_values_are_checked(tmp_path, monkeypatch, record, message):
    folder = mhc_hf.save_pretrained(_converted(), tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    config["mhc_conversion"] = record
    (folder / "config.json").write_text(json.dumps(config))  # inf and nan as Infinity, NaN
    # refused before transformers loads the weights
    monkeypatch.setattr(transformers.LlamaForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("loaded a refused checkpoint"))
    with pytest.raises(ValueError, match=r"ckpt/config.json: 'mhc_conversion' records a "
                                         rf"conversion that cannot be rebuilt: .*{message}"):
        mhc_hf.from_pretrained(folder)


# ------------------------------------------------------------------------------------------
# Models sharing one config object


def test_converting_one_of_two_models_built_from_one_config(tmp_path):
    config = transformers.LlamaConfig(**COMMON)
    torch.manual_seed(0)
    first, second = (transformers.LlamaForCausalLM(config).eval() for _ in range(2))
    mhc_hf.convert(first, "mhc", streams=3)
    assert first.config is not config and getattr(config, "mhc_conversion", None) is None
    assert getattr(second.config, "mhc_conversion", None) is None  # still plain
    with pytest.raises(ValueError, match="is not converted"):
        mhc_hf.save_pretrained(second, tmp_path / "plain")
    # inside the converted model every module holds the copy: a setting still reaches them
    assert first.model.config is first.config
    assert first.model.layers[0].self_attn.config is first.config
    mhc_hf.convert(second, "hc", streams=2)  # converting the other one differently works
    for model, name in ((first, "first"), (second, "second")):
        _perturb_connections(model)
        ids, mask = _batch()
        loaded = mhc_hf.from_pretrained(mhc_hf.save_pretrained(model, tmp_path / name))
        assert loaded.config.mhc_conversion["kind"] == model.config.mhc_conversion["kind"]
        torch.testing.assert_close(_logits(loaded, ids, mask), _logits(model, ids, mask),
                                   rtol=0, atol=0)


def test_a_plain_model_whose_config_records_a_conversion_is_not_saved(tmp_path):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    model.config.mhc_conversion = {"kind": "mhc", "streams": 3, "options": {}}
    with pytest.raises(ValueError, match=r"records a conversion .* but its layers are plain"):
        mhc_hf.save_pretrained(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
