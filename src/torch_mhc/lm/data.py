"""Byte-level corpora, their on-disk cache, and training / evaluation batches.

Tokens are raw bytes (vocabulary 256, `VOCAB_SIZE`): no tokenizer to download or train, and
every corpus is just a uint8 array. The loss in nats per token therefore converts directly
to bits per byte (`bits_per_byte`).

    corpus = load_corpus(None)                     # Python's own standard library source
    corpus = load_corpus("notes.txt")              # a UTF-8 text file
    corpus = load_corpus("my_texts/")              # every UTF-8 text file under a folder
    corpus = load_corpus("saved_ds/")              # a `datasets` dataset saved with save_to_disk
    sampler = BatchSampler(corpus.train, batch_size=8, seq_len=256, seed=0)
    x, y = sampler.next()                          # [B, T] int64 each, y = x shifted by one
    for x, y in val_batches(corpus.val, 8, 256, max_batches=20): ...

Sources
-------
- None: the source of the running interpreter's standard library, every `*.py` file under
  `sysconfig.get_paths()["stdlib"]`, in sorted order (about 30 MB on CPython 3.11 with its
  test suite; Linux distributions that ship `test/` separately give less). Directories named
  `site-packages` or `dist-packages` are left out (third-party code that differs from machine
  to machine), as are hidden and `__pycache__` directories. The test suite is kept: it is
  ordinary Python and most of the bytes. Files that are not UTF-8 (a handful of deliberately
  mis-encoded test modules) are skipped.
- A file: must be UTF-8 text, else a ValueError.
- A folder: every regular file under it, recursively, in sorted order of the relative path,
  whose content is UTF-8 text; hidden files and folders (names starting with ".") are
  skipped, so a `.git` directory never leaks in. Text is recognised by content, not by
  suffix, so `.txt`, `.md`, `.py`, `.c`, `.json`, `Makefile` ... all count, and binaries are
  skipped (counted in the description). A symbolic link to a file counts as that file; links
  to folders are not followed (no walk can loop), and links that dangle or loop are skipped.
- A folder holding a Hugging Face dataset written by `save_to_disk` (it has `state.json` and
  `dataset_info.json`, or `dataset_dict.json`): needs the `datasets` package. Each row of the
  "text" column (or of the only string column) is one document. For a DatasetDict the "train"
  split is used, or the only split.

"UTF-8 text" means: decodes as UTF-8 and contains no NUL byte (NUL is how git and grep tell a
binary file from text; valid UTF-8 alone lets through e.g. all-ASCII binary formats).
The source path itself is followed through its symbolic links; a loop among them (a link to
itself, or links that lead to each other) is a ValueError naming the path, a missing target a
FileNotFoundError.
Documents are concatenated with `SEPARATOR` (b"\\n\\n") between them.

Cache
-----
The bytes are written once to `<cache_dir>/<kind>-<key>.bin` (raw uint8, opened with
`numpy.memmap`, so a 30 MB or 30 GB corpus costs no RAM and a second run starts at once) with
a small `.json` beside it. The key hashes the source's identity: for every file its path,
size and modification time, plus `max_bytes`, the separator, a format version and, for the
standard library, the Python version. Any change to the source gives a new key, hence a new
build; the old files stay until deleted. The cache directory is `cache_dir`, else
`$TORCH_MHC_CACHE`, else `$XDG_CACHE_HOME/torch_mhc`, else `~/.cache/torch_mhc`.
A build streams one file (in chunks of `_CHUNK_BYTES`) at a time into a temporary file in the
cache directory and moves it into place with `os.replace` only when complete, so a crash or
an error leaves no partial cache under the final name.

Split
-----
The last `val_fraction` of the bytes (rounded) is validation, the rest is training. A
contiguous tail rather than randomly chosen windows, because neighbouring windows of a text
overlap and share most of their content: interleaving train and validation windows would
score the model on text it has effectively trained on. A contiguous tail is text the model
never sees (for the standard library, the last modules in sorted order).

Batches
-------
`BatchSampler` draws windows at uniformly random offsets with its own `numpy` Generator, so
its batches depend only on the seed and the number of batches drawn; `state_dict()` saves
exactly that, and a restored sampler continues with the batches an uninterrupted run would
have drawn. Data-parallel ranks should use different seeds (e.g. seed + rank).
`val_batches` yields a fixed set of non-overlapping windows spread evenly over the
validation bytes, the same set on every call, so evaluations are comparable across steps and
runs.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import hashlib
import json
import math
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from torch_mhc.lm.model import BYTE_VOCAB
from torch_mhc.runtime.files import atomic_write, temp_file

__all__ = [
    "SEPARATOR",
    "VOCAB_SIZE",
    "BatchSampler",
    "BatchShapeChanged",
    "Corpus",
    "bits_per_byte",
    "decode",
    "default_cache_dir",
    "encode",
    "load_corpus",
    "val_batches",
]

VOCAB_SIZE = BYTE_VOCAB  # bytes
SEPARATOR = b"\n\n"  # between documents (files, dataset rows)

_FORMAT_VERSION = 1  # bump when the cache layout or the document rules change
_CHUNK_BYTES = 8 << 20  # read files in 8 MiB chunks: never a whole corpus in memory
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # for the stdlib corpus


# ------------------------------------------------------------------------------------------
# Byte tokenisation


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of `text` as token ids, int64 [len(bytes)]."""
    return torch.from_numpy(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64))


