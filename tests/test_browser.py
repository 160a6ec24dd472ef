"""The front end in a real browser: headless Chromium (Debian's package) against the real
ComfyUI server with the pack, driven the way a person would use it.

It loads every example workflow through the page (each must become its API twin), then
workflows/carnator_wan21_4node.json, queues it with a prompt and
then with a related one, sees MISS then HIT on the Reuse Sampler node (and the phases on
the way), opens the "Carnator cache" sidebar tab, sees both entries with their pictures,
deletes one with its button, and finds it gone from the page and from the database.
Screenshots go to tests/output/browser/; the node status and the cache tab are copied to
docs/screenshots/ for the README when CARNATOR_UPDATE_SCREENSHOTS=1 (or when missing).
"""
from __future__ import annotations

import json
import os
import sqlite3
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from browser.chromium import (INIT_SCRIPT, keep_screenshot, launch,  # noqa: E402
                              seed_user_settings, unavailable_reason)
from server_harness import ComfyServer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / "workflows" / "carnator_wan21_4node.json"
OUTPUT = REPO / "tests" / "output" / "browser"
DOCS = REPO / "docs" / "screenshots"
PROMPT = "a red ball rolls left across a green field"
RELATED = "a red ball rolls left across a green field slowly"
SAMPLER_NODE, PROMPT_NODE, PROBE_NODE = 8, 2, 5
SPARSE_WIDGETS = ["sparse_attention", "keep_mass", "min_density", "refresh_every", "sparse_on_miss"]
AUDIT_WIDGETS = ["audit_rate"]
RUN_TIMEOUT_MS = 240_000

_reason = unavailable_reason()
if _reason and not os.environ.get("CI"):
    pytestmark = pytest.mark.skip(reason=f"browser test needs Chromium and Playwright: {_reason}")


def db_ids(cache_dir: Path) -> set[str]:
    con = sqlite3.connect(f"file:{cache_dir / 'carnator.sqlite'}?mode=ro", uri=True, timeout=30)
    try:
        return {r[0] for r in con.execute("SELECT id FROM entries")}
    finally:
        con.close()


# ------------------------------------------------------------------ page helpers
WATCH_STATUS = """
() => {
  // record every state the status widgets go through (phases while running, outcomes)
  window.__carnatorSeen = [];
  const api = window.comfyAPI.api.api;
  api.addEventListener("carnator.phase", (e) => {
    window.__carnatorSeen.push("event:" + e.detail.phase);
    // registered after the extension's listener: the status widget has been updated
    for (const node of app.graph.nodes) {
      const el = node.widgets?.find((w) => w.name === "carnator_status")?.element;
      if (el) window.__carnatorSeen.push(`node${node.id}:${el.dataset.carnatorOutcome}:${el.dataset.carnatorPhase || ""}`);
    }
  });
  new MutationObserver((records) => {
    for (const r of records) {
      const el = r.target;
      if (el.dataset && el.dataset.carnatorNode) {
        window.__carnatorSeen.push(`node${el.dataset.carnatorNode}:${el.dataset.carnatorOutcome}:${el.dataset.carnatorPhase || ""}`);
      }
    }
  }).observe(document.body, { subtree: true, attributes: true,
                               attributeFilter: ["data-carnator-outcome", "data-carnator-phase"] });
}
"""

SET_PROMPT = """
([promptNode, probeNode, text]) => {
  const set = (id, name, value) => {
    const w = app.graph.getNodeById(id).widgets.find((w) => w.name === name);
    w.value = value;
    w.callback?.(value);
  };
  set(promptNode, "text", text);
  set(probeNode, "label", text);   // the label the cache tab shows
  app.graph.setDirtyCanvas(true, true);
}
"""

