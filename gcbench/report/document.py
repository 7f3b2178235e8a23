"""The shareable report (`gcbench report --out DIR`): its content as a list of blocks (headings, paragraphs, grids,
figures), rendered to report.md and to a self-contained report.html, put beside figures/ by publish.py."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

import pandas as pd

from gcbench.report.cells import (LARGEST_TITLE, Grid, environment_grid, fit_grids, grid_grid, largest_fit_grid,
                                  prediction_grid, results_grid)
from gcbench.report.publish import publish
from gcbench.results.frame import FAILED
from gcbench.text import md_text, plain
from gcbench.units import plural


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Para:
    text: str  # may use `code` and **bold**


@dataclass
class Image:
    png: str | None  # relative to the report directory; None: not drawn (the caption says why)
    svg: str
    title: str
    caption: str


Block = Heading | Para | Grid | Image


def report_blocks(frame: pd.DataFrame, figures: dict[str, list], sources: list[str]) -> list[Block]:
    """The report's content: what was run where, the tables, the figures, the largest config that fit."""
    from gcbench import __version__

    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cpu_only = (frame["device_kind"] == "cpu").all()
    blocks: list[Block] = [
        Heading("gcbench report" + (" — CPU measurements" if cpu_only else ""), 1),
        Para(f"{plural(len(frame), 'config')} from {', '.join(_code(s) for s in sources)}; written {now} by gcbench "
             f"{__version__}. Each device has its own section: numbers from different devices are never compared "
             "or averaged, and `x none` ratios compare a policy with the `none` policy at the same device, model "
             "setup, sequence length and batch size. Memory in binary units (GiB = 2^30 bytes); step time is the "
             "median of the measured steps."),
    ]
    if frame.attrs.get("superseded"):
        blocks.append(Para(f"{frame.attrs['superseded']} repeated record(s) of the same config were superseded "
                           "by a later record (the latest is kept; records are never averaged)."))
    for dev_label, dev in frame.groupby("device_label", sort=False):
        cpu = dev["device_kind"].iloc[0] == "cpu"
        blocks.append(Heading(f"{dev_label}" + (" — CPU measurements" if cpu else "")))
        if cpu:
            blocks.append(Para("**CPU run.** Step times are CPU times, not GPU times. Peak memory is the "
                               "*tracked live-tensor peak (CPU)*: the most bytes of tensors alive at once, "
                               "counted by gcbench; CPU has no allocator peak like CUDA's `max_memory_allocated`."))
        else:
            blocks.append(Para("Peak memory is `torch.cuda.max_memory_allocated` over the whole training step."))
        blocks += [Heading("Environment", 3), environment_grid(dev), Heading("Grid", 3), grid_grid(dev),
                   Heading("Results", 3)]
        for _, part in dev.groupby("setup", sort=False):
            blocks.append(results_grid(part))
        if (largest := largest_fit_grid(dev)) is not None:  # the heading says what it is; the title, its setup
            largest.title = largest.title.removeprefix(LARGEST_TITLE).removeprefix(" · ")
            blocks += [Heading("Largest config that fit, per policy", 3), largest]
        if fits := fit_grids(dev):
            blocks += [Heading("Largest size that fits a memory budget, per policy (gcbench fit)", 3), *fits]
        predictions = [g for _, part in dev.groupby("setup", sort=False) if (g := prediction_grid(part))]
        if predictions:
            blocks += [Heading("Prediction error per method", 3), *predictions]
        blocks.append(Heading("Figures", 3))
        for fig in figures.get(dev_label, []):
            blocks.append(Image(fig.png, fig.svg, fig.title, fig.caption))
    return blocks


def _md_caption(text: str) -> str:
    """A caption as Markdown: its `code` spans kept (as report.html shows them), the rest literal text (md_text)."""
    return "".join(part if len(part) > 1 and part[0] == part[-1] == "`" else md_text(part)
                   for part in re.split(r"(`[^`]+`)", plain(text)))


def _code(text: str) -> str:
    """A file name as inline code in a paragraph: a backtick in it would end the code span early."""
    return "`" + plain(text).replace("`", "'") + "`"


def render_markdown(blocks: list[Block]) -> str:
    out = []
    for b in blocks:
        match b:
            case Heading():
                out.append("#" * b.level + " " + md_text(b.text))
            case Para():
                out.append(b.text)
            case Grid():
                lines = [f"**{md_text(b.title)}**\n"] if b.title else []
                lines.append("| " + " | ".join(map(md_text, b.headers)) + " |")
                lines.append("|" + "|".join("---:" if i in b.numeric else "---" for i in range(len(b.headers))) + "|")
                lines += ["| " + " | ".join(md_text(c) for c in row) + " |" for row in b.rows]
                if b.caption:
                    lines.append(f"\n*{_md_caption(b.caption)}*")
                out.append("\n".join(lines))
            case Image() if b.png is None:
                out.append(f"*{md_text(b.title)}*: not drawn — {_md_caption(b.caption)}")
            case Image():
                out.append(f"![{md_text(b.title)}]({quote(b.png)})\n\n*{_md_caption(b.caption)}* "
                           f"([SVG]({quote(b.svg)}))")
    return "\n\n".join(out) + "\n"