def decode(ids: torch.Tensor | np.ndarray | Iterable[int]) -> str:
    """Text of a sequence of byte ids; an invalid UTF-8 sequence becomes U+FFFD."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        raise ValueError(f"byte ids must lie in [0, {VOCAB_SIZE}), got [{arr.min()}, {arr.max()}]")
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def bits_per_byte(loss_nats: float | torch.Tensor) -> float | torch.Tensor:
    """Cross-entropy in nats per byte -> bits per byte (one token is one byte)."""
    return loss_nats / math.log(2)


# ------------------------------------------------------------------------------------------
# Sources: what to read, and the identity that keys the cache


@dataclass(frozen=True)
class _Document:
    name: str  # for messages
    chunks: Callable[[], Iterator[bytes]]  # called once, when the document is written
    check_text: bool  # files are checked for UTF-8; dataset rows are str, hence valid


@dataclass(frozen=True)
class _Source:
    kind: str  # "stdlib" | "file" | "folder" | "hf": the cache file's prefix
    label: str  # human description without the counts, e.g. "folder /data/texts"
    identity: dict  # everything the cached bytes depend on (besides max_bytes)
    documents: Callable[[], Iterator[_Document]]
    total_bytes: int | None  # for the progress bar
    strict: bool  # a non-text document is an error (single file) rather than skipped


def _iter_file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            yield chunk


def _walk_files(root: Path, keep_dir: Callable[[str], bool],
                keep_file: Callable[[str], bool]) -> list[tuple[str, Path]]:
    """(relative posix path, path) of the regular files under root, sorted by the relative
    path, so the order never depends on the file system's directory order."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if keep_dir(d)]  # prune in place
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        for name in filenames:
            full = os.path.join(dirpath, name)
            if keep_file(name) and os.path.isfile(full):
                found.append((name if rel_dir == "." else f"{rel_dir}/{name}", Path(full)))
    found.sort(key=lambda e: e[0])
    return found


def _stat_files(entries: list[tuple[str, Path]]) -> list[list]:
    """[relative path, size, mtime_ns] for each file: the cache key's view of them."""
    out = []
    for rel, p in entries:
        st = p.stat()
        out.append([rel, st.st_size, st.st_mtime_ns])
    return out


def _file_documents(files: list[Path]) -> Callable[[], Iterator[_Document]]:
    def documents() -> Iterator[_Document]:
        for p in files:
            # bind p now: the lambda is called after the loop has moved on
            yield _Document(str(p), lambda p=p: _iter_file_chunks(p), check_text=True)
    return documents


def _stdlib_source() -> _Source:
    root = Path(sysconfig.get_paths()["stdlib"])
    entries = _walk_files(
        root,
        keep_dir=lambda d: d not in _SKIPPED_DIRS and not d.startswith("."),
        keep_file=lambda f: f.endswith(".py") and not f.startswith("."),
    )
    if not entries:
        raise ValueError(f"found no *.py files under the standard library directory {root}")
    stats = _stat_files(entries)
    version = sys.version.split()[0]
    return _Source(
        kind="stdlib",
        label=f"Python {version} standard library source ({root})",
        identity={"root": str(root), "python": sys.version, "files": stats},
        documents=_file_documents([p for _, p in entries]),
        total_bytes=sum(s[1] for s in stats),
        strict=False,
    )