STATUS = """
(nodeId) => {
  const el = document.querySelector(`[data-carnator-node="${nodeId}"]`);
  if (!el) return null;
  const img = el.querySelector("img");
  return { outcome: el.dataset.carnatorOutcome, text: el.dataset.carnatorText,
           shown: el.querySelector(".carnator-status-head").textContent,
           img: img && img.getAttribute("src") ? { entry: img.dataset.entryId, complete: img.complete,
                                                   width: img.naturalWidth } : null };
}
"""

NODE_BOX = """
(ids) => {
  // screen rectangle around the given nodes (title bar included)
  const canvas = app.canvas;
  const rect = canvas.canvas.getBoundingClientRect();
  const title = (window.LiteGraph && LiteGraph.NODE_TITLE_HEIGHT) || 30;
  let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
  for (const id of ids) {
    const n = app.graph.getNodeById(id);
    const a = canvas.ds.convertOffsetToCanvas([n.pos[0], n.pos[1] - title]);
    const b = canvas.ds.convertOffsetToCanvas([n.pos[0] + n.size[0], n.pos[1] + n.size[1]]);
    x0 = Math.min(x0, a[0]); y0 = Math.min(y0, a[1]); x1 = Math.max(x1, b[0]); y1 = Math.max(y1, b[1]);
  }
  return { x: rect.left + x0, y: rect.top + y0, width: x1 - x0, height: y1 - y0 };
}
"""


FRAME = """
([nodeId, scale]) => {
  // zoom so that a person could read the nodes, with the given node near the top left
  const n = app.graph.getNodeById(nodeId);
  const ds = app.canvas.ds;
  ds.scale = scale;
  ds.offset[0] = 60 / scale - n.pos[0];
  ds.offset[1] = 220 / scale - n.pos[1];
  app.graph.setDirtyCanvas(true, true);
}
"""


def status(page):
    return page.evaluate(STATUS, SAMPLER_NODE)


def queue_and_wait(page, outcome: str, running_shot: Path | None = None) -> dict:
    page.evaluate("() => { window.__carnatorSeen = []; }")
    page.get_by_role("button", name="Run", exact=True).first.click()
    if running_shot is not None:  # a picture of a phase on the node, when one is caught
        try:
            page.wait_for_function(
                "(id) => document.querySelector(`[data-carnator-node='${id}']`)"
                "?.dataset.carnatorOutcome === 'running'", arg=SAMPLER_NODE, timeout=60_000)
            page.screenshot(path=str(running_shot))
        except Exception:  # noqa: BLE001 - a fast run may finish between two polls
            pass
    page.wait_for_function(
        "([id, outcome]) => document.querySelector(`[data-carnator-node='${id}']`)"
        "?.dataset.carnatorOutcome === outcome",
        arg=[SAMPLER_NODE, outcome], timeout=RUN_TIMEOUT_MS)
    # the preview of the matched/stored entry has loaded beside the status
    page.wait_for_function(
        "(id) => { const img = document.querySelector(`[data-carnator-node='${id}'] img`);"
        " return img && img.complete && img.naturalWidth > 0; }", arg=SAMPLER_NODE, timeout=30_000)
    return status(page)


def screenshot_nodes(page, ids, path: Path, pad: int = 24) -> None:
    box = page.evaluate(NODE_BOX, ids)
    vw, vh = page.viewport_size["width"], page.viewport_size["height"]
    x, y = max(0, box["x"] - pad), max(0, box["y"] - pad)
    clip = {"x": x, "y": y, "width": min(vw - x, box["width"] + 2 * pad),
            "height": min(vh - y, box["height"] + 2 * pad)}
    page.screenshot(path=str(path), clip=clip)


