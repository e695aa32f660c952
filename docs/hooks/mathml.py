"""MkDocs hook: the pages' formulas as MathML, rendered at build time, so the site loads no script or font for them.

`pymdownx.arithmatex` (generic mode) keeps each `$...$` and `$$...$$` out of Markdown's hands and leaves it as
`<span class="arithmatex">\\(...\\)</span>` or `<div class="arithmatex">\\[...\\]</div>`; this hook converts the LaTeX
inside to MathML with latex2mathml, which browsers draw natively. A formula it cannot convert fails the build,
naming the page and the formula.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert
from mkdocs.exceptions import PluginError

FORMULA = re.compile(
    r'<(?P<tag>span|div) class="arithmatex">\s*(?:\\\((?P<inline>.*?)\\\)|\\\[(?P<block>.*?)\\\])\s*</(?P=tag)>', re.S
)


def to_mathml(tex: str, *, block: bool) -> str:
    """One formula (LaTeX) as a MathML element; block formulas are displayed on their own line. A command the
    converter does not know comes out as its own text (`\\arg`), which is refused rather than shown."""
    mathml = convert(tex.strip(), display="block" if block else "inline")
    unknown = re.findall(r"\\[A-Za-z]+", mathml)
    if unknown:
        raise ValueError(f"latex2mathml does not know {', '.join(sorted(set(unknown)))}: write it another way")
    if re.search(r"&(?!#?\w+;)", mathml) or 'linebreak="newline"' in mathml:  # what it makes of `aligned`
        raise ValueError("an & or \\\\ that is not in an align*, array or cases environment: use align* for aligned lines")
    return mathml


def on_page_content(content: str, page, **_) -> str:
    def render(match: re.Match[str]) -> str:
        block = match.group("block") is not None
        tex = html.unescape(match.group("block") if block else match.group("inline"))
        try:
            mathml = to_mathml(tex, block=block)
        except Exception as error:  # latex2mathml raises several kinds; any of them is a broken formula
            raise PluginError(f"{page.file.src_uri}: formula {tex.strip()!r} does not convert to MathML: {error}") from error
        return f'<div class="math-block">{mathml}</div>' if block else mathml

    return FORMULA.sub(render, content)
