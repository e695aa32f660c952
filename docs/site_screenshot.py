"""`make docs-screenshots`: the built docs site's first page and a generated reference page, as headless Chromium
shows them in a 1400 x 1000 window (what a reader sees first) -> docs/images/*.png.

    python docs/site_screenshot.py --site site --out docs/images
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from PIL import Image
from report_screenshot import chromium, save_png  # the same Chromium settings as the report's picture

HEIGHT = 1000  # the window: what a reader sees first, at report_screenshot.WIDTH
PAGES = {"site-home.png": "index.html", "site-reference-parameters.png": "reference/parameters/index.html"}


def capture(page: Path, png: Path) -> None:
    if not page.is_file():
        sys.exit(f"{page} does not exist: build the site first (make docs)")
    with tempfile.TemporaryDirectory(prefix="evoesap-docs-shot-") as tmp:
        raw = Path(tmp) / "raw.png"
        chromium(page, tmp, f"--screenshot={raw}", height=HEIGHT)
        image = Image.open(raw).convert("RGB")
    save_png(image, png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=Path("site"))
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    args = parser.parse_args()
    for name, page in PAGES.items():
        capture(args.site / page, args.out / name)
        print(args.out / name)


if __name__ == "__main__":
    main()
