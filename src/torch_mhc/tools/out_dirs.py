"""The folder a command writes into: a folder or nothing, and none of another command's files.

`mhc train`, `compare`, `sweep` and `upcycle` each write files of their own at the top of
--out (a checkpoint and metrics, report.json, sweep.json, upcycle.json) and resume or replace
what they find there by name. Pointed at a folder another command wrote, one would put its
files beside the other's (a comparison's report beside a training run's checkpoint, and its
runs in folders next to it): each refuses such a folder instead, naming the file it found.
So too the folders such a command keeps its runs in: a comparison's and an upcycling's
`<kind>/` and `<kind>/seed<S>/`, a sweep's `cells/` and `cells/<cell>/`, where a training run
put by hand would sit among them (and `mhc export-hf --kind` would export it as the
comparison's). Other folders beside or below their files are the user's own.
(A comparison writes report.json when it ends: one interrupted before is not recognised.)
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from torch_mhc.connections import CONNECTION_KINDS
from torch_mhc.lm.train import METRICS_FILE, ConfigError
from torch_mhc.lm.train.checkpoint import CANDIDATES

# a file or folder at the top of --out: the command that wrote it
MARKERS = {
    **{name: "mhc train" for name in (*CANDIDATES, METRICS_FILE)},
    "report.json": "mhc compare",
    "sweep.json": "mhc sweep",
    "upcycle.json": "mhc upcycle",
}
# where each command that holds runs keeps them: a path below its --out, one or two levels
_KIND_RUNS = re.compile(rf"(?:{'|'.join(re.escape(k) for k in CONNECTION_KINDS)})(?:/seed\d+)?")
RUN_FOLDERS = {
    "mhc compare": _KIND_RUNS,
    "mhc upcycle": _KIND_RUNS,
    "mhc sweep": re.compile(r"cells(?:/[^/]+)?"),
}


def check_out_dir(out: str | os.PathLike, command: str, flag: str = "--out") -> Path:
    """out (with ~ expanded) if `command` ("mhc compare", ...) may write there; else a
    ConfigError that says what is there (naming the folder as `flag`)."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} exists and is a file, expected a folder (or nothing)")
    for name, writer in MARKERS.items():
        if writer != command and (path / name).exists():
            raise ConfigError(
                f"{flag} {path} holds {name}, written by {writer}: {command} would write its "
                f"own files beside it; choose another folder for the {command} run")
    full = Path(os.path.abspath(path))  # "../x" lies in the parent's parent, not in "."
    for above in (full.parent, full.parent.parent):
        below = full.relative_to(above).as_posix()
        for name, writer in MARKERS.items():
            if writer != command and writer in RUN_FOLDERS \
                    and RUN_FOLDERS[writer].fullmatch(below) and (above / name).exists():
                raise ConfigError(
                    f"{flag} {path} lies inside {above}, a folder of {writer} (it holds "
                    f"{name}), among that command's runs: choose a folder outside it for the "
                    f"{command} run")
    return path
