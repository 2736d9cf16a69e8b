"""What each part imports: the core needs torch only; the trainer's extra is asked for by name.

Each check runs in a fresh interpreter where numpy, tqdm and matplotlib cannot be imported
(`sys.modules[name] = None` makes `import name` fail, as if they were not installed; torch
itself runs without numpy), so what the package imports at any depth is what is tested.
"""

from __future__ import annotations

import textwrap

BLOCK = """
import sys, warnings
for name in ("numpy", "tqdm", "matplotlib"):
    sys.modules[name] = None  # not installed
# torch warns that its numpy bridge failed: an artefact of the blocking (a real install
# without numpy never tries)
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
"""


def test_core_and_config_run_without_numpy_tqdm_matplotlib(run_python):
    code = BLOCK + textwrap.dedent("""
        import torch
        import torch_mhc
        from torch_mhc import connections, functional, ops, runtime  # the library
        from torch_mhc.functional import maps, sinkhorn
        from torch_mhc.runtime import diagnostics, files, recompute
        from torch_mhc.lm import config, model, parallel  # the LM without its trainer
        from torch_mhc.tools.cost import model as cost_model
        from torch_mhc.lm.model import LM, ModelConfig

        for kind in ("residual", "hc", "mhc"):
            torch.manual_seed(0)
            lm = LM(ModelConfig(dim=32, n_layers=1, n_heads=2, max_seq_len=16, connection=kind))
            x = torch.randint(0, 256, (2, 8))
            with diagnostics.collect_gains():
                _, loss = lm(x, x)
            loss.backward()
            assert torch.isfinite(loss), kind
        loaded = [m for m in ("numpy", "tqdm", "matplotlib") if sys.modules.get(m) is not None]
        assert not loaded, loaded
        # the configuration and the command line do not import the trainer or the corpora
        import torch_mhc.tools.cli
        trainer = [m for m in sys.modules if m.startswith(("torch_mhc.lm.train",
                                                                   "torch_mhc.lm.data"))]
        assert not trainer, trainer
        print("ok")
    """)
    done = run_python(code)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_commands_without_the_extra_name_it(run_python, tmp_path):
    commands = [["train", "--steps", "1"], ["compare", "--out", str(tmp_path / "c")],
                ["generate", "--checkpoint", str(tmp_path)],
                ["cost", "--preset", "paper-27b", "--json"]]  # torch-only: keeps working
    code = BLOCK + textwrap.dedent(f"""
        import contextlib, io, json
        from torch_mhc.tools.cli import main
        results = []
        for argv in {commands!r}:
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                status = main(argv)
            results.append([status, err.getvalue()])
        print(json.dumps(results))
    """)
    done = run_python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    results = json.loads(done.stdout.strip().splitlines()[-1])
    for argv, (status, err) in zip(commands[:3], results[:3], strict=True):
        assert status == 2
        assert err == (f"mhc {argv[0]}: error: numpy is not installed: mhc {argv[0]} needs "
                       "the training extra, pip install -e '.[train]' in the torch-mhc checkout\n")
    assert results[3] == [0, ""]
