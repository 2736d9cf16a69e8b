"""Running `mhc` in the test process and checking its one-line errors."""

from __future__ import annotations

from torch_mhc.tools.cli import main


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `mhc *argv`."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    """stderr's one line; fails on several lines or a traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def assert_one_line_error(code: int, err: str, *needles: str, status: int = 2) -> None:
    """Exit `status` (bad input unless said) and one line holding every needle."""
    assert code == status, err
    line = one_line(err)
    for needle in needles:
        assert needle in line, line
