"""`make report-screenshot`: the demo's report rendered by this checkout, in headless Chromium at 1400 px -> a PNG.

The newest report artifact of a demo run names its evaluate runs and searches in its manifest. The report
stage renders them again into a temporary directory (the stage cache would hand back the page an older
checkout made), then headless Chromium captures report.html in a 1400 px wide window taller than the page,
and the blank space below the page is cropped off.

    python docs/report_screenshot.py --demo runs/demo --out docs/report.png
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image, ImageChops

from evoesap.stages.report import HTML_FILE, ReportParams, run_report
from evoesap.store import artifacts

WIDTH = 1400  # a laptop screen; KFP's artifact viewer is narrower, and the page scales down to it
TALL = 16000  # window height, more than any demo page; what the page leaves blank is cropped
MARGIN = 24  # blank pixels kept below the page


def newest_report(demo: Path) -> Path:
    """The report artifact the demo finished last."""
    found = [p.parent for p in (demo / "artifacts" / "report").glob("*/manifest.json")]
    if not found:
        sys.exit(f"no report artifact under {demo}/artifacts/report: run `make demo` first")
    return max(found, key=lambda p: artifacts.read_manifest(str(p)).ended)


def rerender(report: Path, out: Path) -> Path:
    """report.html for the same runs, searches and parameters as `report`, made by this checkout."""
    manifest = artifacts.read_manifest(str(report))
    ordered = sorted(manifest.inputs.items(), key=lambda kv: (kv[0].split(".")[0], int(kv[0].split(".")[1])))
    runs = [entry["uri"] for name, entry in ordered if name.startswith("runs.")]
    searches = [entry["uri"] for name, entry in ordered if name.startswith("searches.")]
    run_report(runs, ReportParams(**{**manifest.params, "html": True}), str(out), searches=searches)
    return out / HTML_FILE


def screenshot(page: Path, png: Path) -> None:
    """Chromium's capture of `page` at WIDTH px, cropped to the page's height."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("chromium is not installed: apt-get install -y chromium (make report-screenshot does it)")
    with tempfile.TemporaryDirectory(prefix="evoesap-shot-") as tmp:
        raw = Path(tmp) / "raw.png"
        subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--force-device-scale-factor=1",
                f"--user-data-dir={tmp}/profile",
                f"--window-size={WIDTH},{TALL}",
                f"--screenshot={raw}",
                page.resolve().as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
        image = Image.open(raw).convert("RGB")
    content = ImageChops.difference(image, Image.new("RGB", image.size, "white")).getbbox()
    if content is None:
        sys.exit(f"chromium rendered {page} blank")
    if content[3] >= TALL - 1:
        sys.exit(f"{page} is taller than {TALL} px: raise TALL in {__file__}")
    png.parent.mkdir(parents=True, exist_ok=True)
    page_image = image.crop((0, 0, WIDTH, min(TALL, content[3] + MARGIN)))
    page_image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(png, optimize=True)  # a third of the bytes, same look


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=Path("runs/demo"), help="the --out of `evoesap pipeline demo`")
    parser.add_argument("--out", type=Path, default=Path("docs/report.png"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="evoesap-report-") as tmp:
        page = rerender(newest_report(args.demo), Path(tmp) / "report")
        screenshot(page, args.out)
    print(args.out)


if __name__ == "__main__":
    main()
