"""The `gcbench` command's entry point (the console script, and `python -m gcbench` for checkouts that are not
pip-installed, as benchmarks/gpu/validate.sh uses).

SIGTERM takes Ctrl-C's path from the first moment, before the CLI and its libraries are imported, so that a sweep
stopped by a scheduler while still starting up ends with its message and exit code 130, not a bare 143.

Output to a terminal, pipe or file whose encoding is not UTF-8 (LANG=C, PYTHONIOENCODING=ascii) degrades instead
of failing: a character it cannot take is written as its ASCII stand-in ("·" -> "-", "≤" -> "<="), or "?"."""

import codecs
import gc
import signal
import sys

from gcbench.errors import raise_interrupt

# What the tables and messages use beyond ASCII (rich draws its boxes in ASCII on such a stream by itself).
ASCII_STAND_INS = {"·": "-", "×": "x", "≤": "<=", "≥": ">=", "…": "...", "—": "-", "–": "-", "†": "+", "±": "+-",
                   "→": "->", "←": "<-", "−": "-", "µ": "u", "≈": "~", "√": "sqrt", "°": " deg", "²": "^2",
                   "‘": "'", "’": "'", "“": '"', "”": '"', "•": "*", "─": "-", "│": "|", "━": "-", "█": "#"}
ERRORS = "gcbench-stand-in"


def _stand_in(error: UnicodeError) -> tuple[str, int]:
    if not isinstance(error, UnicodeEncodeError):
        raise error
    # A lone surrogate is a byte of a file name that was not UTF-8 (surrogateescape): shown as plain() shows bytes.
    text = "".join(ASCII_STAND_INS.get(c, f"\\x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else "?")
                   for c in error.object[error.start:error.end])
    return text, error.end


def _degrade_output() -> None:
    """stdout and stderr, where their encoding is not UTF-8: characters it lacks become stand-ins, not an error."""
    codecs.register_error(ERRORS, _stand_in)
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        if encoding not in ("utf8", "utf8sig") and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors=ERRORS)


def main() -> None:
    signal.signal(signal.SIGTERM, raise_interrupt)
    _degrade_output()
    try:
        from gcbench.cli import main as cli_main
    except KeyboardInterrupt:
        print("gcbench: interrupted while starting; nothing was run or written: run the same command again",
              file=sys.stderr)
        sys.exit(130)
    from gcbench.heap import made_nothing_yet

    made_nothing_yet()
    try:
        cli_main()
    finally:
        # Nothing the command made is garbage-collected again at exit: the interpreter's last collection walks the
        # whole heap (torch, transformers, a simulation's fakes), ~1 s on 2 cores, after every record is written.
        gc.freeze()


if __name__ == "__main__":
    main()
