"""The README's dashboard screenshot, from a real run: `streamrl up --demo` (the demo model on the embedded
broker and a vLLM server, as `scripts/demo.sh` runs it), the dashboard open in headless Chromium until the
served reward of some version reaches ``--reward`` after at least ``--versions`` versions, then a
screenshot and Ctrl-C (SIGINT) to the run.

    .venv/bin/python scripts/dashboard_screenshot.py [--out docs/dashboard.png] [--reward 0.9] [--versions 6]

Needs Debian's chromium and chromium-driver (scripts/setup.sh installs them) and selenium (dev extra).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T | None], timeout: float, proc: subprocess.Popen) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"streamrl up exited ({proc.returncode}) before {what}")
        if result := check():
            return result
        time.sleep(0.5)
    raise SystemExit(f"{what}: not within {timeout:.0f}s")


def dashboard_versions(url: str) -> list[dict]:
    try:
        return httpx.get(f"{url}/dashboard/data", timeout=5).json()["versions"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    p.add_argument("--reward", type=float, default=0.9, help="take it once a version's served mean reaches this")
    p.add_argument("--versions", type=int, default=6, help="... and at least this many versions have served")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--port", type=int, default=8093)
    args = p.parse_args()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    work = Path(tempfile.mkdtemp(prefix="streamrl-screenshot-"))
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "streamrl.cli", "up", "--demo", "--demo-until-reward", "2", "--port", str(args.port),
           "--work-dir", str(work / "run"), "--demo-max-seconds", str(args.timeout)]
    with (work / "up.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-background-networking", "--disable-dev-shm-usage",
                "--window-size=1400,1700"):
        options.add_argument(arg)
    driver = None
    try:
        wait_for("the dashboard", lambda: dashboard_versions(url) or None, args.timeout, proc)
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        driver.get(f"{url}/dashboard")

        def risen() -> list[dict] | None:
            versions = [v for v in dashboard_versions(url) if v["rewards"]]
            best = max((v["reward_mean"] for v in versions), default=0.0)
            return versions if len(versions) >= args.versions and best >= args.reward else None

        versions = wait_for(f"a served mean reward of {args.reward}", risen, args.timeout, proc)
        from selenium.webdriver.support.ui import WebDriverWait

        def drawn(d: webdriver.Chrome) -> bool:  # the page has drawn every served version
            series = d.find_element("id", "reward-version").get_attribute("data-series") or ""
            found = re.search(r"(?:^|,)served:(\d+)", series)
            return bool(found) and int(found.group(1)) >= len(versions)

        WebDriverWait(driver, 30, poll_frequency=0.2).until(drawn)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(args.out))
        print(f"{args.out}: {len(versions)} versions, served mean reward "
              + " ".join(f"v{v['version']} {v['reward_mean']:.2f}" for v in versions))
    finally:
        if driver is not None:
            driver.quit()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(120)
    print(f"run log: {work / 'up.log'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