# ------------------------------------------------------------------ the test
def test_miss_then_hit_on_the_node_and_the_cache_tab(tmp_path):
    if _reason:
        pytest.fail(f"CI must run the browser test: {_reason}")
    from playwright.sync_api import sync_playwright

    OUTPUT.mkdir(parents=True, exist_ok=True)
    seed_user_settings(tmp_path / "user")
    console: list[str] = []
    with ComfyServer(tmp_path) as server, sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 950})
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            page.add_init_script(INIT_SCRIPT)
            page.goto(server.url)
            page.wait_for_function(
                "() => window.app?.graph && app.extensionManager && "
                "app.extensions.some((e) => e.name === 'carnator.frontend')", timeout=90_000)

            # the example workflow, loaded through the page as a person's file would be
            page.evaluate("async (wf) => { await app.loadGraphData(wf); }",
                          json.loads(WORKFLOW.read_text()))
            page.evaluate(WATCH_STATUS)
            page.evaluate(SET_PROMPT, [PROMPT_NODE, PROBE_NODE, PROMPT])

            page.evaluate(FRAME, [6, 1.0])
            first = queue_and_wait(page, "miss", OUTPUT / "00-running.png")
            assert first["shown"] == "MISS · stored", first
            seen = page.evaluate("() => window.__carnatorSeen")
            for phase in ("probe", "lookup", "gate", "sample"):
                assert f"event:{phase}" in seen, seen
                assert f"node{SAMPLER_NODE}:running:{phase}" in seen, seen  # shown on the node
            page.screenshot(path=str(OUTPUT / "01-miss.png"))
            stored_first = first["img"]["entry"]

            page.evaluate(SET_PROMPT, [PROMPT_NODE, PROBE_NODE, RELATED])
            second = queue_and_wait(page, "hit")
            assert second["shown"].startswith("HIT k*="), second
            assert " · saved " in second["shown"] and " · risk " in second["shown"], second
            assert second["img"]["entry"] == stored_first  # the matched entry's picture
            seen = page.evaluate("() => window.__carnatorSeen")
            assert f"node{SAMPLER_NODE}:running:reuse" in seen, seen
            page.screenshot(path=str(OUTPUT / "02-hit.png"))
            # the status is display only: not in the saved workflow, not sent with the prompt
            sent, saved = page.evaluate(
                "async (id) => { const p = await app.graphToPrompt();"
                " return [Object.keys(p.output[id].inputs), p.workflow.nodes.find((n) => n.id == id).widgets_values ?? []]; }",
                SAMPLER_NODE)
            ui_node = next(n for n in json.loads(WORKFLOW.read_text())["nodes"] if n["id"] == SAMPLER_NODE)
            assert sorted(sent) == sorted(["plan"] + SPARSE_WIDGETS + AUDIT_WIDGETS), (sent, saved)
            assert saved == ui_node["widgets_values"], (sent, saved)  # no status value saved
            screenshot_nodes(page, [6, 7, SAMPLER_NODE, 9], OUTPUT / "03-node-status.png")

            # the cache tab: both entries, each with its picture
            page.locator('.side-bar-button[aria-label="Carnator cache"]').click()
            page.wait_for_function("() => document.querySelectorAll('.carnator-entry').length === 2",
                                   timeout=30_000)
            page.wait_for_function(
                "() => [...document.querySelectorAll('.carnator-entry img')]"
                ".every((img) => img.complete && img.naturalWidth > 0)", timeout=30_000)
            ids = page.eval_on_selector_all(".carnator-entry", "els => els.map((e) => e.dataset.entryId)")
            assert set(ids) == db_ids(server.cache_dir) and len(set(ids)) == 2
            prompts = page.eval_on_selector_all(".carnator-entry-prompt", "els => els.map((e) => e.textContent)")
            assert sorted(prompts) == sorted([PROMPT, RELATED])
            totals = page.locator(".carnator-totals").inner_text()
            assert "2 entries" in totals and "hit rate 50%" in totals, totals
            # the gate panel: this model runs the uncalibrated prior, and says what to do
            gate = page.locator(".carnator-gate").first.inner_text()
            assert "uncalibrated prior" in gate and "Carnator Calibrate" in gate, gate
            assert "no live audits yet" in gate, gate
            page.screenshot(path=str(OUTPUT / "04-cache-tab.png"))

            # delete the first request's entry with its button
            victim = stored_first
            page.locator(f'.carnator-entry[data-entry-id="{victim}"] .carnator-delete').click()
            page.wait_for_function(
                "(id) => !document.querySelector(`.carnator-entry[data-entry-id='${id}']`) && "
                "document.querySelectorAll('.carnator-entry').length === 1", arg=victim, timeout=30_000)
            page.wait_for_function(
                "() => document.querySelector('.carnator-totals')?.dataset.entries === '1'", timeout=30_000)
            assert victim not in db_ids(server.cache_dir) and len(db_ids(server.cache_dir)) == 1
            assert not (server.cache_dir / "tensors" / f"{victim}.safetensors").exists()
            assert server.get("/carnator/entries")["total"] == 1
            page.screenshot(path=str(OUTPUT / "05-after-delete.png"))

            # pin the remaining entry, then "clear all": cancel once, confirm the second time
            (kept,) = db_ids(server.cache_dir)
            page.locator(f'.carnator-entry[data-entry-id="{kept}"] .carnator-pin').click()
            page.wait_for_selector(f'.carnator-entry[data-entry-id="{kept}"][data-pinned="true"]')
            assert server.get(f"/carnator/entries/{kept}")["pinned"] is True
            page.locator(".carnator-clear").click()
            confirm = page.locator(".carnator-confirm")
            assert "1 pinned included" in confirm.inner_text()
            page.screenshot(path=str(OUTPUT / "06-clear-confirm.png"))
            page.locator(".carnator-clear-cancel").click()
            assert db_ids(server.cache_dir) == {kept}
            page.locator(".carnator-clear").click()
            page.locator(".carnator-clear-confirm").click()
            page.wait_for_selector(".carnator-empty")
            assert db_ids(server.cache_dir) == set()
        finally:
            (OUTPUT / "console.log").write_text("\n".join(console))
            browser.close()

    errors = [c for c in console if c.startswith("pageerror") and "carnator" in c.lower()]
    assert not errors, errors
    # the README's pictures: refreshed on request, so a test run leaves the work tree clean
    for src, name in (("03-node-status.png", "node-status.png"), ("04-cache-tab.png", "cache-tab.png")):
        if os.environ.get("CARNATOR_UPDATE_SCREENSHOTS") == "1" or not (DOCS / name).exists():
            keep_screenshot(OUTPUT / src, DOCS / name)


