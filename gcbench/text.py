"""Text that came from a file, a config or a user, made safe to show: no terminal control sequences, and (for rich)
no markup, and (for Markdown) no syntax. Every string read from a results file, a TOML file, a model config or a path
goes through here before it reaches a terminal or a Markdown file; HTML and SVG escape on their own."""

import re

# ANSI escape sequences (CSI "ESC [ ... final", OSC "ESC ] ... BEL|ST", and two-byte "ESC x"), whole: shown as
# text they would still move the cursor, recolour or retitle the terminal.
_SEQUENCE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]?")
# Every other C0/C1 control character (NUL, BEL, backspace, carriage return, DEL, 0x80-0x9f), tab and newline too
# where the text is one line.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_KEEP_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SURROGATE = re.compile("[\udc80-\udcff]")


def plain(text: object, *, lines: bool = False) -> str:
    """`text` as a str a terminal shows literally: escape sequences dropped, other control characters written as
    `\\xNN` (so that a name differing only by one still reads differently). `lines`: keep newlines and tabs."""
    text = _SEQUENCE.sub("", str(text))
    text = (_CONTROL_KEEP_LINES if lines else _CONTROL).sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    # A byte of a file name that was not UTF-8 (Python keeps it as a lone surrogate, which no encoder writes).
    return _SURROGATE.sub(lambda m: f"\\x{ord(m.group()) - 0xDC00:02x}", text)


def markup(text: object, *, lines: bool = False) -> str:
    """`plain(text)` escaped for rich markup: a path like `m[1][/1]` prints as itself instead of failing as a tag."""
    from rich.markup import escape

    return escape(plain(text, lines=lines))


# What Markdown (and the HTML it lets through) would read as syntax inside a line: emphasis, code, links and images,
# raw HTML tags, table cells, strikethrough (a single ~ in GitHub's Markdown: "~56.7 ... ~1.30x" would strike
# everything between), and the backslash itself.
_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|~])")


def md_text(text: object) -> str:
    """`plain(text)` as literal Markdown text on one line: each character Markdown reads as syntax escaped, so that
    a model name, a CPU's name or a path reads as itself, never as a tag, a link or a new table cell."""
    return _MD_SPECIAL.sub(r"\\\1", plain(text))


def fits(renderable: object, width: int | None) -> bool:
    """Whether a rich table (or any renderable) fits `width` columns unwrapped (None: any width fits). Measured on an
    unbounded console: a bounded one clamps what it measures to its own width."""
    from rich.console import Console

    return width is None or Console(width=100_000).measure(renderable).maximum <= width


def option_lines(label: str, longer_than: int, at: str = ",") -> str:
    """Each word of `label` longer than `longer_than` characters broken into lines after each of `at`'s characters
    (plan:memory=12MiB,allow_offload=false: a line per option): a table's narrowest column is then the longest
    part, not the whole word, which at 80 columns split tables or cropped their numbers."""
    return " ".join(re.sub(f"([{re.escape(at)}])", "\\1\n", word) if len(word) > longer_than else word
                    for word in label.split(" "))
