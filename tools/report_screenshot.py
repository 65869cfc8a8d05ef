"""Screenshot the first page of a `snakemake --report` HTML file as a reader sees it (headless Chromium, a
1280x900 window, after the report's JavaScript ran), saved as a small palette PNG: how the README's picture
docs/img/report_front_page.png is made after `make run`.

    .venv/bin/python tools/report_screenshot.py report.html docs/img/report_front_page.png

Needs Chromium (`apt-get install chromium` on Debian) and Pillow."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def screenshot(report: Path, png: Path, width: int, height: int) -> None:
    browser = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if browser is None:
        sys.exit("no Chromium on PATH: apt-get install chromium")
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={width},{height}", "--virtual-time-budget=15000", f"--screenshot={png}",
                    report.resolve().as_uri()], check=True, capture_output=True, timeout=300)


def small_png(source: Path, out: Path, colours: int) -> None:
    """A palette PNG without dithering: text and flat colours stay sharp at a fraction of the bytes."""
    from PIL import Image

    image = Image.open(source).convert("RGB")
    palette = image.quantize(colors=colours, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    palette.save(out, optimize=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("png", type=Path)
    parser.add_argument("--size", default="1280x900", help="browser window, WIDTHxHEIGHT")
    parser.add_argument("--colours", type=int, default=256)
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.split("x"))
    with tempfile.TemporaryDirectory() as scratch:
        raw = Path(scratch) / "page.png"
        screenshot(args.report, raw, width, height)
        small_png(raw, args.png, args.colours)
    print(f"{args.png}: {args.png.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
