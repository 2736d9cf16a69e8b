"""Build, cache and verify the native CPU library (ops/cpu/native.c) on its first use.

Nothing here runs at import; `build_library()` is called by the first native op
(native.load) and returns the path of a complete library, or None after one warning.
`build_decode_calls()` builds decode_calls.c, the decoding calls as Python built-ins, at the
first decoding call (native.NativeOps.decoding_calls), the same way against the running
Python's headers; without them it returns None, with no warning (ctypes then makes the
calls).

- Compiler: $CC parsed as a shell would ("ccache gcc -O2" is a command with arguments),
  else cc, gcc or clang on PATH; $CFLAGS (also parsed as a shell would) is appended to our
  flags and to the CPU's tuning defines (tuning_flags). OpenMP (-fopenmp) first; a
  compiler without it builds the serial library.
- Cache: torch_mhc_cpu_<key>.so (torch_mhc_decode_calls_<key><Python's extension suffix>)
  in $TORCH_MHC_CACHE, else $XDG_CACHE_HOME/torch_mhc, else
  ~/.cache/torch_mhc; key = sha256 of the source, the command, the flags and the CPU's
  signature (-march=native depends on it), and the Python version for the extension.
- Publishing: the compiler writes into a private temporary directory; the bytes are copied
  to a temporary file in the cache, fsynced and renamed over the final name
  (files.atomic_write), then the same for a sidecar <name>.sha256 holding the library's
  hash. Concurrent builders publish identical complete files.
- Verification: a cached library is used only when its bytes hash to the sidecar. A file cut
  short (a crash or a full disk mid-write) is rebuilt instead of handed to dlopen: mapping a
  truncated ELF file kills the process with SIGBUS when the missing pages are touched, which
  no exception handler can catch.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

from torch_mhc.runtime.files import atomic_write, fsync_dir

__all__ = [
    "build_decode_calls", "build_library", "cache_dir", "defined_macros", "library_flags",
    "warn_fallback",
]

SOURCE = Path(__file__).with_name("native.c")
DECODE_CALLS_SOURCE = Path(__file__).with_name("decode_calls.c")
FLAGS = ["-O3", "-march=native", "-std=gnu11", "-ffp-contract=fast", "-shared", "-fPIC"]
OPENMP = ["-fopenmp"]
_BUILD_TIMEOUT_S = 600


def cache_dir() -> Path:
    if os.environ.get("TORCH_MHC_CACHE"):
        return Path(os.environ["TORCH_MHC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torch_mhc"


def warn_fallback(why: str) -> None:
    """The one warning of a process whose native library is unavailable."""
    warnings.warn(
        f"torch_mhc: native CPU kernels unavailable ({why}); the 'cpu' ops use their "
        "pure-torch fallback instead (same results, slower). Install a C compiler (cc, gcc "
        "or clang on PATH, or set CC), or set TORCH_MHC_NATIVE=0 to use the fallback "
        "without this warning.",
        RuntimeWarning,
        stacklevel=4,
    )


def _compiler() -> list[str] | None:
    """The compiler command as an argument list, or None when there is none."""
    if os.environ.get("CC", "").strip():
        return shlex.split(os.environ["CC"])
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def _cpuinfo(field: str) -> str:
    """The value of the first line of /proc/cpuinfo whose key is field ("model": "2"; ""
    where there is none)."""
    for line in _cpuinfo_lines():
        key, _, value = line.partition(":")
        if key.strip() == field:
            return value.strip()
    return ""


@functools.cache
def _cpuinfo_lines() -> tuple[str, ...]:
    """/proc/cpuinfo's lines up to the first blank one (the first CPU's), read once."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return ()
    text = cpuinfo.read_text(errors="replace")
    return tuple(text.split("\n\n", 1)[0].splitlines())


def _cpu_signature() -> str:
    """What -march=native and tuning_flags depend on: the machine, its CPU family, model
    and flags."""
    return (f"{platform.machine()}|{platform.processor()}|{_cpuinfo('cpu family')}|"
            f"{_cpuinfo('model')}|{_cpuinfo('flags')}")


# AMD's Zen 5 laptop parts (family 26: Strix Point's models 0x20-0x2f, Krackan Point's
# 0x60-0x6f) run AVX-512 on 256-bit datapaths, as Zen 4 does.
_ZEN5_HALF_WIDTH_MODELS = (range(0x20, 0x30), range(0x60, 0x70))


def tuning_flags() -> list[str]:
    """Defines for this CPU: 16-float vectors in the training forward's x @ phi where a
    512-bit FMA does twice the work of a 256-bit one (native.c's xphi_tile16): Intel CPUs
    with AVX-512 (measured on a Xeon with two 512-bit FMA ports) and AMD's from Zen 5 (CPU
    family 26) on, whose server and desktop parts have 512-bit FMA units (measured on an
    EPYC, model 2). Zen 4 (family 25) and Zen 5's laptop parts run a 512-bit FMA as two
    halves, so there they would do no more work and the padding would cost a third more.
    $CFLAGS may set the width itself (library_flags): -DTORCH_MHC_SKINNY_W=8 keeps the
    8-float loops, for Intel parts with one 512-bit FMA port."""
    if "avx512f" not in _cpuinfo("flags").split():
        return []
    if _cpuinfo("vendor_id") == "GenuineIntel":
        return ["-DTORCH_MHC_SKINNY_W=16"]
    family, model = _cpuinfo("cpu family"), _cpuinfo("model")
    if (_cpuinfo("vendor_id") == "AuthenticAMD" and family.isdigit() and int(family) >= 26
            and not (int(family) == 26 and model.isdigit()
                     and any(int(model) in r for r in _ZEN5_HALF_WIDTH_MODELS))):
        return ["-DTORCH_MHC_SKINNY_W=16"]
    return []


