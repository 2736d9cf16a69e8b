"""`mhc export-hf`: a run becomes a Hugging Face folder that transformers loads without
torch_mhc, with the run's logits, its greedy generations and a byte-level tokenizer.

One tiny run per connection kind is trained once for the module; every folder is then loaded
in one fresh interpreter where `import torch_mhc` fails, and compared there with what the run's
own model (torch_mhc.lm.load_model) computed here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("numpy")

from tests.helpers.cli import assert_one_line_error  # noqa: E402
from tests.helpers.cli import run_cli as run  # noqa: E402
from torch_mhc.lm import load_model  # noqa: E402
from torch_mhc.tools.cli import main  # noqa: E402

KINDS = ("residual", "hc", "mhc", "mhc-lite", "kromhc", "mhc-static-res")
PROMPT = b"def f3(x):\n    return x"
NEW_TOKENS = 6
FILES = {"config.json", "generation_config.json", "model.safetensors",
         "configuration_torch_mhc_lm.py", "modeling_torch_mhc_lm.py", "connections.py",
         "sinkhorn.py", "maps.py", "successors.py", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_config_under):
    """{kind: run folder} of tiny runs (a high learning rate moves the connections' maps well
    away from their initial values in a few steps)."""
    from torch_mhc.lm.train import train

    root = tmp_path_factory.mktemp("runs")
    folders = {}
    for kind in KINDS:
        folders[kind] = root / kind
        train(tiny_config_under(root, kind, steps=6, lr=3e-2, min_lr=3e-3,
                                out_dir=str(folders[kind])))
    return folders


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    """{kind: exported folder}, through the command."""
    out = tmp_path_factory.mktemp("hf")
    folders = {}
    for kind, folder in runs.items():
        folders[kind] = out / kind
        assert main(["export-hf", str(folder), str(folders[kind])]) == 0
    return folders


def reference(run_dir) -> dict:
    """The run's model on PROMPT: logits, its greedy continuation and the logits of every
    generated step (the decoding path the exported model's cache must reproduce)."""
    model = load_model(run_dir)
    ids = torch.tensor([list(PROMPT)])  # [1, T0]
    with torch.no_grad():
        logits, _ = model(ids)
        gen = model.generate(ids, NEW_TOKENS, temperature=0)  # [1, T0 + N]
        steps, _ = model(gen[:, :-1])
    return {"ids": ids, "logits": logits, "gen": gen, "steps": steps[:, ids.shape[1] - 1:]}


CHECK = """
import sys
sys.modules["torch_mhc"] = None  # as if not installed
try:
    import torch_mhc  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("torch_mhc is importable")
import json, warnings
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

folders, refs = json.loads(sys.argv[1]), torch.load(sys.argv[2])
report = {}
for kind, folder in folders.items():
    ref = refs[kind]
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert torch.equal(ids, ref["ids"]), (kind, ids)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
        gen = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        # a padded batch (the tokenizer pads on the left): the short row's logits match its
        # own unpadded forward
        batch = tok([PROMPT, PROMPT[-5:]], return_tensors="pt", padding=True)
        padded = model(**batch).logits[1, -5:]
        alone = model(input_ids=ids[:, -5:]).logits[0]
    text = pipeline("text-generation", model=folder, trust_remote_code=True)(
        PROMPT, max_new_tokens=NEW, do_sample=False)[0]["generated_text"]
    report[kind] = {
        "logits": (out.logits - ref["logits"]).abs().max().item(),
        "scale": ref["logits"].abs().max().item(),
        "gen_equal": torch.equal(gen.sequences, ref["gen"]),
        "steps": (torch.stack(gen.logits, 1) - ref["steps"]).abs().max().item(),
        "padded": (padded - alone).abs().max().item(),
        "text": text, "decoded": tok.decode(gen.sequences[0]),
        "max_length": [model.config.max_position_embeddings, tok.model_max_length],
        "special": [tok.eos_token_id, tok.pad_token_id, len(tok)],
        # stray bytes (a generation stopped inside a character) spoil only themselves
        "lossy": [tok.decode(ids) for ids in LOSSY],
        "padding_side": tok.padding_side,
    }
print(json.dumps(report))
"""


def test_exported_folders_load_without_torch_mhc(runs, exported, tmp_path):
    import torch_mhc.hf
    from torch_mhc.integrations.hf.remote.configuration_torch_mhc_lm import TorchMhcLMConfig
    from torch_mhc.tools.export_hf import MODEL_TYPE

    for kind, folder in exported.items():
        assert {p.name for p in folder.iterdir()} == FILES, kind
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == MODEL_TYPE == TorchMhcLMConfig.model_type
        assert config["connection"] == kind
        # the library's loader of converted transformers models points at the right one
        with pytest.raises(ValueError, match="holds a reference-LM run exported by `mhc "
                           "export-hf` .*AutoModelForCausalLM.from_pretrained"):
            torch_mhc.hf.from_pretrained(folder, trust_remote_code=True)
        assert set(config["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
        for name in ("maps.py", "sinkhorn.py", "successors.py", "modeling_torch_mhc_lm.py",
                     "connections.py"):
            imports = [line for line in (folder / name).read_text().splitlines()
                       if line.startswith(("import ", "from "))]
            assert not [line for line in imports if " torch_mhc" in line], (kind, name)
    torch.save({kind: reference(folder) for kind, folder in runs.items()}, tmp_path / "ref.pt")
    lossy = [[100, 101, 102, 128, 42, 42], [100, 195], [0xE2, 0x82, 0xAC, 0xE2, 0x82, 33],
             [0xF0, 0x9F, 0x98, 0x80, 0xFF, 104, 0xC3, 0xA9]]
    code = (f"PROMPT = {PROMPT.decode()!r}\nNEW = {NEW_TOKENS}\nLOSSY = {lossy!r}\n"
            + textwrap.dedent(CHECK))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""}
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps({k: str(v) for k, v in exported.items()}),
         str(tmp_path / "ref.pt")], capture_output=True, text=True, timeout=300, env=env,
        cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for kind, r in report.items():
        # float32 rounding of the plain-torch maps against the library's fused CPU ops
        assert r["logits"] <= 1e-5 * max(1.0, r["scale"]), (kind, r)
        assert r["steps"] <= 1e-5 * max(1.0, r["scale"]), (kind, r)
        assert r["padded"] <= 1e-5 * max(1.0, r["scale"]), (kind, r)
        assert r["gen_equal"], (kind, r)
        want = bytes(torch.load(tmp_path / "ref.pt")[kind]["gen"][0].tolist()).decode()
        assert r["decoded"] == want and r["text"] == want, (kind, r)
        assert r["max_length"] == [32, 32] and r["special"] == [0, 0, 256], (kind, r)
        assert r["lossy"] == [bytes(ids).decode("utf-8", "replace") for ids in lossy], r
        assert r["lossy"][0] == "def\ufffd**" and r["padding_side"] == "left", r


def test_compare_folder_kind_and_seed(runs, tmp_path, capsys):
    compare = tmp_path / "compare"
    shutil.copytree(runs["mhc"], compare / "mhc")
    shutil.copytree(runs["hc"], compare / "hc" / "seed0")
    shutil.copytree(runs["hc"], compare / "hc" / "seed1")
    code, out, err = run(["export-hf", compare, tmp_path / "a", "--kind", "mhc"], capsys)
    assert code == 0, err
    assert f"wrote {tmp_path / 'a'} from {compare / 'mhc' / 'ckpt'} (step " in out
    assert "; mhc, " in out and "trust_remote_code=True" in out
    # the lines it prints to load the folder run as printed, and pass the flag to both calls
    # (without it transformers asks on a terminal whether to run the remote code)
    hint = textwrap.dedent(out.split("load it with:\n", 1)[1])
    loads = [line for line in hint.splitlines() if "from_pretrained(" in line]
    assert len(loads) == 2 and all("trust_remote_code=True" in line for line in loads)
    namespace: dict = {}
    exec(hint, namespace)
    ids = namespace["tokenizer"]("def ", return_tensors="pt").input_ids
    assert namespace["model"](input_ids=ids).logits.shape == (1, 4, 256)
    code, _, err = run(["export-hf", compare, tmp_path / "b", "--kind", "hc", "--seed", "1"],
                       capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "b" / "config.json").read_text())["connection"] == "hc"
    code, _, err = run(["export-hf", compare, tmp_path / "c"], capsys)
    assert_one_line_error(code, err, "is a `mhc compare` folder: pass --kind", "hc, mhc")
    code, _, err = run(["export-hf", compare, tmp_path / "c", "--kind", "hc"], capsys)
    assert_one_line_error(code, err, "one run per seed (seed0, seed1): pass --seed")
    code, _, err = run(["export-hf", compare, tmp_path / "c", "--kind", "kromhc"], capsys)
    assert_one_line_error(code, err, "holds no 'kromhc' run (found: hc, mhc)")
    code, _, err = run(["export-hf", compare, tmp_path / "c", "--kind", "mhc", "--seed", "0"],
                       capsys)
    assert_one_line_error(code, err, "holds the run of one seed", "leave --seed out")
    code, _, err = run(["export-hf", compare, tmp_path / "c", "--kind", "hc", "--seed", "2"],
                       capsys)
    assert_one_line_error(code, err, "holds no seed2 (found: seed0, seed1)")
    code, _, err = run(["export-hf", compare, tmp_path / "c", "--kind", "mHC"], capsys)
    assert_one_line_error(code, err, "--kind must be one of")
    code, _, err = run(["export-hf", runs["hc"], tmp_path / "c", "--kind", "hc"], capsys)
    assert_one_line_error(code, err, "is a single run, not a `mhc compare` folder: leave out "
                                     "--kind")
    assert not (tmp_path / "c").exists()


