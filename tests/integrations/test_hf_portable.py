"""The portable checkpoint: transformers alone loads a converted model (trust_remote_code=True).

Every family the converter supports is converted (with a different connection kind each), its
connections perturbed so that they matter, and saved twice: by torch_mhc.hf.save_pretrained
and by the model's own save_pretrained (transformers.Trainer's path). One subprocess, in
which `import torch_mhc` fails, loads every folder with AutoModelForCausalLM: refused without
trust_remote_code, and with it the same logits (within hf_cases.REL) and the same greedy
generation, and it pickles; the model so loaded saves itself in the same form (which both
loads again and torch-mhc loads); it also loads damaged folders, each refused with one line.
Here, with torch-mhc imported, plain AutoModelForCausalLM.from_pretrained loads the library's
model. No load changes a byte of a folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch_mhc.hf as mhc_hf  # noqa: E402
from tests.helpers.hf_cases import COMMON, REL, V  # noqa: E402
from tests.helpers.hf_cases import batch as _batch  # noqa: E402
from tests.helpers.hf_cases import logits as _logits  # noqa: E402
from tests.helpers.hf_cases import perturb_connections as _perturb  # noqa: E402
from tests.helpers.hf_cases import rel as _rel  # noqa: E402
from torch_mhc.integrations.hf.checkpoint import CONNECTIONS_FILE  # noqa: E402

# family: (model, connection kind, streams, options)
FAMILIES = {
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
              "mhc", 3, {"sinkhorn_iters": 7}),
    "mistral": (lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**COMMON, sliding_window=6)), "hc", 2, {}),
    "qwen2": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)),
              "mhc-lite", 3, {}),
    "qwen3": (lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON,
                                                                             head_dim=8)),
              "kromhc", 4, {}),
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)), "mhc", 4, {}),
}
GEN = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)

# Runs with torch_mhc unimportable: loads every folder of cases.json, writes results.json.
WORKER = r"""
import io, json, sys
sys.modules["torch_mhc"] = None
try:
    import torch_mhc  # noqa: F401
    sys.exit("torch_mhc was importable")
except ImportError:
    pass
import torch
from transformers import AutoModelForCausalLM


def refusal(folder):  # transformers' refusal without trust_remote_code (None: it loaded)
    try:
        AutoModelForCausalLM.from_pretrained(folder)
        return None
    except ValueError as e:
        return str(e)


