"""`make report-screenshot`: the demo's report rendered by this checkout, in headless Chromium at 1400 px -> a PNG.

The newest report artifact of a demo run names its evaluate runs and searches in its manifest. The report
stage renders them again into a temporary directory (the stage cache would hand back the page an older
checkout made), then headless Chromium captures report.html in a 1400 px wide window taller than the page,
and the blank space below the page is cropped off. With --frontier, the quality-memory frontier figure (its heading
and image) is also cut out of that capture, at the box Chromium lays it out in (read from the page by a script
run in a copy of it).

    python docs/report_screenshot.py --demo runs/demo --out docs/report.png --frontier docs/images/report-frontier.png
"""

from __future__ import annotations

import argparse
import re
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
INPUTS = ("runs", "searches", "gates", "targets")  # what a report artifact's manifest names, as run_report takes them
FRONTIER = "Quality against memory"  # the start of the frontier image's alt text (evoesap/stages/report.py)
# Run in a copy of the page once it has loaded: the box (x, y, width, height in CSS px) around the frontier image and
# the heading just before it, written where --dump-dom shows it.
BOX_SCRIPT = """<script>
window.addEventListener("load", () => {
  const img = document.querySelector('img[alt^="%s"]');
  if (!img) return;
  const head = img.closest("p")?.previousElementSibling;
  const text = document.createRange();  // the heading's text, not its full-width block
  text.selectNodeContents(head && /^H[1-6]$/.test(head.tagName) ? head : img);
  const a = text.getBoundingClientRect(), b = img.getBoundingClientRect();
  const left = Math.min(a.left, b.left), top = Math.min(a.top, b.top) + window.scrollY;
  document.body.dataset.box = [left, top, Math.max(a.right, b.right) - left, b.bottom + window.scrollY - top]
    .map(Math.round).join(",");
});
</script>"""


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
    named = {kind: [entry["uri"] for name, entry in ordered if name.startswith(f"{kind}.")] for kind in INPUTS}
    run_report(named.pop("runs"), ReportParams(**{**manifest.params, "html": True}), str(out), **named)
    return out / HTML_FILE


def chromium(page: Path, tmp: str, *args: str, height: int = TALL, width: int = WIDTH) -> str:
    """Headless Chromium on `page` in a `width` x `height` window with `args` (its profile under `tmp`); its stdout."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        sys.exit("chromium is not installed: apt-get install -y chromium (make report-screenshot and docs-screenshots do it)")
    done = subprocess.run(
        [
            binary,
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
            f"--window-size={width},{height}",
            *args,
            page.resolve().as_uri(),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.stdout


def save_png(image: Image.Image, png: Path) -> None:
    """`image` as a 256-colour PNG at `png`."""
    png.parent.mkdir(parents=True, exist_ok=True)
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(png, optimize=True)  # a third of the bytes, same look


def frontier_box(page: Path) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) in px of the frontier figure and its heading as Chromium lays `page` out."""
    with tempfile.TemporaryDirectory(prefix="evoesap-box-") as tmp:
        probe = Path(tmp) / page.name
        probe.write_text(page.read_text(encoding="utf-8").replace("</body>", BOX_SCRIPT % FRONTIER + "</body>", 1))
        dom = chromium(probe, tmp, "--virtual-time-budget=10000", "--dump-dom")
    found = re.search(r'data-box="(-?\d+),(-?\d+),(\d+),(\d+)"', dom)
    if found is None:
        sys.exit(f"{page} has no frontier figure (an image whose alt text starts {FRONTIER!r}): see evoesap/stages/report.py")
    x, y, w, h = map(int, found.groups())
    return x, y, x + w, y + h


def screenshot(page: Path, png: Path, frontier: Path | None = None) -> None:
    """Chromium's capture of `page` at WIDTH px, cropped to the page's height; the frontier figure cut out of the same
    capture into `frontier` when given."""
    with tempfile.TemporaryDirectory(prefix="evoesap-shot-") as tmp:
        raw = Path(tmp) / "raw.png"
        chromium(page, tmp, f"--screenshot={raw}")
        image = Image.open(raw).convert("RGB")
    content = ImageChops.difference(image, Image.new("RGB", image.size, "white")).getbbox()
    if content is None:
        sys.exit(f"chromium rendered {page} blank")
    if content[3] >= TALL - 1:
        sys.exit(f"{page} is taller than {TALL} px: raise TALL in {__file__}")
    save_png(image.crop((0, 0, WIDTH, min(TALL, content[3] + MARGIN))), png)
    if frontier is not None:
        left, top, right, bottom = frontier_box(page)
        pad = MARGIN // 2
        save_png(image.crop((max(0, left - pad), max(0, top - pad), min(WIDTH, right + pad), bottom + pad)), frontier)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=Path("runs/demo"), help="the --out of `evoesap pipeline demo`")
    parser.add_argument("--out", type=Path, default=Path("docs/report.png"))
    parser.add_argument("--frontier", type=Path, default=None, help="also cut the frontier figure out, into this PNG")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="evoesap-report-") as tmp:
        page = rerender(newest_report(args.demo), Path(tmp) / "report")
        screenshot(page, args.out, args.frontier)
    print(args.out, *([args.frontier] if args.frontier else []))


if __name__ == "__main__":
    main()