def test_refusals_leave_everything_as_it_was(runs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run(["export-hf", runs["mhc"], out], capsys)
    # (not a hint to pass --overwrite, which would not replace it either)
    assert_one_line_error(code, err, "exists, is not empty and is not an earlier export")
    assert "pass --overwrite" not in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # --overwrite replaces an earlier export only: not a user's file, nor a training run
    code, _, err = run(["export-hf", runs["mhc"], out, "--overwrite"], capsys)
    assert_one_line_error(code, err, "is not an earlier export (no config.json of model_type "
                                     "'torch_mhc_lm'); --overwrite replaces only an export")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    live = tmp_path / "live"
    shutil.copytree(runs["hc"], live)
    before = sorted(p.name for p in live.iterdir())
    code, _, err = run(["export-hf", runs["mhc"], live, "--overwrite"], capsys)
    assert_one_line_error(code, err, "is not an earlier export")
    assert sorted(p.name for p in live.iterdir()) == before
    (out / "keep.txt").unlink()
    code, _, err = run(["export-hf", runs["mhc"], out], capsys)
    assert code == 0, err
    code, _, err = run(["export-hf", runs["hc"], out], capsys)
    assert_one_line_error(code, err, "holds an earlier export; pass --overwrite to replace it")
    code, _, err = run(["export-hf", runs["hc"], out, "--overwrite"], capsys)
    assert code == 0, err  # an export replaced by another
    assert {p.name for p in out.iterdir()} == FILES
    (out / "notes.txt").write_text("mine")  # beside an export: it would be lost
    code, _, err = run(["export-hf", runs["mhc"], out, "--overwrite"], capsys)
    assert_one_line_error(code, err, "holds notes.txt, which an export does not write")
    assert {p.name for p in out.iterdir()} == FILES | {"notes.txt"}
    (out / "notes.txt").unlink()
    shutil.rmtree(live)
    code, _, err = run(["export-hf", tmp_path / "nowhere", tmp_path / "x"], capsys)
    assert_one_line_error(code, err, "no run at", "does not exist")
    code, _, err = run(["export-hf", tmp_path / "out", tmp_path / "x"], capsys)
    assert_one_line_error(code, err, "no checkpoint at")
    code, _, err = run(["export-hf", runs["mhc"], runs["mhc"], "--overwrite"], capsys)
    assert_one_line_error(code, err, "holds the run being exported")
    # a damaged checkpoint with nothing to fall back to
    broken = tmp_path / "broken"
    shutil.copytree(runs["mhc"], broken)
    for name in ("ckpt.prev", "ckpt.old"):
        shutil.rmtree(broken / name, ignore_errors=True)
    shard = next((broken / "ckpt").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    code, _, err = run(["export-hf", broken, tmp_path / "x"], capsys)
    assert_one_line_error(code, err)
    assert not (tmp_path / "x").exists()
    # nothing half-written is left beside the targets
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "out"]


def test_current_folder_relative_paths_and_a_fallback_checkpoint(runs, tmp_path, capsys,
                                                                 monkeypatch):
    """OUT_DIR "." or ".." (the current folder, or one holding it) is refused, since the
    export would replace it; a relative OUT_DIR is written; a damaged ckpt falls back to
    ckpt.prev with a warning of the command's own, and the line saying what was written names
    the checkpoint and step exported."""
    here = tmp_path / "here"
    (here / "sub").mkdir(parents=True)
    monkeypatch.chdir(here / "sub")
    for given in (".", ".."):
        code, _, err = run(["export-hf", runs["mhc"], given, "--overwrite"], capsys)
        assert_one_line_error(code, err, f"{given} is the current folder or holds it")
    assert [p.name for p in here.iterdir()] == ["sub"] and not any((here / "sub").iterdir())
    damaged = tmp_path / "damaged"
    shutil.copytree(runs["mhc"], damaged)
    if not (damaged / "ckpt.prev").exists():  # a run of few steps saved once
        shutil.copytree(damaged / "ckpt", damaged / "ckpt.prev")
    shard = next((damaged / "ckpt").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    code, out, err = run(["export-hf", damaged, "hf"], capsys)
    assert code == 0, err
    assert err.startswith("mhc export-hf: warning: ") and "previous checkpoint" in err
    assert out.startswith(f"wrote {here / 'sub' / 'hf'} from {damaged / 'ckpt.prev'} (step ")
    assert {p.name for p in (here / "sub" / "hf").iterdir()} == FILES