def test_every_example_workflow_loads_in_the_page_as_its_api_twin(tmp_path):
    """Each UI workflow in workflows/ (Wan 2.2 5B and A14B, HunyuanVideo 1.5 included) loads
    in the real front end with every node known, and the page turns it into exactly the
    API twin scripts/make_workflows.py wrote."""
    if _reason:
        pytest.fail(f"CI must run the browser test: {_reason}")
    from playwright.sync_api import sync_playwright

    seed_user_settings(tmp_path / "user")
    ui_files = sorted((REPO / "workflows").glob("*.json"))
    assert {f"carnator_{b}_{kind}.json" for b in ("wan22_5b", "wan22_a14b", "hunyuan_video15")
            for kind in ("4node", "sampler")} <= {f.name for f in ui_files}
    with ComfyServer(tmp_path) as server, sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 950})
            page.add_init_script(INIT_SCRIPT)
            page.goto(server.url)
            page.wait_for_function("() => window.app?.graph && app.extensionManager", timeout=90_000)
            for ui_file in ui_files:
                twin = json.loads((REPO / "workflows" / "api" / f"{ui_file.stem}.api.json").read_text())
                sent = page.evaluate(
                    "async (wf) => { await app.loadGraphData(wf);"
                    " const unknown = app.graph.nodes.filter((n) => !LiteGraph.registered_node_types[n.type]);"
                    " return [unknown.map((n) => n.type), (await app.graphToPrompt()).output]; }",
                    json.loads(ui_file.read_text()))
                unknown, output = sent
                assert not unknown, (ui_file.name, unknown)
                assert {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in output.items()} == \
                    {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in twin.items()}, ui_file.name
        finally:
            browser.close()