def _is_saved_hf_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


def _hf_source(folder: Path) -> _Source:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"{folder} is a Hugging Face dataset saved with save_to_disk; reading it needs the "
            "`datasets` package: pip install datasets"
        ) from e
    # every file of the saved dataset keys the cache (arrow shards, state, info)
    stats = _stat_files(_walk_files(folder, keep_dir=lambda d: True, keep_file=lambda f: True))

    def documents() -> Iterator[_Document]:
        ds = datasets.load_from_disk(str(folder))
        if isinstance(ds, datasets.DatasetDict):
            splits = list(ds.keys())
            if "train" in ds:
                ds = ds["train"]
            elif len(splits) == 1:
                ds = ds[splits[0]]
            else:
                raise ValueError(
                    f"{folder} is a DatasetDict with splits {splits}; expected a 'train' "
                    "split or a single split"
                )
        column = _text_column(ds, folder)
        for i, batch in enumerate(ds.iter(batch_size=1024)):
            for j, text in enumerate(batch[column]):
                if text:  # None and "" add nothing, not even a separator
                    data = text.encode("utf-8")
                    yield _Document(f"{folder} row {i * 1024 + j}", lambda d=data: iter((d,)),
                                    check_text=False)

    return _Source(
        kind="hf",
        label=f"Hugging Face dataset {folder}",
        identity={"root": str(folder), "files": stats},
        documents=documents,
        total_bytes=None,  # rows are counted in characters, not known in bytes up front
        strict=False,
    )


def _text_column(ds, folder: Path) -> str:
    """The "text" column if it holds strings, else the only string column."""
    string_cols = [
        name for name, feat in ds.features.items()
        if getattr(feat, "dtype", None) in ("string", "large_string")
    ]
    if "text" in string_cols:
        return "text"
    if len(string_cols) == 1:
        return string_cols[0]
    raise ValueError(
        f"cannot choose the text column of the dataset at {folder}: expected a string column "
        f"named 'text' or exactly one string column; columns are {dict(ds.features)}"
    )


def _loop_error(source, where) -> ValueError:
    return ValueError(
        f"data source {str(source)!r}: symbolic link loop at {where} (a link that leads, "
        "through others or directly, back to itself); expected a text file, a folder of text "
        "files or a saved Hugging Face dataset"
    )


def _resolve_path(source: str | os.PathLike) -> Path:
    """The absolute path of an existing source with every link followed; a missing path is a
    FileNotFoundError, a symbolic link loop a ValueError naming it (never pathlib's
    RuntimeError, which Python < 3.13 raises for a loop)."""
    given = Path(source).expanduser()
    try:
        path = given.resolve()
    except RuntimeError as e:
        where = str(e).removeprefix("Symlink loop from ").strip("'\"")  # pathlib's %r
        raise _loop_error(source, where) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _loop_error(source, e.filename or given) from None
        raise
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(
            f"data source {str(source)!r} does not exist (resolved to {path})"
        ) from None
    except OSError as e:
        if e.errno == errno.ELOOP:  # Python >= 3.13 resolves a loop without raising
            raise _loop_error(source, path) from None
        raise
    return path


def _resolve_source(source: str | os.PathLike | None) -> _Source:
    if source is None:
        return _stdlib_source()
    path = _resolve_path(source)
    if path.is_dir():
        if _is_saved_hf_dataset(path):
            return _hf_source(path)
        entries = _walk_files(path, keep_dir=lambda d: not d.startswith("."),
                              keep_file=lambda f: not f.startswith("."))
        stats = _stat_files(entries)
        if sum(s[1] for s in stats) == 0:
            raise ValueError(f"folder {path} holds no bytes: no non-empty, non-hidden files")
        return _Source(
            kind="folder",
            label=f"folder {path}",
            identity={"root": str(path), "files": stats},
            documents=_file_documents([p for _, p in entries]),
            total_bytes=sum(s[1] for s in stats),
            strict=False,
        )
    if not path.is_file():
        raise ValueError(f"data source {path} is neither a regular file nor a folder")
    st = path.stat()
    if st.st_size == 0:
        raise ValueError(f"data file {path} is empty (0 bytes): nothing to train on")
    return _Source(
        kind="file",
        label=f"text file {path}",
        identity={"root": str(path), "files": [[path.name, st.st_size, st.st_mtime_ns]]},
        documents=_file_documents([path]),
        total_bytes=st.st_size,
        strict=True,
    )


