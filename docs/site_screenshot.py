"""`make docs-screenshots`: pages of the built docs site as headless Chromium shows them in a 1280 x 1000 window (what
a reader on a laptop sees first) -> docs/images/site-*.png, refused when anything on a page is clipped.

    python docs/site_screenshot.py --site site --out docs/images

Before each capture a script run in a copy of the page (read back with --dump-dom) looks for what the picture would
cut off: a page wider than the window (the reader would have to scroll sideways), a box that hides or scrolls part
of its content (a table column, a code line, a formula past its container's edge), and a block that spills out of
the content column over the table of contents. Any of them fails the run, naming the element and the widths.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
import tempfile
from pathlib import Path

from PIL import Image
from report_screenshot import chromium, save_png  # the same Chromium settings as the report's picture

WIDTH, HEIGHT = 1280, 1000  # a laptop's window: what a reader sees first
PAGES = {
    "site-home.png": "index.html",
    "site-quick-start.png": "getting-started/quick-start/index.html",
    "site-concept-esap.png": "concepts/esap/index.html",
    "site-reference-parameters.png": "reference/parameters/index.html",
    "site-reference-pipeline-yaml.png": "reference/pipeline-yaml/index.html",
}
TALLER = {"site-home.png": 1900}  # down to the end of the headline table, the widest block of the first page
SLACK = 2  # px: sub-pixel layout rounding, never a hidden column
# Run in a copy of the page once it has loaded: every clipped thing, one line each, where --dump-dom shows it.
CLIP_SCRIPT = """<script>
window.addEventListener("load", () => {
  const slack = %d, found = [];
  const name = (e) => e.tagName.toLowerCase() + (e.id ? "#" + e.id : "") +
    (typeof e.className === "string" && e.className ? "." + e.className.trim().split(/\\s+/).join(".") : "") +
    ' "' + (e.textContent || "").trim().replace(/\\s+/g, " ").slice(0, 40) + '"';
  const page = document.documentElement.scrollWidth;
  if (page > window.innerWidth + slack) found.push(`the page is ${page} px wide, wider than the ${window.innerWidth} px window`);
  const column = document.querySelector(".md-content");
  const bounds = column ? column.getBoundingClientRect() : null;
  const hides = (e) => { const s = getComputedStyle(e); return s.overflowX !== "visible" || s.overflowY !== "visible"; };
  for (const e of column ? column.querySelectorAll("*") : []) {
    const box = e.getBoundingClientRect();
    if (!box.width || !box.height || getComputedStyle(e).visibility === "hidden") continue;
    if (hides(e) && (e.scrollWidth > e.clientWidth + slack || e.scrollHeight > e.clientHeight + slack))
      found.push(`${name(e)} shows ${e.clientWidth} x ${e.clientHeight} px of its ${e.scrollWidth} x ${e.scrollHeight} px content`);
    let inside = false;  // a box within a clipping box is judged by that box
    for (let a = e.parentElement; a && a !== column; a = a.parentElement) if (hides(a)) { inside = true; break; }
    const right = hides(e) ? box.right : Math.max(box.right, box.left + e.scrollWidth);  // text running out counts
    if (!inside && (right > bounds.right + slack || box.left < bounds.left - slack))
      found.push(`${name(e)} spans ${Math.round(box.left)}-${Math.round(right)} px, outside the content column ` +
                 `(${Math.round(bounds.left)}-${Math.round(bounds.right)} px)`);
  }
  document.body.dataset.clipped = JSON.stringify(found);
});
</script>"""


def clipped(page: Path, width: int = WIDTH) -> list[str]:
    """What Chromium, laying `page` out `width` px wide, would cut off: one line per clipped element."""
    import json

    with tempfile.TemporaryDirectory(prefix="evoesap-clip-") as tmp:
        probe = page.with_name(f".clip-probe-{page.name}")  # beside the page: its stylesheets and images resolve
        try:
            probe.write_text(page.read_text(encoding="utf-8").replace("</body>", CLIP_SCRIPT % SLACK + "</body>", 1))
            dom = chromium(probe, tmp, "--virtual-time-budget=10000", "--dump-dom", height=HEIGHT, width=width)
        finally:
            probe.unlink(missing_ok=True)
    found = re.search(r'data-clipped="([^"]*)"', dom)
    if found is None:
        sys.exit(f"the clipping check did not run on {page}: its script found no body or did not finish")
    return json.loads(html.unescape(found.group(1)))


def capture(page: Path, png: Path, height: int = HEIGHT) -> None:
    if not page.is_file():
        sys.exit(f"{page} does not exist: build the site first (make docs)")
    problems = clipped(page)
    if problems:
        sys.exit(f"{page} is clipped at {WIDTH} px:\n  " + "\n  ".join(problems))
    with tempfile.TemporaryDirectory(prefix="evoesap-docs-shot-") as tmp:
        raw = Path(tmp) / "raw.png"
        chromium(page, tmp, f"--screenshot={raw}", height=height, width=WIDTH)
        image = Image.open(raw).convert("RGB")
    save_png(image, png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=Path("site"))
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    args = parser.parse_args()
    for name, page in PAGES.items():
        capture(args.site / page, args.out / name, TALLER.get(name, HEIGHT))
        print(args.out / name)


if __name__ == "__main__":
    main()