cases = json.load(open("cases.json"))
out = {}
for folder, case in cases["good"].items():
    refused = refusal(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    ref = torch.load(case["ref"])
    with torch.no_grad():
        logits = model(ref["ids"], attention_mask=ref["mask"]).logits
    tokens = model.generate(ref["prompt"], attention_mask=ref["prompt_mask"], **cases["gen"])
    rel = ((logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
    buffer = io.BytesIO()  # pickled and back, as the model torch-mhc loads
    torch.save(model, buffer)
    buffer.seek(0)
    with torch.no_grad():
        copy = torch.load(buffer, weights_only=False)
        pickled = torch.equal(copy(ref["ids"], attention_mask=ref["mask"]).logits, logits)
    # from_pretrained's own loading options reach it, not the base config
    auto = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype="auto",
                                                attn_implementation="eager")
    options = [str(auto.dtype), auto.config._attn_implementation]
    # saved again by the model's own save_pretrained (a Trainer's checkpoint of it): the same
    # portable form, refused without remote code, the same logits with it
    resaved = folder + "-resaved"
    model.save_pretrained(resaved)
    resaved_refused = refusal(resaved)
    again = AutoModelForCausalLM.from_pretrained(resaved, trust_remote_code=True).eval()
    with torch.no_grad():
        same = torch.equal(again(ref["ids"], attention_mask=ref["mask"]).logits, logits)
    out[folder] = {"refused": refused, "rel": rel, "options": options, "pickled": pickled,
                   "same_tokens": torch.equal(tokens,
                   ref["tokens"]), "class": type(model).__name__,
                   "layer": type(model.get_submodule(case["layer"])).__name__,
                   "resaved": {"refused": resaved_refused, "same_logits": same,
                               "layer": type(again.get_submodule(case["layer"])).__name__}}
for folder in cases["bad"]:
    try:
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        out[folder] = None
    except Exception as e:
        out[folder] = f"{type(e).__name__}: {e}"
json.dump(out, open("results.json", "w"))
"""


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _save_family(name: str, root: Path) -> tuple[list[Path], dict]:
    build, kind, streams, options = FAMILIES[name]
    torch.manual_seed(0)
    model = build().eval()
    mhc_hf.convert(model, kind, streams=streams, **options)
    _perturb(model)
    ids, mask = _batch()
    prompt, prompt_mask = ids[:2, :8], mask[:2, :8]
    ref = {"ids": ids, "mask": mask, "logits": _logits(model, ids, mask), "prompt": prompt,
           "prompt_mask": prompt_mask,
           "tokens": model.generate(prompt, attention_mask=prompt_mask, **GEN)}
    torch.save(ref, root / f"{name}.pt")
    lib, own = root / f"{name}-lib", root / f"{name}-own"
    mhc_hf.save_pretrained(model, lib)
    model.save_pretrained(own)  # the model's own save (transformers.Trainer's path)
    layer = next(n for n, m in model.named_modules() if hasattr(m, "mhc_attn"))
    return [lib, own], {"ref": str(root / f"{name}.pt"), "layer": layer}


def _rewrite_connections(folder: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / CONNECTIONS_FILE))
    change(tensors)
    save_file(tensors, str(folder / CONNECTIONS_FILE))


def _rewrite_config(folder: Path, change) -> None:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


PHI = "model.layers.0.mhc_attn.phi"
# name: (damage, what the message says, with torch-mhc and with the remote code alone)
BAD = {
    "missing": (lambda f: _rewrite_connections(f, lambda t: t.pop(PHI)),
                r"do not match.*missing \['model.layers.0.mhc_attn.phi'\]"),
    "extra": (lambda f: _rewrite_connections(
        f, lambda t: t.update({"model.layers.0.mhc_attn.gamma": torch.ones(2)})),
        r"do not match.*unexpected \['model.layers.0.mhc_attn.gamma'\]"),
    "shape": (lambda f: _rewrite_connections(f, lambda t: t.update({PHI: t[PHI][:-1]})),
              r"model.layers.0.mhc_attn.phi has shape \(95, 15\).*expects \(96, 15\)"),
    "dtype": (lambda f: _rewrite_connections(f, lambda t: t.update({PHI: t[PHI].int()})),
              r"model.layers.0.mhc_attn.phi has dtype torch.int32; expected a floating"),
    "nan": (lambda f: _rewrite_connections(f, lambda t: t[PHI].view(-1)[3:5].fill_(
        float("nan"))), r"model.layers.0.mhc_attn.phi holds .*NaN"),
    "option": (lambda f: _rewrite_config(f, lambda c: c["mhc_conversion"]["options"].update(
        sinkhorn_iters=0)),
        r"(expects sinkhorn_iters >= 1|sinkhorn_iters must be an int >= 1), got 0"),
    "streams": (lambda f: _rewrite_config(f, lambda c: c["mhc_conversion"].update(
        streams=-1)), r"streams must be an int >= 1.*got -1"),
    "kind": (lambda f: _rewrite_config(f, lambda c: c["mhc_conversion"].update(kind="mhcc")),
             r"unknown connection kind 'mhcc'"),
}


def _bad_folders(source: Path, root: Path) -> dict[str, Path]:
    folders = {}
    for name, (damage, _) in BAD.items():
        folders[name] = root / f"bad-{name}"
        shutil.copytree(source, folders[name])
        damage(folders[name])
    return folders


def test_portable_checkpoints_load_with_transformers_alone(tmp_path):
    cases, folders = {}, []
    for name in FAMILIES:
        saved, case = _save_family(name, tmp_path)
        folders += saved
        cases.update({str(f): case for f in saved})
    bad = _bad_folders(tmp_path / "llama-lib", tmp_path)
    before = {f: _digest(f) for f in [*folders, *bad.values()]}
    (tmp_path / "cases.json").write_text(json.dumps(
        {"good": cases, "bad": [str(f) for f in bad.values()], "gen": GEN}))
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": ""}
    run = subprocess.run([sys.executable, "-c", WORKER], cwd=tmp_path, env=env, text=True,
                         capture_output=True, stdin=subprocess.DEVNULL, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    # the connections in the weight files are loaded after the conversion, not reported by
    # transformers' load report as keys the base model does not have
    assert "UNEXPECTED" not in run.stdout + run.stderr
    results = json.loads((tmp_path / "results.json").read_text())

    for folder in folders:
        got = results[str(folder)]
        print(f"{folder.name}: max |logit diff| / max |logit| = {got['rel']:.1e}, "
              f"greedy tokens equal: {got['same_tokens']}")
        assert got["refused"] is not None and "trust_remote_code=True" in got["refused"]
        assert "contains custom code which must be executed" in got["refused"]
        assert got["rel"] <= REL, (folder.name, got["rel"])
        assert got["same_tokens"], folder.name
        assert got["layer"].startswith("MHC"), got
        assert got["options"] == ["torch.float32", "eager"], (folder.name, got["options"])
        assert got["pickled"], folder.name
        resaved = got["resaved"]
        assert resaved["refused"] is not None and "trust_remote_code=True" in resaved["refused"]
        assert resaved["same_logits"] and resaved["layer"].startswith("MHC"), resaved
        # and torch-mhc loads what the folder's own code saved, as its own model
        ref = torch.load(cases[str(folder)]["ref"])
        library = mhc_hf.from_pretrained(f"{folder}-resaved")
        assert _rel(_logits(library, ref["ids"], ref["mask"]), ref["logits"]) <= REL
    for name, folder in bad.items():
        message = results[str(folder)]
        assert message is not None, f"{name}: loaded"
        assert message.startswith("ValueError: ") and "\n" not in message, (name, message)
        assert re.search(BAD[name][1], message), (name, message)
    assert {f: _digest(f) for f in before} == before


# Runs with torch_mhc unimportable: the task Auto classes on a classifier's and a causal LM's
# folders (the folder's own code), writes tasks.json.
TASK_WORKER = r"""
import json, sys
sys.modules["torch_mhc"] = None
import torch
import transformers

ref = torch.load("tasks.pt")
out = {}
model = transformers.AutoModelForSequenceClassification.from_pretrained(
    "cls", trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(ref["ids"], attention_mask=ref["mask"]).logits
out["cls"] = [type(model).__name__, ((logits - ref["logits"]).abs().max()
                                     / ref["logits"].abs().max()).item()]
for auto in ("AutoModelForSequenceClassification", "AutoModelForTokenClassification"):
    model = getattr(transformers, auto).from_pretrained("lm", trust_remote_code=True)
    got = {k: v for k, v in model.state_dict().items() if ".mhc_" in k}
    out[auto] = [type(model).__name__, sorted(got) == sorted(ref["connections"]),
                 all(torch.equal(got[k], ref["connections"][k]) for k in got)]
five = transformers.AutoModelForSequenceClassification.from_pretrained(
    "lm", trust_remote_code=True, num_labels=5)
out["labels"] = [five.config.num_labels, five.score.out_features]
out["causal"] = type(transformers.AutoModelForCausalLM.from_pretrained(
    "cls", trust_remote_code=True)).__name__
try:
    transformers.AutoModelForQuestionAnswering.from_pretrained("lm", trust_remote_code=True)
    out["qa"] = None
except ValueError as e:
    out["qa"] = str(e)
json.dump(out, open("tasks.json", "w"))
"""


def test_the_folders_code_builds_the_task_auto_classes_classes(tmp_path):
    """The folder's own code, where torch-mhc is not importable, builds what the library's
    registered Auto classes build (test_hf_checkpoint's task test): the saved classifier with
    its head, a causal LM's decoder and connections under a task head with the labels asked
    for, the saved class through AutoModelForCausalLM, and refuses a head class that keeps
    its decoder under another name."""
    torch.manual_seed(0)
    ids, mask = _batch()
    classifier = transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(**COMMON, num_labels=3)).eval()
    mhc_hf.convert(classifier, "mhc", streams=3)
    _perturb(classifier)
    mhc_hf.save_pretrained(classifier, tmp_path / "cls")
    lm = FAMILIES["llama"][0]().eval()
    mhc_hf.convert(lm, "mhc", streams=3)
    _perturb(lm)
    mhc_hf.save_pretrained(lm, tmp_path / "lm")
    connections = {k: v for k, v in lm.state_dict().items() if ".mhc_" in k}
    torch.save({"ids": ids, "mask": mask, "logits": _logits(classifier, ids, mask),
                "connections": connections}, tmp_path / "tasks.pt")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": ""}
    run = subprocess.run([sys.executable, "-c", TASK_WORKER], cwd=tmp_path, env=env, text=True,
                         capture_output=True, stdin=subprocess.DEVNULL, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads((tmp_path / "tasks.json").read_text())
    assert got["cls"][0] == "LlamaForSequenceClassification" and got["cls"][1] <= REL, got
    assert got["AutoModelForSequenceClassification"] == \
        ["LlamaForSequenceClassification", True, True]
    assert got["AutoModelForTokenClassification"] == ["LlamaForTokenClassification", True, True]
    assert got["labels"] == [5, 5]
    assert got["causal"] == "LlamaForSequenceClassification"  # the saved class
    assert got["qa"] is not None and "keeps its decoder under 'transformer'" in got["qa"]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_base_class_refuses_the_folder(tmp_path, name):
    """The base architecture's own class (LlamaForCausalLM.from_pretrained(folder), with or
    without trust_remote_code, and with an attention implementation of the caller's) stops
    with an error that says how to load the folder (it built the base model and loaded the
    weights without their connections); its config class still reads the base config (PEFT
    reads the base vocabulary so)."""
    saved, _ = _save_family(name, tmp_path)
    model = FAMILIES[name][0]()
    for folder in saved:
        before = _digest(folder)
        for remote in ({}, {"trust_remote_code": True}, {"attn_implementation": "eager"},
                       {"attn_implementation": "sdpa", "trust_remote_code": True}):
            with pytest.raises(ValueError, match=r"refused by torch-mhc: this folder holds a "
                                                 r"converted model; load it with "
                                                 r"AutoModelForCausalLM\.from_pretrained"):
                type(model).from_pretrained(folder, **remote)
        config = type(model.config).from_pretrained(folder)
        assert config.vocab_size == model.config.vocab_size
        assert _digest(folder) == before


def test_auto_classes_load_the_library_model_once_torch_mhc_hf_is_imported(tmp_path):
    saved, case = _save_family("llama", tmp_path)
    ref = torch.load(case["ref"])
    for folder in saved:
        before = _digest(folder)
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == "torch_mhc" and config["base_model_type"] == "llama"
        assert config["auto_map"]["AutoModelForCausalLM"] == \
            "modeling_torch_mhc.TorchMHCForCausalLM"
        assert config["base_config"]["architectures"] == ["LlamaForCausalLM"]
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        assert type(model) is transformers.LlamaForCausalLM
        layer = model.model.layers[0]
        assert type(layer.mhc_attn).__module__.startswith("torch_mhc.connections")
        assert torch.equal(_logits(model, ref["ids"], ref["mask"]), ref["logits"])
        # config attributes pass through the Auto class to the base config
        hidden = transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                                   output_hidden_states=True)
        with torch.no_grad():
            assert len(hidden(ref["ids"]).hidden_states) == 3
        loaded = mhc_hf.from_pretrained(folder)
        assert torch.equal(_logits(loaded, ref["ids"], ref["mask"]), ref["logits"])
        # from_pretrained's own loading options reach it, not the base config: dtype="auto"
        # (the saved dtype; pipelines pass it) and the attention implementation
        for load in (transformers.AutoModelForCausalLM.from_pretrained, mhc_hf.from_pretrained):
            auto = load(folder, dtype="auto", attn_implementation="eager")
            assert auto.dtype == torch.float32
            assert auto.config._attn_implementation == "eager"
            real = ref["mask"].bool()  # (eager and SDPA differ where a row sees only padding)
            torch.testing.assert_close(_logits(auto, ref["ids"], ref["mask"])[real],
                                       ref["logits"][real], rtol=1e-5, atol=1e-5)
            half = load(folder, dtype=torch.bfloat16)
            assert half.dtype == torch.bfloat16 and half.model.layers[0].mhc_attn.phi.dtype \
                == torch.bfloat16
        assert _digest(folder) == before


def test_both_saves_write_the_same_folder(tmp_path):
    (lib, own), _ = _save_family("gpt2", tmp_path)
    assert _digest(lib) == _digest(own)
    # a model loaded from it saves the same folder again, by either path
    loaded = mhc_hf.from_pretrained(lib)
    loaded.save_pretrained(tmp_path / "again")
    assert _digest(tmp_path / "again") == _digest(lib)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_folders_are_refused_by_the_library(tmp_path, name):
    saved, _ = _save_family("llama", tmp_path)
    folder = _bad_folders(saved[0], tmp_path)[name]
    before = _digest(folder)
    for load in (mhc_hf.from_pretrained, transformers.AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match=BAD[name][1]) as info:
            load(folder)
        assert "\n" not in str(info.value)
    assert _digest(folder) == before


def _folder_code(tmp_path, monkeypatch, module: str):
    """A module of the code a folder carries, imported from a copy of it (as a package)."""
    import importlib

    from torch_mhc.integrations.hf.portable import CODE_FILES

    package = tmp_path / "folder_code"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    for name, source in CODE_FILES.items():
        shutil.copyfile(source, package / name)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(f"folder_code.{module}")


@pytest.mark.parametrize("kind", ["residual", "hc", "mhc", "mhc-lite", "kromhc",
                                  "mhc-static-res"])
def test_the_folders_loader_takes_the_options_the_library_takes(kind, tmp_path, monkeypatch):
    """The folder's loader checks a conversion's options against a table of its own: it
    must name exactly the options the library's make_connection takes for the kind."""
    from torch_mhc.connections import connection_options

    modeling = _folder_code(tmp_path, monkeypatch, "modeling_torch_mhc")
    assert set(modeling.OPTIONS[kind]) == set(connection_options(kind))


@pytest.mark.parametrize("kind", ["residual", "hc", "mhc", "mhc-lite", "kromhc",
                                  "mhc-static-res"])
def test_the_folders_connections_check_the_branch_output_when_asked(kind, tmp_path,
                                                                    monkeypatch):
    """The folder's own connections (remote/connections.py, imported from the code a folder
    carries) honour check_finite as the library's do, the residual's included: a NaN in F
    stops the forward with the kind's name; without the option it flows through."""
    remote = _folder_code(tmp_path, monkeypatch, "connections")
    n = 1 if kind == "residual" else 2
    x = torch.randn(3, n, 4)
    nan_branch = lambda h: torch.full_like(h, float("nan"))  # noqa: E731
    checked = remote.make_connection(kind, 4, n, 0, {"check_finite": True}, nan_branch)
    with pytest.raises(FloatingPointError, match=r": F holds NaN or Inf"):
        checked(x)
    unchecked = remote.make_connection(kind, 4, n, 0, {}, nan_branch)
    assert torch.isnan(unchecked(x)).all()


def test_every_auto_map_entry_is_a_class_of_the_folders_code_for_its_auto_class():
    """config.json's auto_map and the library's registration name the same entry classes,
    and each is modeling_torch_mhc's class for that Auto class (read from its source: the
    module imports files that only a saved folder holds beside it)."""
    import ast

    from torch_mhc.integrations.hf import auto
    from torch_mhc.integrations.hf.portable import TorchMHCConfig
    from torch_mhc.integrations.hf.remote import configuration_torch_mhc as conf

    source = Path(conf.__file__).with_name("modeling_torch_mhc.py").read_text()
    remote = {node.name: stmt.value.value for node in ast.parse(source).body
              if isinstance(node, ast.ClassDef) for stmt in node.body
              if isinstance(stmt, ast.Assign) and stmt.targets[0].id == "auto_class"}
    auto.register()
    for auto_class in conf.TASK_AUTO_CLASSES:
        module, name = conf.AUTO_MAP[auto_class].split(".")
        assert module == "modeling_torch_mhc" and remote[name] == auto_class
        registered = getattr(transformers, auto_class)._model_mapping[TorchMHCConfig]
        assert registered.__name__ == name and registered.auto_class == auto_class
