"""Tests of torch_mhc.lm.data: sources, the byte cache, the split, and the batch samplers.

Every corpus is written to tmp_path and every cache lives in tmp_path; nothing reads
../shared. Expected bytes are built plainly (b"\\n\\n".join of what the test wrote) and
expected batches are cut from the bytes with Python slicing.
"""

from __future__ import annotations

import json
import math
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from torch_mhc.lm import data
from torch_mhc.lm.data import SEPARATOR, BatchSampler, Corpus, load_corpus, val_batches


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache dir, also set as $TORCH_MHC_CACHE so no test writes to ~/.cache."""
    d = tmp_path / "cache"
    monkeypatch.setenv("TORCH_MHC_CACHE", str(d))
    return d


@pytest.fixture
def build_counter(monkeypatch):
    """Counts calls of the cache builder."""
    calls = []
    real = data._build_cache

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(data, "_build_cache", counting)
    return calls


def _bytes(corpus: Corpus) -> bytes:
    return np.asarray(corpus.tokens).tobytes()


def _cache_files(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


TEXT = "Hello, wörld — ünïcode ✓\nline two\n" * 20


# ------------------------------------------------------------------------------------------
# Sources


def test_text_file_loads_its_bytes(tmp_path, cache):
    f = tmp_path / "a.txt"
    f.write_bytes(TEXT.encode("utf-8"))
    corpus = load_corpus(f, cache_dir=cache)
    assert _bytes(corpus) == TEXT.encode("utf-8")
    assert len(corpus) == len(TEXT.encode("utf-8"))
    assert corpus.tokens.dtype == np.uint8
    assert isinstance(corpus.tokens, np.memmap)
    assert str(f.resolve()) in corpus.source_description


def test_folder_loads_text_files_sorted_and_skips_the_rest(tmp_path, cache):
    root = tmp_path / "texts"
    texts = {  # relative path -> content; the order of insertion is deliberately unsorted
        "b.md": "# bee\n",
        "a/z.txt": "zed in a\n",
        "a.txt": "plain a\n",
        "B.py": "def f():\n    return 'ß'\n",
        "deep/er/x.rst": "Title\n=====\n",
        "noext": "no suffix, still text\n",
    }
    for rel, content in texts.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(content, encoding="utf-8")
    # skipped: binary (NUL), invalid UTF-8, empty, hidden file, hidden folder
    (root / "blob.bin").write_bytes(b"abc\x00def")
    (root / "latin1.txt").write_bytes("café".encode("latin-1"))
    (root / "empty.txt").write_bytes(b"")
    (root / ".hidden.txt").write_text("secret\n")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n")

    corpus = load_corpus(root, cache_dir=cache)
    expected = SEPARATOR.join(texts[rel].encode("utf-8") for rel in sorted(texts))
    assert _bytes(corpus) == expected
    assert "6 documents" in corpus.source_description
    assert "2 non-text files skipped" in corpus.source_description


def test_saved_hf_dataset_loads_the_text_column(tmp_path, cache):
    datasets = pytest.importorskip("datasets")
    rows = ["first row ✓", "", "second\nrow", "third"]
    ds = datasets.Dataset.from_dict({"id": list(range(len(rows))), "text": rows})
    ds.save_to_disk(str(tmp_path / "ds"))
    corpus = load_corpus(tmp_path / "ds", cache_dir=cache)
    assert _bytes(corpus) == SEPARATOR.join(r.encode("utf-8") for r in rows if r)

    # a DatasetDict: the "train" split; a lone string column with another name
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"content": ["t1", "t2"], "n": [1, 2]}),
        "test": datasets.Dataset.from_dict({"content": ["held out"], "n": [3]}),
    })
    dd.save_to_disk(str(tmp_path / "dd"))
    corpus = load_corpus(tmp_path / "dd", cache_dir=cache)
    assert _bytes(corpus) == b"t1" + SEPARATOR + b"t2"


def test_saved_hf_dataset_without_datasets_says_to_install_it(tmp_path, cache, monkeypatch):
    root = tmp_path / "ds"
    root.mkdir()
    (root / "state.json").write_text("{}")
    (root / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match="pip install datasets"):
        load_corpus(root, cache_dir=cache)


def test_stdlib_corpus_holds_stdlib_source(cache):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = load_corpus(None, cache_dir=cache)
    raw = _bytes(corpus)
    assert len(raw) > 1_000_000
    assert b"def " in raw
    for module in ("argparse.py", "__future__.py", "json/decoder.py"):
        assert (stdlib / module).read_bytes() in raw, module
    assert sys.version.split()[0] in corpus.source_description

    # max_bytes keeps exactly the first max_bytes bytes of the same corpus
    small = load_corpus(None, cache_dir=cache, max_bytes=100_000)
    assert _bytes(small) == raw[:100_000]
    assert "truncated" in small.source_description


def test_stdlib_corpus_leaves_out_site_packages(cache, monkeypatch, tmp_path):
    fake = tmp_path / "lib"
    (fake / "site-packages" / "pkg").mkdir(parents=True)
    (fake / "site-packages" / "pkg" / "mod.py").write_text("THIRD_PARTY = 1\n")
    (fake / "__pycache__").mkdir()
    (fake / "__pycache__" / "x.py").write_text("CACHED = 1\n")
    (fake / "os.py").write_text("import sys\n")
    (fake / "notes.txt").write_text("not python\n")
    (fake / "email").mkdir()
    (fake / "email" / "parser.py").write_text("class Parser: ...\n")
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(fake)})
    corpus = load_corpus(None, cache_dir=cache)
    assert _bytes(corpus) == b"class Parser: ...\n" + SEPARATOR + b"import sys\n"


def test_default_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_MHC_CACHE", str(tmp_path / "explicit"))
    assert data.default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("TORCH_MHC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.default_cache_dir() == tmp_path / "xdg" / "torch_mhc"

    monkeypatch.setenv("TORCH_MHC_CACHE", str(tmp_path / "env"))
    f = tmp_path / "a.txt"
    f.write_text("some text\n")
    corpus = load_corpus(f)  # no cache_dir: the environment's
    assert corpus.cache_path.parent == tmp_path / "env"


# ------------------------------------------------------------------------------------------
# Errors


def test_missing_path_is_an_error(tmp_path, cache):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(tmp_path / "nope.txt", cache_dir=cache)


def test_empty_sources_are_errors(tmp_path, cache):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path / "empty.txt", cache_dir=cache)
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="no bytes"):
        load_corpus(tmp_path / "dir", cache_dir=cache)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.dat").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="no UTF-8 text"):
        load_corpus(tmp_path / "bin", cache_dir=cache)
    assert [n for n in _cache_files(cache) if n.endswith(".bin")] == []


def test_non_text_file_is_an_error(tmp_path, cache):
    f = tmp_path / "x.txt"
    f.write_bytes(b"good start " * 10 + b"\xff\xfe bad")
    with pytest.raises(ValueError, match="not a UTF-8 text file"):
        load_corpus(f, cache_dir=cache)
    f.write_bytes(b"text\x00with a NUL")
    with pytest.raises(ValueError, match="NUL"):
        load_corpus(f, cache_dir=cache)
    f.write_bytes("ends mid-character: é".encode()[:-1])
    with pytest.raises(ValueError, match="truncated UTF-8"):
        load_corpus(f, cache_dir=cache)
    assert _cache_files(cache) == []  # nothing left behind by the failed builds


def test_bad_arguments_are_errors(tmp_path, cache):
    f = tmp_path / "a.txt"
    f.write_text("abc")
    with pytest.raises(ValueError, match="val_fraction"):
        load_corpus(f, cache_dir=cache, val_fraction=1.0)
    with pytest.raises(ValueError, match="max_bytes"):
        load_corpus(f, cache_dir=cache, max_bytes=0)


# ------------------------------------------------------------------------------------------
# Cache


def test_second_load_reuses_the_cache(tmp_path, cache, build_counter):
    f = tmp_path / "a.txt"
    f.write_text(TEXT)
    first = load_corpus(f, cache_dir=cache)
    mtime = first.cache_path.stat().st_mtime_ns
    second = load_corpus(f, cache_dir=cache, val_fraction=0.2)  # the split is not cached
    assert len(build_counter) == 1
    assert second.cache_path == first.cache_path
    assert second.cache_path.stat().st_mtime_ns == mtime
    assert _bytes(second) == TEXT.encode("utf-8")


def test_cache_is_rebuilt_when_the_source_changes(tmp_path, cache, build_counter):
    f = tmp_path / "a.txt"
    f.write_text("version one\n")
    first = load_corpus(f, cache_dir=cache)
    f.write_text("version two, longer\n")  # new size
    second = load_corpus(f, cache_dir=cache)
    assert len(build_counter) == 2
    assert _bytes(second) == b"version two, longer\n"
    assert second.cache_path != first.cache_path

    # same size, new content: the modification time tells
    st = f.stat()
    f.write_text("version TWO, longer\n")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    third = load_corpus(f, cache_dir=cache)
    assert len(build_counter) == 3
    assert _bytes(third) == b"version TWO, longer\n"

    # a file added to a folder
    root = tmp_path / "dir"
    root.mkdir()
    (root / "1.txt").write_text("one")
    load_corpus(root, cache_dir=cache)
    (root / "2.txt").write_text("two")
    assert _bytes(load_corpus(root, cache_dir=cache)) == b"one" + SEPARATOR + b"two"
    assert len(build_counter) == 5


def test_damaged_cache_is_rebuilt(tmp_path, cache, build_counter):
    f = tmp_path / "a.txt"
    f.write_text(TEXT)
    corpus = load_corpus(f, cache_dir=cache)
    path = corpus.cache_path
    del corpus
    with open(path, "r+b") as fh:  # cut it short, as a copy interrupted half way would
        fh.truncate(10)
    assert _bytes(load_corpus(f, cache_dir=cache)) == TEXT.encode("utf-8")
    assert len(build_counter) == 2


def _failing_chunks(monkeypatch, fail_on_call: int):
    """Make reading the fail_on_call-th document raise after yielding its first chunk."""
    real = data._iter_file_chunks
    calls = []

    def chunks(path):
        calls.append(path)
        if len(calls) == fail_on_call:
            yield b"partial bytes that must never reach a cache file"
            raise OSError("disk on fire")
        yield from real(path)

    monkeypatch.setattr(data, "_iter_file_chunks", chunks)


def test_failed_build_leaves_previous_cache_and_no_partial_file(tmp_path, cache, monkeypatch):
    root = tmp_path / "dir"
    root.mkdir()
    (root / "1.txt").write_text("one\n")
    (root / "2.txt").write_text("two\n")
    old = load_corpus(root, cache_dir=cache)
    before = {n: (cache / n).read_bytes() for n in _cache_files(cache)}

    # the source changes, and the rebuild dies in its second file
    (root / "3.txt").write_text("three\n")
    _failing_chunks(monkeypatch, fail_on_call=2)
    with pytest.raises(OSError, match="disk on fire"):
        load_corpus(root, cache_dir=cache)
    assert {n: (cache / n).read_bytes() for n in _cache_files(cache)} == before
    assert _bytes(old) == b"one\n" + SEPARATOR + b"two\n"


def test_failed_rebuild_under_the_same_name_leaves_nothing_half_written(
        tmp_path, cache, monkeypatch):
    root = tmp_path / "dir"
    root.mkdir()
    (root / "1.txt").write_text("one\n")
    (root / "2.txt").write_text("two\n")
    corpus = load_corpus(root, cache_dir=cache)
    bin_path = corpus.cache_path
    good = bin_path.read_bytes()
    bin_path.with_suffix(".json").unlink()  # forces a rebuild under the same name

    _failing_chunks(monkeypatch, fail_on_call=2)
    with pytest.raises(OSError, match="disk on fire"):
        load_corpus(root, cache_dir=cache)
    assert _cache_files(cache) == [bin_path.name]  # no temporary file left
    assert bin_path.read_bytes() == good

    monkeypatch.undo()
    monkeypatch.setenv("TORCH_MHC_CACHE", str(cache))
    assert _bytes(load_corpus(root, cache_dir=cache)) == good
    meta = json.loads(bin_path.with_suffix(".json").read_text())
    assert meta["n_bytes"] == len(good)


# ------------------------------------------------------------------------------------------
# Split


def test_split_is_the_contiguous_tail_and_deterministic(tmp_path, cache):
    raw = ("".join(chr(0x20 + i % 95) for i in range(1000)) + "ünïcode tail").encode()
    f = tmp_path / "a.txt"
    f.write_bytes(raw)
    for val_fraction in (0.0, 0.01, 0.1, 0.5):
        corpus = load_corpus(f, cache_dir=cache, val_fraction=val_fraction)
        n_val = round(len(raw) * val_fraction)
        assert corpus.train.tobytes() == raw[: len(raw) - n_val]
        assert corpus.val.tobytes() == raw[len(raw) - n_val:]
        again = load_corpus(f, cache_dir=cache, val_fraction=val_fraction)
        assert again.val.tobytes() == corpus.val.tobytes()
        assert again.train.tobytes() == corpus.train.tobytes()


def test_corpus_from_bytes():
    c = Corpus.from_bytes(b"0123456789", val_fraction=0.2)
    assert c.train.tobytes() == b"01234567" and c.val.tobytes() == b"89"
    with pytest.raises(ValueError, match="uint8"):
        Corpus(np.zeros(4, dtype=np.int64))


# ------------------------------------------------------------------------------------------
# Batches


def _reference_batch(raw: bytes, rng: np.random.Generator, B: int, T: int):
    """Plainly cut windows: offsets drawn exactly as the sampler documents."""
    offsets = rng.integers(0, len(raw) - T, size=B)
    x = [list(raw[o: o + T]) for o in offsets]
    y = [list(raw[o + 1: o + T + 1]) for o in offsets]
    return torch.tensor(x, dtype=torch.long), torch.tensor(y, dtype=torch.long)


def test_batch_sampler_draws_documented_windows():
    raw = TEXT.encode("utf-8")
    tokens = np.frombuffer(raw, dtype=np.uint8)
    B, T = 5, 13
    sampler = BatchSampler(tokens, batch_size=B, seq_len=T, seed=7)
    ref_rng = np.random.default_rng(7)
    for _ in range(4):
        x, y = sampler.next()
        ref_x, ref_y = _reference_batch(raw, ref_rng, B, T)
        assert x.dtype == torch.long and y.dtype == torch.long
        assert x.is_contiguous() and y.is_contiguous()
        assert torch.equal(x, ref_x) and torch.equal(y, ref_y)
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert sampler.step == 4

    # a corpus of exactly T+1 bytes has one window
    x, y = next(BatchSampler(tokens[: T + 1], batch_size=3, seq_len=T, seed=0))
    assert torch.equal(x, torch.tensor([list(raw[:T])] * 3))
    assert torch.equal(y, torch.tensor([list(raw[1: T + 1])] * 3))


def test_batch_sampler_seeds():
    tokens = np.frombuffer(TEXT.encode("utf-8"), dtype=np.uint8)
    a = [BatchSampler(tokens, 4, 8, seed=1).next() for _ in range(2)]
    assert torch.equal(a[0][0], a[1][0])
    b = BatchSampler(tokens, 4, 8, seed=2).next()
    assert not torch.equal(a[0][0], b[0])


def test_batch_sampler_resume_draws_the_same_batches(tmp_path):
    tokens = np.frombuffer(TEXT.encode("utf-8"), dtype=np.uint8)
    k, m = 3, 4
    run = BatchSampler(tokens, batch_size=4, seq_len=16, seed=123)
    for _ in range(k):
        run.next()
    torch.save({"data": run.state_dict()}, tmp_path / "ckpt.pt")  # as a checkpoint would
    uninterrupted = [run.next() for _ in range(m)]

    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["data"]
    resumed = BatchSampler(tokens, batch_size=4, seq_len=16, seed=999)  # seed is restored
    resumed.load_state_dict(state)
    assert resumed.step == k and resumed.seed == 123
    for (x0, y0), (x1, y1) in zip(uninterrupted, (resumed.next() for _ in range(m)),
                                  strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)

    with pytest.raises(ValueError, match="saved for"):
        BatchSampler(tokens, batch_size=4, seq_len=8, seed=0).load_state_dict(state)


def test_too_short_corpus_is_an_error():
    tokens = np.frombuffer(b"abcdefgh", dtype=np.uint8)  # 8 bytes
    with pytest.raises(ValueError, match=r"need at least T\+1 = 9 bytes .* got 8"):
        BatchSampler(tokens, batch_size=2, seq_len=8, seed=0)
    with pytest.raises(ValueError, match="corpus shorter than one batch"):
        val_batches(tokens, batch_size=2, seq_len=8, max_batches=1)
    with pytest.raises(ValueError, match="corpus shorter than one batch"):
        BatchSampler(tokens[:0], batch_size=1, seq_len=1, seed=0)


def test_val_batches_are_fixed_evenly_spread_windows():
    raw = TEXT.encode("utf-8")
    tokens = np.frombuffer(raw, dtype=np.uint8)
    B, T = 3, 10
    W = (len(raw) - 1) // T
    first = list(val_batches(tokens, B, T, max_batches=4))
    second = list(val_batches(tokens, B, T, max_batches=4))
    assert len(first) == 4
    k = 4 * B
    starts = [(i * W // k) * T for i in range(k)]
    gaps = np.diff(starts)
    assert (gaps >= T).all()  # non-overlapping windows
    assert starts[-1] >= (W - W // k - 1) * T  # spread over the whole array, not its head
    for j, ((x, y), (x2, y2)) in enumerate(zip(first, second, strict=True)):
        assert torch.equal(x, x2) and torch.equal(y, y2)
        rows = starts[j * B: (j + 1) * B]
        assert torch.equal(x, torch.tensor([list(raw[s: s + T]) for s in rows]))
        assert torch.equal(y, torch.tensor([list(raw[s + 1: s + T + 1]) for s in rows]))

    # more batches asked than fit: every window once, in full batches only
    all_batches = list(val_batches(tokens, B, T, max_batches=10_000))
    assert len(all_batches) == W // B
    assert all(x.shape == (B, T) for x, _ in all_batches)
    # fewer windows than one batch: one short batch
    (x, y), = val_batches(tokens[: 2 * T + 1], batch_size=8, seq_len=T, max_batches=3)
    assert torch.equal(x, torch.tensor([list(raw[:T]), list(raw[T: 2 * T])]))


def test_bits_per_byte_and_byte_codec():
    assert data.bits_per_byte(math.log(2)) == pytest.approx(1.0, rel=1e-15)
    assert data.bits_per_byte(2.5) == pytest.approx(2.5 * math.log2(math.e), rel=1e-15)
    t = data.bits_per_byte(torch.tensor([math.log(4.0)], dtype=torch.float64))
    assert t.item() == pytest.approx(2.0, rel=1e-15)

    text = "naïve ✓ text"
    ids = data.encode(text)
    assert ids.dtype == torch.long and ids.tolist() == list(text.encode("utf-8"))
    assert data.decode(ids) == text
    assert data.decode([0x61, 0xFF, 0x62]) == "a\ufffdb"
    with pytest.raises(ValueError, match="byte ids"):
        data.decode([256])


def test_symbolic_link_loops_are_one_clear_error(tmp_path, cache):
    (tmp_path / "self").symlink_to("self")  # a link to itself
    (tmp_path / "a").symlink_to("b")  # two links leading to each other
    (tmp_path / "b").symlink_to("a")
    for name in ("self", "a"):
        with pytest.raises(ValueError, match=rf"data source .*{name}'.*symbolic link loop at "
                                             rf"{tmp_path}.*expected a text file"):
            load_corpus(tmp_path / name, cache_dir=cache)
    with pytest.raises(ValueError, match="symbolic link loop"):  # a loop inside the path
        load_corpus(tmp_path / "self" / "x.txt", cache_dir=cache)
    with pytest.raises(FileNotFoundError, match="does not exist"):  # a dangling link
        (tmp_path / "dangling").symlink_to("nowhere")
        load_corpus(tmp_path / "dangling", cache_dir=cache)


def test_folder_with_looping_links_reads_its_files(tmp_path, cache):
    # Inside a folder, links that loop (to a file name or to the folder itself) are skipped;
    # links to files are read as those files.
    root = tmp_path / "texts"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.txt").write_text("alpha")
    (root / "sub" / "up").symlink_to("..")  # a folder loop: not followed
    (root / "x").symlink_to("y")
    (root / "y").symlink_to("x")
    (root / "link.txt").symlink_to(root / "sub" / "a.txt")
    corpus = load_corpus(root, cache_dir=cache)
    assert _bytes(corpus) == b"alpha" + SEPARATOR + b"alpha"  # link.txt, sub/a.txt
    only_loops = tmp_path / "loops"
    only_loops.mkdir()
    (only_loops / "p").symlink_to("q")
    (only_loops / "q").symlink_to("p")
    with pytest.raises(ValueError, match=rf"folder {only_loops} holds no bytes"):
        load_corpus(only_loops, cache_dir=cache)
