"""Render a run's TensorBoard page in headless Chromium and save a PNG: how a person sees the dashboards.

    .venv/bin/python scripts/screenshot_tb.py runs/tiny_cpu docs/assets/probe_dashboard.png
    .venv/bin/python scripts/screenshot_tb.py runs/tiny_cpu out.png --tab scalars --size 1600,2400

Starts TensorBoard on a free loopback port, points Chromium (Debian package `chromium`) at the tab, waits for the
charts to draw (virtual time), saves the screenshot and stops both. Chromium runs with its background
networking off (this machine has no network but the package registries).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    raise SystemExit("screenshot_tb: no chromium on PATH (Debian/Ubuntu: apt-get install -y chromium)")


def screenshot(logdir: Path, out: Path, tab: str = "custom_scalars", size: str = "1600,1800", wait_ms: int = 20000):
    browser = chromium()
    port = free_port()
    tb = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline or tb.poll() is not None:
                    raise SystemExit("screenshot_tb: TensorBoard did not start") from None
                time.sleep(0.5)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [
                    browser,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    f"--user-data-dir={profile}",
                    f"--window-size={size}",
                    f"--virtual-time-budget={wait_ms}",
                    f"--screenshot={out.resolve()}",
                    f"http://127.0.0.1:{port}/#{tab}",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=180,
            )
    finally:
        tb.terminate()
        tb.wait(timeout=30)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logdir", type=Path, help="a run directory (its tb/) or any TensorBoard logdir")
    ap.add_argument("out", type=Path, help="PNG to write")
    ap.add_argument("--tab", default="custom_scalars", help="TensorBoard tab (default custom_scalars)")
    ap.add_argument("--size", default="1600,1800", help="window size W,H (default 1600,1800)")
    a = ap.parse_args(argv)
    logdir = a.logdir / "tb" if (a.logdir / "tb").is_dir() else a.logdir
    print(screenshot(logdir, a.out, a.tab, a.size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
