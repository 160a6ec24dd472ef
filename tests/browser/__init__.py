"""Helpers for the browser test: Debian's Chromium driven by Playwright, no browser download."""
