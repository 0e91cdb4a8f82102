"""Screenshot an `opd report` HTML page with headless Chromium and check the picture is not blank.

    python scripts/render_report.py runs/my-run/report.html /tmp/report.png [--height 4000] [--chromium PATH]

Exits 0 when the screenshot exists and is not a single colour, 1 otherwise. Chromium runs offline-minded (no QUIC,
no background networking, no component updates, a throwaway profile); the report itself has no external assets.
Only the first `--height` pixels of the page are captured (Chromium's `--screenshot` shoots the window, not the page).
Install Chromium on Debian/Ubuntu with `apt-get install -y chromium`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image, ImageStat

CANDIDATES = ["/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"]


def find_chromium(explicit: str | None) -> str:
    for candidate in [explicit] + CANDIDATES + [shutil.which("chromium") or ""]:
        if candidate and Path(candidate).is_file():
            return candidate
    raise SystemExit("no Chromium found; install it (apt-get install -y chromium) or pass --chromium PATH")


def screenshot(
    html: Path, png: Path, *, chromium: str, width: int = 1400, height: int = 4000, timeout: float = 120
) -> None:
    """Render `html` into `png` (width × height pixels) with a throwaway Chromium profile."""
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="opd-chromium-") as profile:
        command = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--screenshot={png.resolve()}",
            f"--window-size={width},{height}",
            html.resolve().as_uri(),
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0 or not png.is_file():
        raise SystemExit(f"chromium failed (exit {result.returncode}):\n{result.stderr[-2000:]}")


def blank_reason(png: Path) -> str | None:
    """Why the screenshot looks blank, or None when it has content (several colours, some non-white area)."""
    image = Image.open(png).convert("L")
    low, high = image.getextrema()
    if low == high:
        return f"a single colour ({low})"
    inked = sum(image.point(lambda v: 255 if v < 200 else 0).histogram()[255:])
    fraction = inked / (image.width * image.height)
    if fraction < 0.005:
        return f"only {fraction:.2%} of the pixels are dark"
    mean = ImageStat.Stat(image).mean[0]
    print(f"{png}: {image.width}×{image.height}, {fraction:.1%} dark pixels, mean grey {mean:.0f}")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report_html", type=Path, help="the report.html to render")
    parser.add_argument("out_png", type=Path, help="where to write the screenshot")
    parser.add_argument("--width", type=int, default=1400, help="window width in pixels")
    parser.add_argument("--height", type=int, default=4000, help="window height in pixels (the part captured)")
    parser.add_argument("--chromium", default=None, help="path to the Chromium binary")
    args = parser.parse_args(argv)
    if not args.report_html.is_file():
        parser.error(f"{args.report_html} does not exist")
    screenshot(
        args.report_html, args.out_png, chromium=find_chromium(args.chromium), width=args.width, height=args.height
    )
    reason = blank_reason(args.out_png)
    if reason:
        print(f"{args.out_png}: looks blank: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