def _inline_html(text: str) -> str:
    text = html.escape(text, quote=False)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    text = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", text)
    return re.sub(r"\*([^*]+)\*", r"<i>\1</i>", text)


HTML_STYLE = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1280px; margin: 2em auto;
       padding: 0 1.5em; color: #1d1d1f; }
h1 { border-bottom: 2px solid #333; padding-bottom: .2em; }
h2 { margin-top: 2.2em; border-bottom: 1px solid #ccc; padding-bottom: .15em; }
h3 { margin-top: 1.6em; }
code { background: #f2f2f2; padding: 0 .25em; border-radius: 3px; }
table { border-collapse: collapse; margin: .6em 0 .3em; font-size: 13px; }
th, td { padding: .25em .7em; border-bottom: 1px solid #e2e2e2; }
td { white-space: nowrap; }
div.wide { overflow-x: auto; }
th { background: #f6f6f6; text-align: left; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.end td { border-bottom: 2px solid #aaa; }
td.bad { color: #b00020; font-weight: 600; }
caption { caption-side: top; text-align: left; font-weight: 600; padding: .3em 0; }
p.caption { font-size: 13px; color: #555; margin-top: .2em; }
figure { margin: 1.4em 0; }
figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 13px; color: #444; }
"""


def render_html(blocks: list[Block], root: Path) -> str:
    """One self-contained HTML file: the PNG figures are embedded (base64), the SVGs stay beside it."""
    title = next((b.text for b in blocks if isinstance(b, Heading)), "gcbench report")
    out = [f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
           f"<style>{HTML_STYLE}</style></head><body>"]
    for b in blocks:
        match b:
            case Heading():
                out.append(f"<h{b.level}>{html.escape(b.text)}</h{b.level}>")
            case Para():
                out.append(f"<p>{_inline_html(b.text)}</p>")
            case Grid():
                bad, end = ' class="bad"', ' class="end"'
                cls = lambda i: ' class="num"' if i in b.numeric else ""  # noqa: E731
                rows = []
                for r, row in enumerate(b.rows):
                    cells = "".join(f"<td{bad if c.rstrip('*') in FAILED.values() else cls(i)}>{html.escape(c)}</td>"
                                    for i, c in enumerate(row))
                    rows.append(f"<tr{end if r in b.section_ends else ''}>{cells}</tr>")
                caption = f"<caption>{html.escape(b.title)}</caption>" if b.title else ""
                head = "".join(f"<th{cls(i)}>{html.escape(h)}</th>" for i, h in enumerate(b.headers))
                out.append(f"<div class=\"wide\"><table>{caption}<thead><tr>{head}</tr></thead>"
                           f"<tbody>{''.join(rows)}</tbody></table></div>")
                if b.caption:
                    out.append(f"<p class=\"caption\">{_inline_html(b.caption)}</p>")
            case Image() if b.png is None:
                out.append(f"<p><i>{html.escape(b.title)}</i>: not drawn — {_inline_html(b.caption)}</p>")
            case Image():
                data = base64.b64encode((root / b.png).read_bytes()).decode()
                out.append(f"<figure><img src=\"data:image/png;base64,{data}\" alt=\"{html.escape(b.title)}\">"
                           f"<figcaption><b>{html.escape(b.title)}.</b> {_inline_html(b.caption)}</figcaption>"
                           "</figure>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def shown_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with every string in it through text.plain: no escape sequence from a results file reaches
    report.md, which its readers `cat`, nor an SVG, where a control character is not even XML."""
    def each(value: object) -> object:
        if isinstance(value, str):
            return plain(value)
        return [each(v) for v in value] if isinstance(value, list) else value

    strings = [c for c in frame.columns if frame[c].dtype == object or pd.api.types.is_string_dtype(frame[c])]
    out = frame.assign(**{c: frame[c].map(each) for c in strings})
    out.attrs = dict(frame.attrs)
    return out


def write_report(frame: pd.DataFrame, out: Path) -> list[Path]:
    """Write report.md, report.html and figures/ into `out` (publish.py: only gcbench's own files are replaced, a
    failure or a kill leaves the previous report); the report's files, pages first."""
    from gcbench.report.figures import write_figures  # here: matplotlib only when a report is written

    shown = shown_frame(frame)

    def make(root: Path) -> None:
        figures = write_figures(shown, root, "figures")
        blocks = report_blocks(shown, figures, sorted(set(shown["source"])))
        (root / "report.md").write_text(render_markdown(blocks))
        (root / "report.html").write_text(render_html(blocks, root))

    return publish(out, make)