def library_flags(openmp: bool = True, cflags: Sequence[str] | None = None) -> list[str]:
    """The flags the library is built with: ours, OpenMP's (with openmp) and the CPU's
    tuning defines, then cflags ($CFLAGS where None), whose defines take the place of ours
    of the same name (-DTORCH_MHC_SKINNY_W=8 on a CPU that tuning_flags gives 16: one
    define, not two that the compiler would warn of)."""
    if cflags is None:
        cflags = shlex.split(os.environ.get("CFLAGS", ""))
    given = defined_macros(cflags)
    ours = [*FLAGS, *(OPENMP if openmp else []), *tuning_flags()]
    return [*(f for f in ours if not defined_macros([f]) & given), *cflags]


def defined_macros(flags: Sequence[str]) -> set[str]:
    """The names of the macros flags define (-DNAME, -DNAME=VALUE, -D NAME=VALUE)."""
    names = set()
    for i, flag in enumerate(flags):
        if flag == "-D" and i + 1 < len(flags):
            names.add(flags[i + 1].split("=", 1)[0])
        elif flag.startswith("-D") and len(flag) > 2:
            names.add(flag[2:].split("=", 1)[0])
    return names


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(lib: Path) -> bool:
    """Whether lib is complete: its bytes hash to its sidecar's content."""
    sidecar = lib.with_name(lib.name + ".sha256")
    try:
        return sidecar.read_text().strip() == _sha256(lib)
    except OSError:
        return False


def _compile(command: list[str], flags: list[str], lib: Path, source: Path = SOURCE) -> None:
    """Compile source with command + flags and publish it (and its sidecar) as lib."""
    with tempfile.TemporaryDirectory(prefix="torch_mhc_build_") as tmp:
        out = Path(tmp) / lib.name
        proc = subprocess.run([*command, *flags, str(source), "-o", str(out)],
                              capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} failed: {proc.stderr.strip()[-1500:]}")
        data = out.read_bytes()
    atomic_write(lib, data)  # temporary file, fsync, rename
    atomic_write(lib.with_name(lib.name + ".sha256"), hashlib.sha256(data).hexdigest().encode())
    fsync_dir(lib.parent)


def _library_path(command: list[str], flags: list[str], source: Path = SOURCE,
                  name: str = "torch_mhc_cpu", suffix: str = ".so", *more_key: str) -> Path:
    text = source.read_text()
    key = hashlib.sha256(
        "\n".join([text, shlex.join(command), " ".join(flags), _cpu_signature(), *more_key])
        .encode()
    ).hexdigest()[:16]
    return cache_dir() / f"{name}_{key}{suffix}"


def build_library(rebuild: bool = False) -> Path | None:
    """The path of a complete library for this machine (built now unless a verified one is
    cached; rebuild=True builds anyway), or None after warning once."""
    if sys.platform == "win32":
        warn_fallback("not built on Windows")
        return None
    command = _compiler()
    if command is None:
        warn_fallback("no C compiler: none of $CC, cc, gcc, clang found")
        return None
    errors = []
    for flags in (library_flags(), library_flags(openmp=False)):
        lib = _library_path(command, flags)
        if not rebuild and lib.exists() and _verified(lib):
            return lib
        try:
            lib.parent.mkdir(parents=True, exist_ok=True)
            _compile(command, flags, lib)
            return lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            errors.append(str(err))
    warn_fallback("; ".join(dict.fromkeys(errors)))
    return None


def build_decode_calls(rebuild: bool = False) -> Path | None:
    """The path of the decoding calls' Python extension (decode_calls.c) for this Python,
    built now unless a verified one is cached (rebuild=True builds anyway); None where it
    cannot be built (no compiler, no Python.h, a failed build, the source missing): the
    decoding calls then go through ctypes, a few microseconds slower a call, with the same
    results, so there is nothing to warn about."""
    command = _compiler()
    include = sysconfig.get_paths().get("include")
    if (sys.platform == "win32" or command is None or not include
            or not (Path(include) / "Python.h").is_file()):
        return None
    try:
        flags = ["-O2", "-std=gnu11", "-shared", "-fPIC", f"-I{include}",
                 # on macOS the Python symbols resolve when the interpreter loads the module
                 *(["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else []),
                 *shlex.split(os.environ.get("CFLAGS", ""))]
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        lib = _library_path(command, flags, DECODE_CALLS_SOURCE, "torch_mhc_decode_calls",
                            suffix, sys.version)
        if not rebuild and lib.exists() and _verified(lib):
            return lib
        lib.parent.mkdir(parents=True, exist_ok=True)
        _compile(command, flags, lib, DECODE_CALLS_SOURCE)
    except (OSError, ValueError, RuntimeError, subprocess.SubprocessError):
        return None
    return lib