# ------------------------------------------------------------------------------------------
# The cache: build once (streaming, atomic), then memory-map


def default_cache_dir() -> Path:
    """`$TORCH_MHC_CACHE`, else `$XDG_CACHE_HOME/torch_mhc`, else `~/.cache/torch_mhc`."""
    if env := os.environ.get("TORCH_MHC_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "torch_mhc"


def _cache_key(source: _Source, max_bytes: int | None) -> str:
    ident = {
        "format": _FORMAT_VERSION,
        "kind": source.kind,
        "separator": SEPARATOR.hex(),
        "max_bytes": max_bytes,
        **source.identity,
    }
    blob = json.dumps(ident, sort_keys=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:20]


class _NotText(Exception):
    pass


def _check_text(chunk: bytes, decoder: codecs.IncrementalDecoder, offset: int) -> None:
    if (i := chunk.find(b"\0")) >= 0:
        raise _NotText(f"NUL byte at offset {offset + i}")
    try:
        decoder.decode(chunk)  # the str is dropped at once: one chunk at a time
    except UnicodeDecodeError as e:
        raise _NotText(f"invalid UTF-8 near byte offset {offset + e.start}") from None


@dataclass
class _BuildStats:
    n_bytes: int = 0
    n_documents: int = 0
    skipped: int = 0
    truncated: bool = False


def _write_documents(f, source: _Source, max_bytes: int | None, progress) -> _BuildStats:
    """Concatenate the source's documents into the open binary file f, SEPARATOR between.

    A document found not to be text is undone (truncate back to where it began) and skipped,
    or raises ValueError for a strict source. Stops once max_bytes are written.
    """
    stats = _BuildStats()
    limit = max_bytes if max_bytes is not None else math.inf

    def put(data: bytes) -> None:
        room = limit - stats.n_bytes
        if len(data) > room:
            data = data[: int(room)]
            stats.truncated = True
        f.write(data)
        stats.n_bytes += len(data)

    for doc in source.documents():
        if stats.n_bytes >= limit:
            stats.truncated = True
            break
        start = stats.n_bytes
        decoder = codecs.getincrementaldecoder("utf-8")()
        doc_len = 0
        chunks = doc.chunks()
        try:
            for chunk in chunks:
                progress.update(len(chunk))
                if doc.check_text:
                    _check_text(chunk, decoder, doc_len)
                if not chunk:
                    continue
                if doc_len == 0 and start > 0:
                    put(SEPARATOR)
                doc_len += len(chunk)
                put(chunk)
                if stats.n_bytes >= limit:
                    break  # the rest of this document is never read, hence never checked
            else:
                if doc.check_text:
                    try:
                        decoder.decode(b"", final=True)  # a multi-byte character cut at EOF
                    except UnicodeDecodeError:
                        raise _NotText("truncated UTF-8 sequence at end of file") from None
        except _NotText as e:
            if source.strict:
                raise ValueError(f"{doc.name} is not a UTF-8 text file: {e}") from None
            f.seek(start)
            f.truncate()
            stats.n_bytes = start
            stats.skipped += 1
            continue
        finally:
            if hasattr(chunks, "close"):
                chunks.close()  # close the file of a document left half read
        if doc_len:
            stats.n_documents += 1
    return stats


def _describe(source: _Source, stats: _BuildStats) -> str:
    parts = [f"{stats.n_documents:,} document{'' if stats.n_documents == 1 else 's'}",
             f"{stats.n_bytes:,} bytes"]
    if stats.truncated:
        parts.append("truncated by max_bytes")
    if stats.skipped:
        parts.append(f"{stats.skipped:,} non-text files skipped")
    return f"{source.label}: {', '.join(parts)}"


def _build_cache(source: _Source, bin_path: Path, meta_path: Path,
                 max_bytes: int | None) -> dict:
    """Write the corpus to bin_path (+ metadata), atomically; return the metadata."""
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file(bin_path)
    try:
        total = source.total_bytes
        if total is not None and max_bytes is not None:
            total = min(total, max_bytes)
        # delay: only a build that takes a noticeable time shows a bar; disable=None: no bar
        # when stderr is not a terminal (log files)
        with os.fdopen(fd, "w+b") as f, tqdm(
            total=total, unit="B", unit_scale=True, desc=f"caching {source.kind} corpus",
            file=sys.stderr, delay=1.0, disable=None, leave=False,
        ) as progress:
            stats = _write_documents(f, source, max_bytes, progress)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        if stats.n_bytes == 0:
            raise ValueError(
                f"{source.label} holds no UTF-8 text: nothing to train on "
                f"({stats.skipped} non-text files skipped)"
            )
        meta = {
            "format": _FORMAT_VERSION,
            "n_bytes": stats.n_bytes,
            "description": _describe(source, stats),
        }
        # the .bin last: a reader trusts a .bin only with a .json that states its exact size
        atomic_write(meta_path, json.dumps(meta).encode())
        os.replace(tmp, bin_path)
        return meta
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _read_cache(bin_path: Path, meta_path: Path) -> dict | None:
    """The metadata of a complete cache entry, or None (absent, stale format, wrong size)."""
    try:
        meta = json.loads(meta_path.read_text())
        size = bin_path.stat().st_size
    except (OSError, ValueError):
        return None
    if meta.get("format") != _FORMAT_VERSION or meta.get("n_bytes") != size:
        return None
    return meta


# ------------------------------------------------------------------------------------------
# Corpus


class Corpus:
    """A byte corpus split into a training head and a validation tail.

    tokens: uint8 [N] (a numpy.memmap for a cached corpus, any 1-D uint8 array otherwise).
    train = tokens[:N - n_val], val = tokens[N - n_val:], n_val = round(N * val_fraction).
    """

    def __init__(self, tokens: np.ndarray, val_fraction: float = 0.01,
                 source_description: str = "in-memory bytes", cache_path: Path | None = None):
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if tokens.ndim != 1 or tokens.dtype != np.uint8:
            raise ValueError(
                f"tokens must be a 1-D uint8 array, got {tokens.ndim}-D {tokens.dtype}"
            )
        self.tokens = tokens  # [N]
        self.val_fraction = val_fraction
        self.n_val = int(round(len(tokens) * val_fraction))
        self.source_description = source_description
        self.cache_path = cache_path

    @classmethod
    def from_bytes(cls, data: bytes, val_fraction: float = 0.01,
                   source_description: str = "in-memory bytes") -> Corpus:
        return cls(np.frombuffer(data, dtype=np.uint8), val_fraction, source_description)

    @property
    def train(self) -> np.ndarray:
        return self.tokens[: len(self.tokens) - self.n_val]  # [N - n_val]

    @property
    def val(self) -> np.ndarray:
        return self.tokens[len(self.tokens) - self.n_val:]  # [n_val]

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return (f"Corpus({self.source_description}; train {len(self.train):,} bytes, "
                f"val {len(self.val):,} bytes)")


def load_corpus(source: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None,
                val_fraction: float = 0.01, max_bytes: int | None = None) -> Corpus:
    """Load a byte corpus (see the module docstring for sources), building its cache if needed.

    source: None for the standard library source, or a text file, a folder, or a saved
    Hugging Face dataset. max_bytes: keep only the first max_bytes bytes (a quick run need
    not read the whole corpus); it is part of the cache key. The split (val_fraction) is
    applied at load time and never causes a rebuild.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
        raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
    src = _resolve_source(source)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    stem = f"{src.kind}-{_cache_key(src, max_bytes)}"
    bin_path, meta_path = cache / f"{stem}.bin", cache / f"{stem}.json"
    meta = _read_cache(bin_path, meta_path)
    if meta is None:
        meta = _build_cache(src, bin_path, meta_path, max_bytes)
    tokens = np.memmap(bin_path, dtype=np.uint8, mode="r")  # [N], read-only, paged in lazily
    return Corpus(tokens, val_fraction, meta["description"], bin_path)


# ------------------------------------------------------------------------------------------
# Batches


def _check_tokens(tokens: np.ndarray, seq_len: int) -> None:
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1:
        raise ValueError(f"tokens must be a 1-D numpy array, got {type(tokens).__name__} "
                         f"with shape {getattr(tokens, 'shape', None)}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must have an integer dtype, got {tokens.dtype}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"corpus shorter than one batch: need at least T+1 = {seq_len + 1} bytes "
            f"(seq_len {seq_len} plus the shifted target), got {len(tokens)}"
        )


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a.astype(np.int64))  # astype copies: contiguous, writable
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class BatchSampler:
    """Random windows of a token array: next() -> (x, y), int64 [B, T] each, y[:, t] = x[:, t+1]
    in the underlying text (y is x shifted left by one).

    Offsets are uniform over every window that fits, drawn by a numpy Generator seeded with
    `seed`; the batches depend only on (tokens, batch_size, seq_len, seed, step).
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
                 device: str | torch.device = "cpu"):
        _check_tokens(tokens, seq_len)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tokens = tokens  # [N]
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.device = torch.device(device)
        self.step = 0  # batches drawn so far
        self._rng = np.random.default_rng(seed)
        self._window = np.arange(seq_len + 1)  # [T+1]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        # a window [o, o + T] (T+1 bytes) fits when o <= N - T - 1
        offsets = self._rng.integers(0, len(self.tokens) - T, size=self.batch_size)  # [B]
        buf = self.tokens[offsets[:, None] + self._window]  # [B, T+1]
        self.step += 1
        return _to_device(buf[:, :-1], self.device), _to_device(buf[:, 1:], self.device)

    __next__ = next

    def __iter__(self) -> BatchSampler:
        return self

    def state_dict(self) -> dict:
        """Where the sampler is: RNG state and batches drawn (plain Python values)."""
        return {
            "seed": self.seed,
            "step": self.step,
            "rng": self._rng.bit_generator.state,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "n_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; the data and batch shape must match those it was saved with,
        else the batches would silently differ from an uninterrupted run's
        (BatchShapeChanged)."""
        mine = {"batch_size": self.batch_size, "seq_len": self.seq_len,
                "n_tokens": len(self.tokens)}
        theirs = {k: state.get(k) for k in mine}
        if mine != theirs:
            if not all(isinstance(v, int) for v in theirs.values()):  # damaged, not changed
                raise ValueError(f"sampler state holds no batch shape: {theirs}")
            raise BatchShapeChanged(theirs, mine)
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]
        self._rng = rng
        self.seed = state["seed"]
        self.step = state["step"]


class BatchShapeChanged(ValueError):
    """A sampler's state loaded into a sampler of another batch size, sequence length or
    data: `saved` and `now`, {"batch_size", "seq_len", "n_tokens"} each."""

    def __init__(self, saved: dict, now: dict):
        self.saved, self.now = saved, now
        super().__init__(f"sampler state was saved for {saved}, this sampler has {now}")

    def describe(self) -> str:
        """The two as words: batches of B x T tokens from N training tokens."""
        def words(d):
            return (f"batches of {d['batch_size']} x {d['seq_len']} tokens from "
                    f"{d['n_tokens']:,} training tokens")
        return f"{words(self.saved)}; this launch has {words(self.now)}"


def val_batches(tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int,
                device: str | torch.device = "cpu") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of evaluation batches (x, y), int64 [b, T] each: the same on every call.

    The array is cut into W = (N - 1) // T non-overlapping windows; k of them, spread evenly
    over the array, are used, where k = min(max_batches, W // batch_size) * batch_size. All
    batches therefore have batch_size rows, except when W < batch_size: then one batch of W
    rows. Every batch holding the same number of tokens keeps a mean of batch losses equal to
    the mean over tokens.
    """
    # checked here, at the call; the generator below would only check at the first batch
    _check_tokens(tokens, seq_len)
    if batch_size < 1 or max_batches < 1:
        raise ValueError(f"batch_size and max_batches must be >= 1, got {batch_size}, "
                         f"{max_batches}")
    W = (len(tokens) - 1) // seq_len  # window i covers [i*T, (i+1)*T], T+1 bytes
    k = min(max_batches, W // batch_size) * batch_size if W >= batch_size else W
    starts = (np.arange(k) * W // k) * seq_len  # [k], evenly spread, increasing
    return _val_batch_iter(tokens, starts, batch_size, seq_len, torch.device(device))


def _val_batch_iter(tokens: np.ndarray, starts: np.ndarray, batch_size: int, seq_len: int,
                    device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    window = np.arange(seq_len + 1)  # [T+1]
    for b in range(0, len(starts), batch_size):
        buf = tokens[starts[b: b + batch_size, None] + window]  # [b, T+1]
        yield _to_device(buf[:, :-1], device), _to_device(buf[:, 1:], device)
