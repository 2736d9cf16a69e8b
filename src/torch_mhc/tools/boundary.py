"""The `mhc` command's one error boundary: every failure is one line on stderr,
`mhc <command>: error: <what was expected and what came>`, with no traceback, and its own
exit status (EXIT_STATUS); SIGINT / SIGTERM end the command with 130 / 143 however late they
come (`Signals`). `cli.main` runs every command inside it; the delegated tools (cost, bench)
parse with the helpers here, which turn argparse's exits and usage errors into statuses."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import os
import select
import signal
import sys
import threading
import warnings

from torch_mhc.tools.errors import UsageError

__all__ = ["EXIT_INTERNAL", "EXIT_STATUS", "OneLineParser", "RaisingParser", "Signals", "fail",
           "parse", "parse_error", "positive_int", "rank0", "report", "unrecognized",
           "warn_warmup", "warnings_as_lines"]

EXIT_STATUS = """exit status:
  0    the run finished
  1    stopped by the spike policy (a NaN/Inf or spiking loss); the last good checkpoint is kept
       (mhc compare: every run stopped; its report is written)
  2    bad input: configuration, data, a corrupt or foreign checkpoint, out_dir in use by
       another run, a symbolic link where the run writes, a model too large for memory, a
       permission or other file error (its errno named), a missing extra
  3    no space left on the device (or disk quota exceeded, or a file over the file-size
       limit); a checkpoint written before is left intact
  4    an internal error (a bug): one line naming it; MHC_TRACEBACK=1 shows the traceback
  130  interrupted (Ctrl-C, SIGINT) after writing a checkpoint of the last completed step
  143  terminated (SIGTERM), alike
  141  the output's reader went away (a closed pipe, `| head`): stopped without a message"""
EXIT_INTERNAL = 4


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors: `mhc train: error: ...`, exit code 2; a flag must be
    given whole (argparse's prefixes would take `mhc sweep --lr 0.1` as --lrs), and an
    unknown one gets the closest known flag of its command."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized(self, parsed, extras))
        return parsed

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def unrecognized(parser: argparse.ArgumentParser, parsed: argparse.Namespace,
                 extras: list[str]) -> str:
    """"unrecognized arguments: ..." for what parser left over, each unknown flag followed by
    the closest flag of the parser or of the subcommand parsed (`--conection: did you mean
    --connection?`)."""
    flags = [*parser._option_string_actions]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
            flags += [*chosen._option_string_actions] if chosen is not None else []
    given = [e.split("=")[0] for e in extras if e.startswith("-")]
    hints = "".join(f" ({g}: did you mean {close[0]}?)" for g in given
                    for close in [difflib.get_close_matches(g, flags, n=1, cutoff=0.75)]
                    if close)
    return f"unrecognized arguments: {' '.join(extras)}{hints}"


class RaisingParser(OneLineParser):
    """OneLineParser whose usage errors raise UsageError (the caller prints the line)."""

    def error(self, message: str):
        raise UsageError(message)


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """The parsed arguments, or the exit status of --help (0) or of a usage error argparse
    printed (2)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1, else a usage error that quotes what came."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def parse_error(parser: argparse.ArgumentParser, message: str) -> int:
    """The parser's own report of a usage error (usage line, then the message): exit status 2."""
    try:
        parser.error(message)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    return 2


class Signals:
    """SIGINT and SIGTERM for the whole command. Outside the trainer's loop (which installs
    its own handler and stops at a step boundary) the first one raises KeyboardInterrupt, so
    that SIGTERM too unwinds through every cleanup instead of killing the process; later ones,
    and every one after `mute()`, are only recorded. `first` decides the exit status."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.first: int | None = None
        self.raised = self.muted = False

    def handler(self, signum: int, frame) -> None:
        self.first = self.first or signum
        if not (self.raised or self.muted):
            self.raised = True
            raise KeyboardInterrupt(f"interrupted by {signal.Signals(signum).name}")

    def mute(self) -> None:
        self.muted = True

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # handlers can only be set from the main thread
            return
        previous = {s: signal.getsignal(s) for s in self.SIGNALS}
        for s in self.SIGNALS:
            signal.signal(s, self.handler)
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def final_status(self, prog: str, status: int) -> int:
        """A signal that came after the command's status was decided still decides it."""
        if self.first is None or status in (128 + s for s in self.SIGNALS):
            return status
        if status == 0:
            fail(prog, f"interrupted by {signal.Signals(self.first).name} after the command "
                 "finished", 0)
        return 128 + self.first


def report(prog: str, e: BaseException, first_signal: int | None) -> int:
    """One line and the exit status of any failure."""
    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if _wrapped(e, BrokenPipeError) is not None and _stdout_reader_gone():
        # the reader of the output went away (`mhc ... | head`): nothing failed that a message
        # could reach; the status a command killed by SIGPIPE gets, as Python ignores it
        _silence_stdout()
        return 128 + signal.SIGPIPE
    interrupt = _wrapped(e, KeyboardInterrupt)
    if interrupt is not None:  # RunInterrupted says what was saved and which signal it was
        signum = getattr(interrupt, "signum", None) or first_signal or signal.SIGINT
        # every rank stops alike: one says it (all at once wrote their lines into one)
        return fail(prog, _one_line(interrupt) or "interrupted", 128 + signum,
                    quiet=not rank0())
    if isinstance(e, UsageError):
        return fail(prog, f"error: {_one_line(e)}", 2)
    return _known_error(prog, e)


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (POLLERR on its write end): a
    broken pipe of anything else (a worker's, a subprocess's) is an error to report."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no file under it (a test's capture)
        return False


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what is still
    buffered for the closed pipe raises nothing more."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _wrapped(e: BaseException, kind: type) -> BaseException | None:
    """`e` or an error it wraps (a cause, a context, one of DCP's per-rank failures) that
    is a `kind`, else None."""
    seen, stack = set(), [e]
    while stack:
        x = stack.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, kind):
            return x
        failures = getattr(x, "failures", None)  # DCP's CheckpointException
        if isinstance(failures, dict):
            stack.extend(v[0] if isinstance(v, tuple) and v else v for v in failures.values())
        stack.extend([x.__cause__, x.__context__])
    return None


