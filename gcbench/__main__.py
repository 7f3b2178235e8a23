"""The `gcbench` command's entry point (the console script, and `python -m gcbench` for checkouts that are not
pip-installed, as benchmarks/gpu/validate.sh uses).

SIGTERM takes Ctrl-C's path from the first moment, before the CLI and its libraries are imported, so that a sweep
stopped by a scheduler while still starting up ends with its message and exit code 130, not a bare 143."""

import gc
import signal
import sys

from gcbench.errors import raise_interrupt


def main() -> None:
    signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        from gcbench.cli import main as cli_main
    except KeyboardInterrupt:
        print("gcbench: interrupted while starting; nothing was run or written: run the same command again",
              file=sys.stderr)
        sys.exit(130)
    try:
        cli_main()
    finally:
        # Nothing the command made is garbage-collected again at exit: the interpreter's last collection walks the
        # whole heap (torch, transformers, a simulation's fakes), ~1 s on 2 cores, after every record is written.
        gc.freeze()


if __name__ == "__main__":
    main()
