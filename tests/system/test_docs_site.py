"""The docs site as a reader sees it: formulas rendered at build time, concept pages with their figures, and the
screenshot script's check that refuses a page with anything clipped at 1280 px."""

import re
import shutil
from pathlib import Path

import pytest
from scripts import REPO, load_script

CONCEPTS = sorted((REPO / "docs" / "concepts").glob("*.md"))


@pytest.fixture(scope="module")
def mathml():
    return load_script("docs/hooks/mathml.py", "docs_mathml_hook")


class Page:  # what the hook reads of MkDocs' page
    class file:
        src_uri = "concepts/esap.md"


def test_formulas_become_mathml_inline_and_displayed(mathml):
    content = (
        '<p>with <span class="arithmatex">\\(a_i &lt; b\\)</span></p>\n'
        '<div class="arithmatex">\\[\n\\sum_{v} \\min\\bigl(p(v), q(v)\\bigr) = 1 - \\mathrm{TV}(p, q)\n\\]</div>'
    )
    out = mathml.on_page_content(content, Page)
    assert "arithmatex" not in out and "\\(" not in out and "\\[" not in out
    assert (
        '<math xmlns="http://www.w3.org/1998/Math/MathML" display="inline"><mrow><msub><mi>a</mi><mi>i</mi></msub><mo>&#x0003C;'
        in out
    )
    assert re.search(r'<div class="math-block"><math [^>]*display="block">.*&#x02211;.*</math></div>', out)


@pytest.mark.parametrize(
    ("tex", "why"),
    [
        ("\\arg\\max_x f(x)", "does not know \\\\arg"),  # shown as the text "\arg" otherwise
        ("\\begin{aligned} a &= b \\\\ c &= d \\end{aligned}", "use align\\*"),  # a raw & and an ignored line break
    ],
)
def test_a_formula_the_converter_would_garble_fails_the_build_naming_page_and_formula(mathml, tex, why):
    from mkdocs.exceptions import PluginError

    content = f'<div class="arithmatex">\\[{tex}\\]</div>'
    with pytest.raises(PluginError, match=rf"concepts/esap.md: formula .* does not convert to MathML: .*{why}"):
        mathml.on_page_content(content, Page)


@pytest.mark.parametrize("page", CONCEPTS, ids=lambda p: p.stem)
def test_each_concept_page_has_sections_formulas_and_its_figure(page):
    text = page.read_text(encoding="utf-8")
    assert len(re.findall(r"^## ", text, re.M)) >= 3, "headed sections"
    assert re.search(r"^\$\$\n", text, re.M) and re.search(r"(?<!\$)\$[^$\n]+\$(?!\$)", text), "displayed and inline formulas"
    figures = re.findall(r"!\[[^\]]+\]\(\.\./images/concepts/([\w-]+\.svg)\)", text)
    assert figures == [f"{page.stem}.svg"]
    assert (REPO / "docs" / "images" / "concepts" / figures[0]).is_file()


def test_concept_figures_are_the_ones_the_script_draws(tmp_path):
    figures = load_script("docs/concept_figures.py", "docs_concept_figures")
    for figure in figures.FIGURES:
        figure(tmp_path)
    drawn = {p.name: p.read_bytes() for p in tmp_path.glob("*.svg")}
    committed = {p.name: p.read_bytes() for p in (REPO / "docs" / "images" / "concepts").glob("*.svg")}
    assert drawn.keys() == committed.keys() == {f"{p.stem}.svg" for p in CONCEPTS}
    stale = [name for name in drawn if drawn[name] != committed[name]]
    assert not stale, f"stale figures {stale}: run python docs/concept_figures.py"


# --------------------------------------------------------------- the clipping check (needs Chromium)


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.skip("chromium is not installed (apt-get install -y chromium; make docs-screenshots does it)")
    import sys

    sys.path.insert(0, str(REPO / "docs"))  # site_screenshot imports report_screenshot beside it
    try:
        return load_script("docs/site_screenshot.py", "docs_site_screenshot")
    finally:
        sys.path.remove(str(REPO / "docs"))


def page(tmp_path: Path, body: str) -> Path:
    """A page shaped like the site's: a 600 px content column at the left of the window."""
    path = tmp_path / "index.html"
    path.write_text(
        "<!doctype html><html><head><style>body{margin:0;font:16px sans-serif}"
        ".md-content{width:600px;margin-left:40px}</style></head>"
        f'<body><div class="md-content"><article>{body}</article></div></body></html>'
    )
    return path


def table(columns: int) -> str:
    head = "".join(f"<th>column {i}</th>" for i in range(columns))
    return f'<div class="scrollwrap" style="overflow-x:auto"><table style="white-space:nowrap"><tr>{head}</tr></table></div>'


def test_a_table_that_fits_its_column_passes(shots, tmp_path):
    assert shots.clipped(page(tmp_path, table(4)), width=1280) == []


def test_a_table_scrolling_part_of_its_columns_out_of_view_is_refused(shots, tmp_path):
    (found,) = shots.clipped(page(tmp_path, table(12)), width=1280)
    assert re.fullmatch(r'div\.scrollwrap "column 0column 1.*" shows 600 x \d+ px of its \d{3,4} x \d+ px content', found)


def test_a_block_spilling_over_the_column_and_a_page_wider_than_the_window_are_refused(shots, tmp_path):
    wide = '<pre style="margin:0">' + "x" * 300 + "</pre>"  # overflow visible: it runs over whatever is beside
    found = shots.clipped(page(tmp_path, wide), width=1280)
    assert any(re.match(r"the page is \d+ px wide, wider than the 1280 px window", line) for line in found)
    assert any(re.match(r'pre "x+" spans 40-\d+ px, outside the content column \(40-640 px\)', line) for line in found)
