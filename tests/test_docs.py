"""The documentation's examples run: every fenced ```python block of README.md and docs/*.md.

One test per block, parametrised by page and block index (`README.md#0`, `docs/maths.md#2`).
The blocks of one page run in order, in one namespace and one temporary working directory
per page, so a later block may use what an earlier one built or saved (the Hugging Face page
loads the folder its first block saved). Selecting a single block runs the page's earlier
blocks first. If an earlier block of the page failed, the later ones are skipped, naming it.

A block that cannot run here (a GPU, torchtitan, torchrun, a data set) is marked on the line
before its fence with an HTML comment, which the rendered page does not show:

    <!-- docs-test: skip (needs torchtitan 0.3.0 and torch >= 2.14) -->

and is skipped with the text in parentheses as the reason; it is not run, so later blocks
must not depend on it. A block whose imports are missing (transformers for the Hugging Face
examples) is skipped with the missing module's name.

Relative links between these pages (and to files of the repository) must point at files that
exist, and a `#anchor` into a markdown file at one of its headings.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((.*)\)\s*-->")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass
class Block:
    page: Path
    index: int
    line: int
    code: str
    skip: str | None


def _blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    out = []
    for i, m in enumerate(_FENCE.finditer(text)):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _SKIP.search(before)
        line = text.count("\n", 0, m.start()) + 2  # the first line of code, 1-based
        out.append(Block(page, i, line, m.group(1), mark.group(1).strip() if mark else None))
    return out


BLOCKS = {page: _blocks(page) for page in PAGES}
CASES = [b for page in PAGES for b in BLOCKS[page]]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@dataclass
class PageRun:
    """The state of one page's run: its namespace, folder, and how far it got."""

    tmp: tempfile.TemporaryDirectory
    namespace: dict = field(default_factory=lambda: {"__name__": "__docs__"})
    done: int = 0  # blocks 0 .. done-1 have run (or were skipped)
    failed: str | None = None


@pytest.fixture(scope="module")
def runs():
    state: dict[Path, PageRun] = {}
    yield state
    for run in state.values():
        run.tmp.cleanup()


def _execute(block: Block, run: PageRun) -> None:
    name = f"{_name(block.page)}#{block.index} (line {block.line})"
    code = compile("\n" * (block.line - 1) + block.code, str(block.page), "exec")
    cwd = os.getcwd()
    os.chdir(run.tmp.name)
    try:
        exec(code, run.namespace)
    except ImportError as e:
        missing = _missing_module(e)
        if missing is None:
            run.failed = name
            raise
        run.failed = f"{name} needs the module {missing!r}"
        pytest.skip(run.failed)
    except BaseException:
        run.failed = name
        raise
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize(
    "block", CASES, ids=[f"{_name(b.page)}#{b.index}" for b in CASES]
)
def test_block_runs(block: Block, runs):
    run = runs.setdefault(block.page, PageRun(tempfile.TemporaryDirectory(prefix="docs-")))
    blocks = BLOCKS[block.page]
    while run.done < block.index:  # earlier blocks of the page first (a single block selected)
        earlier = blocks[run.done]
        run.done += 1
        if earlier.skip is None and run.failed is None:
            _execute(earlier, run)
    if block.skip is not None:
        run.done = max(run.done, block.index + 1)
        pytest.skip(block.skip)
    if run.failed is not None:
        run.done = max(run.done, block.index + 1)
        pytest.skip(f"an earlier block of the page failed: {run.failed}")
    run.done = block.index + 1
    _execute(block, run)


def _missing_module(e: ImportError) -> str | None:
    """The optional package whose absence raised e (directly or as its cause), or None when
    the error is not a missing package, or is a missing part of torch_mhc itself (a bug)."""
    for err in (e, e.__cause__):
        if isinstance(err, ModuleNotFoundError) and err.name:
            return None if err.name.split(".")[0] == "torch_mhc" else err.name
    return None


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            title = re.sub(r"[^\w\- ]", "", title)
            out.add(title.replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=[_name(p) for p in PAGES])
def test_links_resolve(page: Path):
    bad = []
    for target in _LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with that anchor")
    assert not bad, f"{_name(page)}: " + "; ".join(bad)


def test_every_page_is_in_the_index():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in PAGES if p.parent.name == "docs" and p.name != "README.md"
               and f"]({p.name})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


def test_the_wrapping_example_runs_every_kind_it_names():
    """README's first example, with each kind its comment lists in place of "mhc": it runs,
    and (as the text under it says) computes the Pre-Norm residual network of its blocks."""
    import torch

    from torch_mhc.connections import CONNECTION_KINDS

    code = BLOCKS[ROOT / "README.md"][0].code
    line = next(x for x in code.splitlines() if x.startswith("kind = "))
    named = re.findall(r'"([\w-]+)"', line)
    assert sorted(named) == sorted(CONNECTION_KINDS)  # the comment names every kind
    for kind in named:
        torch.manual_seed(0)
        ns: dict = {}
        exec(compile(code.replace(line, f"kind = {kind!r}"), f"README.md ({kind})", "exec"),
             ns)
        h0 = torch.randn(2, 16, ns["dim"])
        x = ns["torch_mhc"].expand_streams(h0, ns["n"])
        with torch.no_grad():
            for layer in ns["layers"]:
                x = layer(x)
            residual = h0
            for block in ns["blocks"]:
                residual = residual + block(residual)
            out = ns["torch_mhc"].reduce_streams(x)
        torch.testing.assert_close(out, residual, rtol=1e-5, atol=1e-5, msg=kind)


_TOML = re.compile(r"^```toml[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_toml_examples_are_valid_run_configs(page: Path, tmp_path):
    """Every fenced ```toml block is a `--config` file `mhc train` accepts: known keys of the
    right types, values that validate once merged with the defaults."""
    from torch_mhc.lm.config import TrainConfig, build_config

    for i, m in enumerate(_TOML.finditer(page.read_text(encoding="utf-8"))):
        path = tmp_path / f"block{i}.toml"
        path.write_text(m.group(1))
        build_config(TrainConfig(), path, {})
