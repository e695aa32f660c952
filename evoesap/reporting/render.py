"""Pages from templates: the report (report.md for terminals and the README, a self-contained report.html) and
the model card of a published checkpoint.

The Markdown template is the one source of the content. The HTML page is that Markdown rendered by a
CommonMark renderer (tables on, raw HTML off, so text from artifacts cannot inject markup) inside a
styled page template, with every plot embedded as a data URI: KFP's UI shows an HTML artifact as a
single file, so the page must not link anything beside it.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping
from typing import Any

import jinja2
import markupsafe
from markdown_it import MarkdownIt

from evoesap.reporting.report import Cell

_MD_INLINE = re.compile(r"[\\`*\[\]<|&]|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")  # an intraword _ is never emphasis
_MD_BLOCK = re.compile(r"^(?:[#>+=-]|\d+(?=[.)]))")  # what would open a heading, quote, list or rule at a line start
_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("evoesap.reporting", "templates"),
    autoescape=jinja2.select_autoescape(["html.j2"]),
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    undefined=jinja2.StrictUndefined,
)


def inline(text: Any) -> str:
    """`text` as literal Markdown inline text on one line (a table cell, a heading): special characters escaped."""
    return _MD_INLINE.sub(lambda m: "\\" + m.group(0), " ".join(str(text).split()))


def md(text: Any) -> str:
    """`text` as a literal Markdown paragraph: inline escapes, and no heading, quote or list at its start."""
    return _MD_BLOCK.sub(lambda m: m.group(0) + "\\" if m.group(0)[0].isdigit() else "\\" + m.group(0), inline(text))


def cell(value: Cell) -> str:
    """A table cell in Markdown; code spans keep their text verbatim except the pipe, which GFM tables need escaped."""
    if value.style == "code":
        text = " ".join(value.text.split()).replace("|", "\\|")
        fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
        return f"{fence}{text}{fence}" if fence == "`" else f"{fence} {text} {fence}"
    return f"**{inline(value.text)}**" if value.style == "bold" and value.text else inline(value.text)


_ENV.filters.update(md=md, inline=inline, cell=cell)


def markdown(context: Mapping[str, Any], image_src: Callable[[str], str]) -> str:
    """report.md from `context` (see the template); `image_src` maps a plot's file name to the link written."""
    return _ENV.get_template("report.md.j2").render(**context, image_src=image_src)


def html_page(markdown_text: str, title: str) -> str:
    """The Markdown rendered to HTML inside the styled, self-contained page."""
    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown_text)
    return _ENV.get_template("report.html.j2").render(title=title, body=markupsafe.Markup(body))


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def model_card(context: Mapping[str, Any]) -> str:
    """The Markdown of a model card from `context` (see the template and `evoesap.reporting.card`)."""
    return _ENV.get_template("model_card.md.j2").render(**context)