def _known_error(prog: str, e: BaseException) -> int:
    """One line and the exit status of an error the commands raise for the user, of the
    system (a refused write, memory, permissions) or of a bug (EXIT_INTERNAL)."""
    from torch_mhc.lm.train.errors import (
        EXIT_BAD_INPUT,
        EXIT_NO_SPACE,
        EXIT_STOPPED,
        CheckpointError,
        ConfigError,
        DiskFullError,
        TrainingDiverged,
        storage_errno,
        storage_problem,
    )
    from torch_mhc.ops.checks import ImplUnavailableError, UnknownImplError

    if isinstance(e, ConfigError):  # every rank has the same config: one rank says it
        return fail(prog, f"error: {_one_line(e)}", EXIT_BAD_INPUT, quiet=not rank0())
    # a checkpoint that cannot be read; an op implementation (TORCH_MHC_IMPL, --impl) that
    # does not exist or cannot run on the device
    if isinstance(e, CheckpointError | UnknownImplError | ImplUnavailableError):
        return fail(prog, f"error: {_one_line(e)}", EXIT_BAD_INPUT)
    if isinstance(e, TrainingDiverged):
        return fail(prog, _one_line(e), EXIT_STOPPED)
    if isinstance(e, DiskFullError):
        return fail(prog, f"error: {_one_line(e)}", EXIT_NO_SPACE)
    code = storage_errno(e)
    if code is not None:
        where = getattr(_wrapped(e, OSError), "filename", None)
        return fail(prog, f"error: {storage_problem(code)}" + (f" writing {where}" if where
                                                                 else ""), EXIT_NO_SPACE)
    if _is_out_of_memory(e):
        return fail(prog, f"error: out of memory: {_first_line(e)} (a smaller model, batch or "
                    "seq_len fits)", EXIT_BAD_INPUT)
    os_error = _wrapped(e, OSError)
    if os_error is not None:  # permissions, a vanished folder, a link refused
        name = errno.errorcode.get(os_error.errno or 0, "no errno")
        where = f": {os_error.filename}" if os_error.filename is not None else ""
        text = os_error.strerror or _first_line(os_error)
        return fail(prog, f"error: {text} ({name}){where}", EXIT_BAD_INPUT)
    if os.environ.get("MHC_TRACEBACK"):
        raise e
    return fail(prog, f"error: internal error, {type(e).__name__}: {_first_line(e)} (a bug; "
                "MHC_TRACEBACK=1 shows the traceback)", EXIT_INTERNAL)


def _is_out_of_memory(e: BaseException) -> bool:
    if _wrapped(e, MemoryError) is not None or type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e)
    return any(k in text for k in ("can't allocate memory", "out of memory",
                                   "Cannot allocate memory"))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def fail(prog: str, message: str, status: int, quiet: bool = False) -> int:
    if not quiet:
        # One write of the whole line: under torchrun every rank shares the terminal, and
        # print's two writes (text, then newline) let two ranks' lines run into one.
        sys.stderr.write(f"{prog}: {message}\n")
        sys.stderr.flush()
    return status


def rank0() -> bool:
    """False on the ranks > 0 of a torchrun launch (RANK, set before any process group)."""
    try:
        return int(os.environ.get("RANK", "0")) == 0
    except ValueError:
        return True


def warn_warmup(cfg, prog: str) -> None:
    """One warning line when the warmup of cfg (a TrainConfig) never ends: the peak lr is
    then never reached."""
    if cfg.warmup >= cfg.steps and rank0():
        print(f"{prog}: warning: warmup ({cfg.warmup}) >= steps ({cfg.steps}): the learning "
              f"rate rises for the whole run and never reaches lr {cfg.lr}", file=sys.stderr,
              flush=True)


@contextlib.contextmanager
def warnings_as_lines(prog: str):
    """While a command runs, torch_mhc's own Python warnings (their messages start with
    "torch_mhc: ": the native kernels' fallback, a checkpoint loaded from its interrupted
    save) are one line each, `prog: warning: ...`, as the command's other warnings are,
    instead of Python's file, line and source line; other warnings, torch's raised inside
    the library included, are shown as they would be without."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if not text.startswith("torch_mhc: "):
            shown(message, category, filename, lineno, file, line)
        elif rank0():
            text = " ".join(text.removeprefix("torch_mhc: ").split())
            print(f"{prog}: warning: {text}", file=sys.stderr if file is None else file,
                  flush=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
