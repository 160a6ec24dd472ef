"""Start Debian's own Chromium (the `chromium` package) under Playwright for Python.

Playwright is used only as a driver: ``executable_path`` points at the distribution's
binary, so nothing is ever downloaded (``playwright install`` is never run). Outside CI a
machine without ``/usr/bin/chromium`` skips the browser test with the install line; with
``CI`` set the test fails instead, so a CI machine that lost the browser is noticed.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

CHROMIUM = os.environ.get("CARNATOR_CHROMIUM", "/usr/bin/chromium")
INSTALL_HINT = "apt-get install -y chromium && pip install playwright (see requirements-test.txt)"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio"]

# ComfyUI front-end settings for a fresh user directory: no first-run template browser,
# no minimap over the canvas.
FRESH_USER_SETTINGS = {"Comfy.TutorialCompleted": True, "Comfy.Minimap.Visible": False}
# Runs in the page before its own scripts: dismiss the "Nodes 2.0" announcement banner.
INIT_SCRIPT = "try { localStorage.setItem('vueNodesBannerDismissed', 'true'); } catch (e) {}"


def unavailable_reason() -> str | None:
    """Why the browser test cannot run here, or None when it can."""
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        return f"no Chromium at {CHROMIUM} ({INSTALL_HINT})"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return f"Playwright for Python is not installed ({INSTALL_HINT})"
    return None


def seed_user_settings(user_dir: Path) -> None:
    path = Path(user_dir) / "default" / "comfy.settings.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(FRESH_USER_SETTINGS))


def launch(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)


def keep_screenshot(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
