"""`mhc export-hf RUN_DIR OUT_DIR`: a reference-LM run as a portable Hugging Face folder.

    mhc export-hf runs/a hf/a                           # a `mhc train` run folder (ckpt/)
    mhc export-hf runs/compare hf/mhc --kind mhc        # one kind of a `mhc compare` folder
    mhc export-hf runs/compare hf/mhc --kind mhc --seed 1    # one seed of a --seeds run

The folder loads with `AutoModelForCausalLM.from_pretrained(OUT_DIR, trust_remote_code=True)`
and `AutoTokenizer.from_pretrained(OUT_DIR, trust_remote_code=True)` where torch_mhc is not
installed (the tokenizer too reads config.json, whose auto_map names remote code: without the
flag transformers asks on a terminal whether to run it):

- config.json: model_type "torch_mhc_lm", `auto_map` naming the two remote-code classes, the
  sizes under transformers' names and the run's ModelConfig (`mhc_model_config`);
- model.safetensors: the run's state dict under its own names (a tied LM head stored once);
- generation_config.json;
- configuration_torch_mhc_lm.py, modeling_torch_mhc_lm.py, connections.py (from
  torch_mhc/integrations/hf/remote, shared with the portable checkpoints of converted models)
  and sinkhorn.py, maps.py, successors.py: torch_mhc/functional as it is, its imports of the
  package made relative, so the maths has one source;
- tokenizer.json, tokenizer_config.json: the 256 byte ids (byte-fallback tokens "<0x00>" to
  "<0xFF>", no merges): token id = UTF-8 byte, as the run was trained. The LM has no
  end-of-text token; the byte 0 (NUL) stands for the tokenizer's eos and pad tokens, which
  tools such as lm-eval require. The model's config sets no eos, so generate() runs to its
  length as `mhc generate` does.

The folder is built in a temporary sibling of OUT_DIR, its model is loaded from there with
its own code and its logits are compared with the run's model (`torch_mhc.lm.load_model`);
only then is it renamed to OUT_DIR. An existing non-empty OUT_DIR is refused unless
--overwrite, which replaces an earlier export only: a folder whose config.json is an export's
and which holds no file the new export does not write (a training run's checkpoint and lock,
a user's notes) would lose nothing but the export it replaces.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import types
import uuid
from pathlib import Path

from torch_mhc.tools.errors import UsageError

__all__ = ["add_arguments", "export_hf", "find_run", "run_command"]

MODEL_TYPE = "torch_mhc_lm"
CONFIG_CLASS = "configuration_torch_mhc_lm.TorchMhcLMConfig"
MODEL_CLASS = "modeling_torch_mhc_lm.TorchMhcLMForCausalLM"
# the exported logits may differ from the run's by float32 rounding only (the remote code
# computes the maps in plain torch, the run with the library's fused ops); a wrong weight or
# formula moves them by orders of magnitude more
TOLERANCE = 1e-4
SAMPLE = "def f(x):\n    return x * 2 + 1\n\nclass A:\n    pass  # é, ü, 😀\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a run folder (`mhc train --out`, holding ckpt/), or a `mhc compare` "
                   "folder with --kind")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the Hugging Face folder to write")
    p.add_argument("--kind", default=None,
                   help="in a `mhc compare` folder: the connection kind's run (RUN_DIR/KIND)")
    p.add_argument("--seed", type=int, default=None,
                   help="with --kind, in a compare run of several seeds: RUN_DIR/KIND/seedS")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing non-empty OUT_DIR")


def _count(k: int, noun: str) -> str:
    """'1 block', '8 blocks'."""
    return f"{k} {noun}" + ("" if k == 1 else "s")


def run_command(args: argparse.Namespace) -> int:
    """Export, then say where the folder is and how to load it."""
    done = export_hf(args.run_dir, args.out_dir, kind=args.kind, seed=args.seed,
                     overwrite=args.overwrite,
                     say=lambda message: print(f"mhc export-hf: {message}", file=sys.stderr,
                                               flush=True))
    out = done["out_dir"]
    print(f"wrote {out} from {done['checkpoint']} (step {done['step']}; {done['kind']}, "
          f"{_count(done['streams'], 'stream')}, {_count(done['blocks'], 'block')} of width "
          f"{done['dim']}; "
          f"largest logit difference from the run's model {done['max_abs_diff']:.1e})")
    print("load it with:\n"
          "  from transformers import AutoModelForCausalLM, AutoTokenizer\n"
          f"  model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
          f"  tokenizer = AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)")
    return 0


def export_hf(run_dir, out_dir, kind: str | None = None, seed: int | None = None,
              overwrite: bool = False, say=print) -> dict:
    """Write the Hugging Face folder of a run (see the module docstring); returns what was
    written: out_dir, kind, streams, blocks, dim and max_abs_diff (the largest difference of
    the exported model's logits from the run's on a fixed text)."""
    _require_modules()
    run = find_run(run_dir, kind, seed)
    given = Path(out_dir).expanduser()
    # absolute and without "." or "..": the temporary folder goes beside it, named after it
    out = Path(os.path.abspath(given))
    _check_out_dir(given, out, run, overwrite)

    from torch_mhc.lm.train.checkpoint import load_model_with_source

    model, checkpoint, step = load_model_with_source(run, "cpu", say=say)
    if kind is not None and model.cfg.connection != kind:
        raise UsageError(f"{run} holds a {model.cfg.connection!r} model, not {kind!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        diff = _write_folder(tmp, model)
        _install(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    cfg = model.cfg
    return {"out_dir": out, "kind": cfg.connection, "streams": cfg.n_streams,
            "blocks": cfg.n_layers, "dim": cfg.dim, "max_abs_diff": diff,
            "checkpoint": checkpoint, "step": step}


# ---------------------------------------------------------------------------------------------
# Which run, and where to
# ---------------------------------------------------------------------------------------------


def find_run(run_dir, kind: str | None = None, seed: int | None = None) -> Path:
    """The run folder meant: RUN_DIR itself, or RUN_DIR/KIND[/seedS] of a compare folder."""
    from torch_mhc.connections import CONNECTION_KINDS

    root = Path(run_dir).expanduser()
    if not root.exists():
        raise UsageError(f"no run at {root}: the folder does not exist")
    kinds = [k for k in CONNECTION_KINDS if (root / k).is_dir()]
    if kind is None:
        if seed is not None:
            raise UsageError("--seed picks a seed of a compare folder's kind: pass --kind too")
        if kinds and not any((root / name).exists() for name in ("ckpt", "ckpt.old",
                                                                   "ckpt.prev")):
            raise UsageError(f"{root} is a `mhc compare` folder: pass --kind, one of "
                             f"{', '.join(kinds)}")
        return root
    if kind not in CONNECTION_KINDS:
        raise UsageError(f"--kind must be one of {', '.join(CONNECTION_KINDS)}, got {kind!r}")
    folder = root / kind
    if not folder.is_dir():
        if not kinds and any((root / name).exists() for name in ("ckpt", "ckpt.old",
                                                                 "ckpt.prev")):
            raise UsageError(f"{root} is a single run, not a `mhc compare` folder: leave out "
                             "--kind (and --seed)")
        raise UsageError(f"{root} holds no {kind!r} run (found: {', '.join(kinds) or 'none'})")
    seeds = sorted(p.name for p in folder.glob("seed*") if p.is_dir())
    if seed is None:
        if seeds and not (folder / "ckpt").exists():
            raise UsageError(f"{folder} holds one run per seed ({', '.join(seeds)}): pass --seed")
        return folder
    if not (folder / f"seed{seed}").is_dir():
        if not seeds:  # a one-seed comparison keeps its run in the kind's folder
            raise UsageError(f"{folder} holds the run of one seed, not one run per seed: "
                             "leave --seed out")
        raise UsageError(f"{folder} holds no seed{seed} (found: {', '.join(seeds)})")
    return folder / f"seed{seed}"


def _check_out_dir(given: Path, out: Path, run: Path, overwrite: bool) -> None:
    """UsageError (naming the folder as given) unless `out`, the absolute form of `given`, can
    become the export: a new folder, an empty one, or one --overwrite replaces."""
    if given.is_symlink():
        raise UsageError(f"{given} is a symbolic link; name a folder")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{given} exists and is not a folder")
    target, source = out.resolve(), run.resolve()
    if target == source or target in source.parents:
        raise UsageError(f"{given} holds the run being exported; name another folder")
    here = Path.cwd().resolve()
    if target == here or target in here.parents:  # it would be moved away from under us
        raise UsageError(f"{given} is the current folder or holds it, which the export would "
                         "replace; name another folder (e.g. a new one inside it)")
    if out.is_dir() and any(out.iterdir()):
        if not _is_export(out):  # (--overwrite would not help: say so before suggesting it)
            raise UsageError(
                f"{given} exists, is not empty and is not an earlier export (no config.json "
                f"of model_type {MODEL_TYPE!r}); --overwrite replaces only an export, so that "
                "no run or other file is lost: name another folder")
        if not overwrite:
            raise UsageError(f"{given} holds an earlier export; pass --overwrite to replace it")


def _is_export(folder: Path) -> bool:
    """Whether folder's config.json is one export-hf writes."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == MODEL_TYPE


