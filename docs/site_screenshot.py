"""`make docs-screenshots`: the built docs site's first page and a generated reference page, as headless Chromium
shows them in a 1400 x 1000 window (what a reader sees first) -> docs/images/*.png.

    python docs/site_screenshot.py --site site --out docs/images
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

WIDTH, HEIGHT = 1400, 1000
PAGES = {"site-home.png": "index.html", "site-reference-parameters.png": "reference/parameters/index.html"}


def capture(page: Path, png: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("chromium is not installed: apt-get install -y chromium (make docs-screenshots does it)")
    if not page.is_file():
        sys.exit(f"{page} does not exist: build the site first (make docs)")
    with tempfile.TemporaryDirectory(prefix="evoesap-docs-shot-") as tmp:
        raw = Path(tmp) / "raw.png"
        subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--hide-scrollbars",
                "--force-device-scale-factor=1",
                f"--user-data-dir={tmp}/profile",
                f"--window-size={WIDTH},{HEIGHT}",
                f"--screenshot={raw}",
                page.resolve().as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
        image = Image.open(raw).convert("RGB")
    png.parent.mkdir(parents=True, exist_ok=True)
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(png, optimize=True)


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
