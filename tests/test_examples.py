"""The scripts under examples/ run as a user would run them, on a few steps."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_upcycle_llama_converts_fine_tunes_and_saves(tmp_path):
    """The converted Llama starts as the plain one (its logits within float rounding, the
    same validation loss before fine-tuning), both fine-tune, and --save writes a folder that
    torch_mhc.hf loads back as the converted model."""
    pytest.importorskip("transformers")
    pytest.importorskip("tqdm")
    saved = tmp_path / "llama-mhc"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "upcycle_llama.py"), "--steps", "4",
         "--pretrain-steps", "2", "--max-bytes", "200000", "--save", str(saved)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    diff = re.search(r"converted to mhc x4: \+([\d,]+) parameters; max \|logit diff\| / "
                     r"max \|logit\| = (\S+)", out)
    assert diff is not None, out
    assert float(diff.group(2)) <= 1e-5, out
    rows = dict(re.findall(r"^\| (plain|mhc x4) \| (.+) \|$", out, re.M))
    assert set(rows) == {"plain", "mhc x4"}, out
    plain, mhc = ([float(v) for v in rows[k].split(" | ")] for k in ("plain", "mhc x4"))
    # validation loss before fine-tuning: the same function (printed to 4 decimals, which
    # a difference of float rounding may tip by one unit)
    assert abs(plain[0] - mhc[0]) <= 1e-4, out
    assert plain[1] < plain[0] and mhc[1] < mhc[0], out  # and both fine-tune
    assert re.search(r"composite \(all layers\), worst token: forward 1\.0000", out), out

    import torch_mhc.hf

    config = json.loads((saved / "config.json").read_text())
    assert config["mhc_conversion"]["kind"] == "mhc", config
    assert config["mhc_conversion"]["streams"] == 4, config
    model = torch_mhc.hf.from_pretrained(saved)
    added = sum(p.numel() for _, p in torch_mhc.hf.connection_parameters(model))
    assert added == int(diff.group(1).replace(",", "")), (added, out)