def _require_modules() -> None:
    """UsageError naming the extras when a module the export needs is missing."""
    for name in ("numpy", "tqdm", "transformers", "safetensors"):
        try:
            importlib.import_module(name)
        except ImportError:
            raise UsageError(
                f"{name} is not installed: mhc export-hf needs the train and hf extras, "
                "pip install -e '.[train,hf]' in the torch-mhc checkout"
            ) from None


def _install(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished folder to out (one rename; a replaced folder is moved aside first
    and deleted after)."""
    if not out.exists():
        os.rename(tmp, out)
        return
    if not overwrite and any(out.iterdir()):  # filled since the first check
        raise UsageError(f"{out} exists and is not empty; pass --overwrite to replace it")
    present = {p.name for p in out.iterdir()}
    extra = sorted(present - {p.name for p in tmp.iterdir()})
    if present and (extra or not _is_export(out)):  # it would delete more than an export
        what = (f"holds {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}, which an "
                "export does not write" if extra else
                f"is not an earlier export (no config.json of model_type {MODEL_TYPE!r})")
        raise UsageError(
            f"{out} {what}; --overwrite replaces only an earlier export, so that no run or "
            "other file is lost: name another folder")
    old = out.with_name(f".{out.name}.replaced-{uuid.uuid4().hex[:8]}")
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The folder
# ---------------------------------------------------------------------------------------------


def _write_folder(folder: Path, model) -> float:
    """Code, weights, configs and tokenizer of `model` (an LM) into folder; returns the largest
    logit difference of the folder's model, loaded with its own code, from `model`."""
    _copy_code(folder)
    with _import_folder(folder) as (configuration, modeling), _quiet_transformers():
        config = _hf_config(configuration.TorchMhcLMConfig, model.cfg)
        hf = modeling.TorchMhcLMForCausalLM(config)
        hf.load_state_dict(model.state_dict(), strict=True)
        hf.save_pretrained(folder)
        loaded = modeling.TorchMhcLMForCausalLM.from_pretrained(folder).eval()
        diff = _logit_difference(model, loaded)
    _write_tokenizer(folder, model.cfg.max_seq_len)
    _set_modes(folder)
    return diff


@contextlib.contextmanager
def _quiet_transformers():
    """No progress bars from transformers' save and load (the export prints its own line)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _set_modes(folder: Path) -> None:
    """The modes a folder and files made with the process's umask would have: mkdtemp and
    some writers create them private to the owner, a folder meant for sharing should not be."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _copy_code(folder: Path) -> None:
    """The remote-code templates and the functional files beside them, made relative."""
    import torch_mhc.functional as functional
    from torch_mhc.integrations.hf.remote import FUNCTIONAL_FILES, LM_FILES, REMOTE_DIR

    for name in LM_FILES:
        shutil.copyfile(REMOTE_DIR / name, folder / name)
    source = Path(functional.__file__).resolve().parent
    for name in FUNCTIONAL_FILES:
        text = (source / name).read_text(encoding="utf-8")
        text = text.replace("from torch_mhc.functional.", "from .")
        _check_self_contained(name, text)
        (folder / name).write_text(text, encoding="utf-8")


def _check_self_contained(name: str, text: str) -> None:
    """Raise unless the copied file imports nothing of torch_mhc (the folder runs without it)."""
    for node in ast.walk(ast.parse(text)):
        modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                   [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                   else [])
        if any(m.split(".")[0] == "torch_mhc" for m in modules):
            raise RuntimeError(f"functional/{name} imports torch_mhc at line {node.lineno}: the "
                               "exported folder could not run without the package")


@contextlib.contextmanager
def _import_folder(folder: Path):
    """(configuration module, modeling module) of the folder, imported as a throwaway package
    (relative imports resolve inside it); no bytecode is written into the folder."""
    name = f"_torch_mhc_export_{uuid.uuid4().hex}"
    package = types.ModuleType(name)
    package.__path__ = [str(folder)]
    sys.modules[name] = package
    importlib.invalidate_caches()
    bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        yield (importlib.import_module(f"{name}.configuration_torch_mhc_lm"),
               importlib.import_module(f"{name}.modeling_torch_mhc_lm"))
    finally:
        sys.dont_write_bytecode = bytecode
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def _hf_config(config_class, cfg):
    """The Hugging Face config of a ModelConfig."""
    return config_class(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, intermediate_size=cfg.hidden_dim,
        max_position_embeddings=cfg.max_seq_len, connection=cfg.connection,
        streams=cfg.n_streams, sinkhorn_iters=cfg.sinkhorn_iters, norm_eps=cfg.norm_eps,
        rope_base=cfg.rope_base, initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings, mhc_model_config=cfg.to_dict(),
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
        architectures=["TorchMhcLMForCausalLM"],
        auto_map={"AutoConfig": CONFIG_CLASS, "AutoModelForCausalLM": MODEL_CLASS},
    )


def _logit_difference(model, hf) -> float:
    """max |logits of hf - logits of model| on SAMPLE (two sequences), in float32."""
    import torch

    ids = torch.tensor(list(SAMPLE.encode("utf-8")) * 8)[: model.cfg.max_seq_len]
    batch = torch.stack([ids, ids.flip(0)])  # [2, T]
    with torch.no_grad():
        want, _ = model(batch)
        got = hf(input_ids=batch).logits
    diff = float((got.float() - want.float()).abs().max())
    scale = max(1.0, float(want.abs().max()))
    if not diff <= TOLERANCE * scale:
        raise RuntimeError(f"the exported model's logits differ from the run's by {diff:.3g} "
                           f"(allowed {TOLERANCE * scale:.3g})")
    return diff


def _write_tokenizer(folder: Path, max_len: int) -> None:
    """tokenizer.json and tokenizer_config.json: id = UTF-8 byte, through byte-fallback tokens
    <0x00> .. <0xFF> and no merges (every character falls back to its bytes); padding on the
    left, as the model's positions count.

    Decoding: tokenizers' ByteFallback decoder turns a run of byte tokens holding any invalid
    UTF-8 into one U+FFFD per byte, and here every token is a byte token, so one stray byte
    (a generation stopped inside a character) would blank the whole text. Instead each token
    becomes its byte's character in the byte-level alphabet (GPT-2's), whose decoder replaces
    only the invalid sequences, as `bytes.decode("utf-8", "replace")` and `mhc generate` do."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    alphabet = byte_level_alphabet()
    tok.decoder = decoders.Sequence(
        [decoders.Replace(f"<0x{b:02X}>", alphabet[b]) for b in range(256)]
        + [decoders.ByteLevel()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_len,
                                   eos_token="<0x00>", pad_token="<0x00>",
                                   padding_side="left", clean_up_tokenization_spaces=False)
    fast.save_pretrained(folder)


def byte_level_alphabet() -> list[str]:
    """The byte-level BPE alphabet (GPT-2's): the character standing for each byte 0..255.
    Printable bytes other than space stand for themselves; the other 68, in byte order, for
    U+0100 onwards."""
    own = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
           *range(ord("®"), ord("ÿ") + 1)]
    rest = iter(range(256, 512))
    return [chr(b) if b in own else chr(next(rest)) for b in range(256)]
