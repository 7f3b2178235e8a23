"""The `gcbench` command's entry point (the console script, and `python -m gcbench` for checkouts that are not
pip-installed, as benchmarks/gpu/validate.sh uses).

SIGTERM takes Ctrl-C's path from the first moment, before the CLI and its libraries are imported, so that a sweep
stopped by a scheduler while still starting up ends with its message and exit code 130, not a bare 143.

Output to a terminal, pipe or file whose encoding is not UTF-8 (LANG=C, PYTHONIOENCODING=ascii) degrades instead
of failing: a character it cannot take is written as its ASCII stand-in ("·" -> "-", "≤" -> "<="), or "?".

A command that has ended (its output written, its exit code chosen) ends the process at once: the interpreter's
finalization would then tear down every module and object torch and transformers made, one by one (0.1-0.2 s on
2 cores, after everything is written), and nothing gcbench writes waits for it (its files are closed as they are
written). Not where something may still want that end: a profiler or tracer watching the process (cProfile,
coverage, a debugger), or CUDA in use (a CUDA profiler such as Nsight Systems flushes at the C library's exit,
which os._exit skips)."""

import atexit
import codecs
import errno
import gc
import os
import signal
import sys
import threading

from gcbench.errors import raise_interrupt

# What the tables and messages use beyond ASCII (rich draws its boxes in ASCII on such a stream by itself).
ASCII_STAND_INS = {"·": "-", "×": "x", "≤": "<=", "≥": ">=", "…": "...", "—": "-", "–": "-", "†": "+", "±": "+-",
                   "→": "->", "←": "<-", "−": "-", "µ": "u", "≈": "~", "√": "sqrt", "°": " deg", "²": "^2",
                   "‘": "'", "’": "'", "“": '"', "”": '"', "•": "*", "─": "-", "│": "|", "━": "-", "█": "#"}
ERRORS = "gcbench-stand-in"
# A write to stdout or stderr the machine refused (> /dev/full, a full disk, | head): one line and exit 1, not a
# traceback. gcbench's own files turn their write errors into messages where they are written.
WRITE_FAILED = {errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}


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
    except SystemExit as done:
        gc.freeze()
        _end_now(done.code)
        raise
    except OSError as e:
        if e.errno not in WRITE_FAILED or not _writing_output(e):
            raise
        _drop_output()
        if e.errno != errno.EPIPE:  # a reader that stopped reading (| head) needs no word
            _say(f"gcbench: error: cannot write the output: {e.strerror}")
        sys.exit(1)
    finally:
        # Nothing the command made is garbage-collected again at exit: the interpreter's last collection walks the
        # whole heap (torch, transformers, a simulation's fakes), ~1 s on 2 cores, after every record is written.
        gc.freeze()


def _writing_output(error: OSError) -> bool:
    """Whether `error` was raised writing stdout or stderr: a frame on its way holds one of them (click's echo its
    `file`, rich's Console its `.file`), not a read or another file's write that no handler caught."""
    streams = [s for s in (sys.stdout, sys.stderr) if s is not None]
    streams += [s.buffer for s in streams if hasattr(s, "buffer")]
    tb = error.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            try:
                if any(value is s or getattr(value, "file", None) is s for s in streams):
                    return True
            except Exception:  # noqa: BLE001 - an object whose attribute lookup fails holds no stream
                continue
        tb = tb.tb_next
    return False


def _drop_output() -> None:
    """stdout pointed at /dev/null, so that the exit's own flush of what is still buffered for a full disk or a
    closed pipe does not fail again, with a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no stdout to point anywhere
        pass


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr)
    except (OSError, ValueError):  # stderr lost too: the exit code says it
        pass


def _end_now(code: object) -> None:
    """End the process with `code` without the interpreter's finalization (module docstring), once what it would
    still do that matters is done: the atexit handlers run (multiprocessing's, tempfile's, logging's), and stdout,
    stderr and the C library's streams (what an extension printed) are flushed. Returns, leaving the ordinary exit
    to Python, where that is not all: a thread Python would wait for still runs, the code is a message to print, a
    profiler, tracer or CUDA may want the end (module docstring), or a stream cannot be flushed (a closed pipe:
    Python reports it as it always did)."""
    if not (code is None or isinstance(code, int)) or sys.getprofile() is not None or sys.gettrace() is not None:
        return
    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return
    atexit._run_exitfuncs()  # each handler once: CPython clears them after running them
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None and not stream.closed:  # None: closed when Python started (`>&-`)
                stream.flush()
        import ctypes

        ctypes.CDLL(None).fflush(None)  # every C stdio stream (None: all of them)
    except (OSError, ValueError, AttributeError, TypeError):
        return
    os._exit(code or 0)


if __name__ == "__main__":
    main()
