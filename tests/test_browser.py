"""The front end in a real browser: headless Chromium (Debian's package) against the real
ComfyUI server with the pack, driven the way a person would use it.

Every test runs on two front ends — the one ComfyUI 0.3.75 bundles (1.32.9) and the newest on
the registry (comfyui-frontend-package 1.58.1, unpacked by scripts/provision.sh and served with
ComfyUI's ``--front-end-root``) — and the node status test in both node views: the classic
canvas and "Nodes 2.0" (Vue nodes, the ``Comfy.VueNodes.Enabled`` setting).

- ``test_outcome_on_the_node``: the first example workflow (trained tiny-world model, one
  Carnator Sampler) queued twice: MISS then HIT, each with the badge in the node's title bar
  (drawn on the canvas in the classic view, a DOM element in Nodes 2.0 — both read back), the
  status text, and pictures of real objects (a grey background with coloured shapes, not
  noise): on the hit, this request's video with region M outlined beside the entry it reused.
- ``test_every_example_workflow_loads_in_the_page_as_its_api_twin``: each UI workflow in
  workflows/ (Wan 2.2 5B and A14B, HunyuanVideo 1.5 included) loads with every node known and
  becomes exactly the API twin scripts/make_workflows.py wrote.
- ``test_miss_then_hit_on_the_node_and_the_cache_tab``: the four-node workflow, the phases
  shown while it runs, then the "Carnator cache" sidebar tab: both entries with their
  pictures and their own prompts as labels, the gate panel, delete, pin and clear all.

Screenshots go to tests/output/browser/; the newest front end's node status (classic and
Nodes 2.0) and cache tab are copied to docs/screenshots/ for the README when
CARNATOR_UPDATE_SCREENSHOTS=1 (or when missing).
"""
from __future__ import annotations

import io
import json
import os
import shutil
import sqlite3
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from browser.chromium import (INIT_SCRIPT, keep_screenshot, launch,  # noqa: E402
                              seed_user_settings, unavailable_reason)
import repo_scripts  # noqa: E402
from server_harness import ComfyServer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLER_WORKFLOW = REPO / "workflows" / "carnator_tinyworld_sampler.json"
FOUR_NODE_WORKFLOW = REPO / "workflows" / "carnator_tinyworld_4node.json"
OUTPUT = REPO / "tests" / "output" / "browser"
DOCS = REPO / "docs" / "screenshots"
NEWEST = "1.58.1"  # scripts/provision.sh: NEW_FRONTEND_VERSION
FRONT_ENDS = {"bundled": None, NEWEST: REPO / ".host" / f"frontend-{NEWEST}" / "static"}
MODES = {"classic": False, "nodes2": True}
PROMPT = "a red circle in the top left moves right"
PARAPHRASE = "a scarlet ball at the top left travels right"
ADDED = "a red circle in the top left moves right and a blue square in the bottom right moves up"
SAMPLER_NODE, SAMPLER_PROMPT_NODE = 5, 2
PROMPT_NODE, PROBE_NODE, REUSE_NODE = 2, 5, 8
SPARSE_WIDGETS = ["sparse_attention", "keep_mass", "min_density", "refresh_every", "sparse_on_miss"]
AUDIT_WIDGETS = ["audit_rate", "explore_rate"]
BADGE_COLOUR = {"miss": (0xb7, 0x79, 0x1f), "hit": (0x2e, 0x9e, 0x5b), "exact": (0x3a, 0x7b, 0xd5)}
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


# ------------------------------------------------------------------ one server per front end
@pytest.fixture(scope="module", params=list(FRONT_ENDS))
def server(request, tmp_path_factory):
    """A real ComfyUI serving this front end; the tiny world's calibration in its cache, as
    scripts/install_models.py places it for a user."""
    if _reason:
        pytest.fail(f"CI must run the browser test: {_reason}")
    root = FRONT_ENDS[request.param]
    if root is not None and not (root / "index.html").is_file():
        pytest.fail(f"front end {request.param} is not unpacked at {root}: run scripts/provision.sh")
    work = tmp_path_factory.mktemp(f"browser-{request.param}")
    seed_user_settings(work / "user")
    (work / "user" / "carnator_cache" / "calibration").mkdir(parents=True)
    # the calibrations a user installs (per probe, and one measured at an N): not reports
    for f in repo_scripts.load("scripts/install_models.py", "install_models").bundled_calibrations():
        shutil.copy(f, work / "user" / "carnator_cache" / "calibration" / f.name)
    with ComfyServer(work, front_end_root=root) as s:
        s.front_end = request.param
        yield s


def open_page(pw, server, nodes2: bool, console: list[str], height: int = 950):
    # the setting a person flips in Settings → "Nodes 2.0", stored for the user before the page loads
    server.request("POST", "/settings/Comfy.VueNodes.Enabled", nodes2)
    browser = launch(pw)
    page = browser.new_page(viewport={"width": 1500, "height": height})
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    page.add_init_script(INIT_SCRIPT)
    page.goto(server.url)
    page.wait_for_function(
        "() => window.app?.graph && app.extensionManager && "
        "app.extensions.some((e) => e.name === 'carnator.frontend')", timeout=90_000)
    assert page.evaluate("() => app.extensionManager.setting.get('Comfy.VueNodes.Enabled')") is nodes2
    return browser, page


def load_workflow(page, path: Path) -> None:
    """The workflow loaded through the page, as a person's file would be."""
    page.evaluate("async (wf) => { await app.loadGraphData(wf); }", json.loads(path.read_text()))


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

SET_WIDGETS = """
(values) => {
  for (const [id, name, value] of values) {
    const w = app.graph.getNodeById(id).widgets.find((w) => w.name === name);
    w.value = value;
    w.callback?.(value);
  }
  app.graph.setDirtyCanvas(true, true);
}
"""

STATUS = """
(nodeId) => {
  const el = document.querySelector(`.carnator-status[data-carnator-node="${nodeId}"]`);
  if (!el) return null;
  const pic = (role) => {
    const img = el.querySelector(`img[data-role="${role}"]`);
    if (!img || !img.getAttribute("src") || img.closest("figure").hidden) return null;
    // the part a person sees: the picture cut by every ancestor that clips (the node, the widget)
    const box = img.getBoundingClientRect();
    let [x0, y0, x1, y1] = [box.left, box.top, box.right, box.bottom];
    for (let a = img.parentElement; a; a = a.parentElement) {
      const style = getComputedStyle(a);
      if (style.overflow === "visible" && style.overflowY === "visible") continue;
      const r = a.getBoundingClientRect();
      x0 = Math.max(x0, r.left); y0 = Math.max(y0, r.top); x1 = Math.min(x1, r.right); y1 = Math.min(y1, r.bottom);
    }
    return { entry: img.dataset.entryId, src: img.getAttribute("src"), complete: img.complete,
             width: img.naturalWidth, shownWidth: Math.max(0, x1 - x0), shownHeight: Math.max(0, y1 - y0),
             height: box.height,
             caption: img.closest("figure").querySelector("figcaption").textContent };
  };
  const box = el.getBoundingClientRect();
  return { outcome: el.dataset.carnatorOutcome, text: el.dataset.carnatorText,
           shown: el.querySelector(".carnator-status-head").textContent,
           visible: box.width > 0 && box.height > 0 && el.isConnected,
           request: pic("request"), source: pic("source") };
}
"""

# The badge as a person sees it. Nodes 2.0: the DOM element in the node's header. Classic: the
# title bar as drawn on the canvas, read back pixel by pixel (pixels of the outcome's colour).
BADGE = """
([nodeId, rgb]) => {
  const el = document.querySelector(`.carnator-badge[data-carnator-badge-node="${nodeId}"]`);
  if (el) {
    const box = el.getBoundingClientRect();
    return { kind: "dom", text: el.textContent, visible: box.width > 0 && box.height > 0 };
  }
  const n = app.graph.getNodeById(nodeId);
  const canvas = app.canvas;
  const title = (window.LiteGraph && LiteGraph.NODE_TITLE_HEIGHT) || 30;
  const a = canvas.ds.convertOffsetToCanvas([n.pos[0] + n.size[0] / 2, n.pos[1] - title]);
  const b = canvas.ds.convertOffsetToCanvas([n.pos[0] + n.size[0], n.pos[1]]);
  const ratio = canvas.canvas.width / canvas.canvas.getBoundingClientRect().width;
  const x = Math.max(0, Math.round(a[0] * ratio)), y = Math.max(0, Math.round(a[1] * ratio));
  const w = Math.round((b[0] - a[0]) * ratio), h = Math.round((b[1] - a[1]) * ratio);
  const data = canvas.canvas.getContext("2d").getImageData(x, y, w, h).data;
  let match = 0;
  for (let i = 0; i < data.length; i += 4) {
    if (Math.abs(data[i] - rgb[0]) < 12 && Math.abs(data[i + 1] - rgb[1]) < 12 && Math.abs(data[i + 2] - rgb[2]) < 12) match++;
  }
  return { kind: "canvas", text: n.carnatorBadge?.text ?? null, pixels: match };
}
"""

NODE_BOX = """
(ids) => {
  // screen rectangle around the given nodes (title bar included): the DOM node in Nodes 2.0,
  // the canvas geometry in the classic view
  let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
  const canvas = app.canvas;
  const rect = canvas.canvas.getBoundingClientRect();
  const title = (window.LiteGraph && LiteGraph.NODE_TITLE_HEIGHT) || 30;
  for (const id of ids) {
    const el = document.querySelector(`[data-node-id="${id}"]`);
    let a, b;
    if (el) {
      const r = el.getBoundingClientRect();
      a = [r.left, r.top]; b = [r.right, r.bottom];
    } else {
      const n = app.graph.getNodeById(id);
      const p = canvas.ds.convertOffsetToCanvas([n.pos[0], n.pos[1] - title]);
      const q = canvas.ds.convertOffsetToCanvas([n.pos[0] + n.size[0], n.pos[1] + n.size[1]]);
      a = [rect.left + p[0], rect.top + p[1]]; b = [rect.left + q[0], rect.top + q[1]];
    }
    x0 = Math.min(x0, a[0]); y0 = Math.min(y0, a[1]); x1 = Math.max(x1, b[0]); y1 = Math.max(y1, b[1]);
  }
  return { x: x0, y: y0, width: x1 - x0, height: y1 - y0 };
}
"""

FRAME = """
([nodeId, scale, left, top]) => {
  // zoom so that a person could read the nodes, with the given node near the top left
  const n = app.graph.getNodeById(nodeId);
  const ds = app.canvas.ds;
  ds.scale = scale;
  ds.offset[0] = left / scale - n.pos[0];
  ds.offset[1] = top / scale - n.pos[1];
  app.graph.setDirtyCanvas(true, true);
}
"""


def status(page, node_id: int) -> dict:
    return page.evaluate(STATUS, node_id)


def queue_and_wait(page, node_id: int, outcome: str, running_shot: Path | None = None) -> dict:
    page.evaluate("() => { window.__carnatorSeen = []; }")
    page.get_by_role("button", name="Run", exact=True).first.click()
    if running_shot is not None:  # a picture of a phase on the node, when one is caught
        try:
            page.wait_for_function(
                "(id) => document.querySelector(`.carnator-status[data-carnator-node='${id}']`)"
                "?.dataset.carnatorOutcome === 'running'", arg=node_id, timeout=60_000)
            page.screenshot(path=str(running_shot))
        except Exception:  # noqa: BLE001 - a fast run may finish between two polls
            pass
    page.wait_for_function(
        "([id, outcome]) => document.querySelector(`.carnator-status[data-carnator-node='${id}']`)"
        "?.dataset.carnatorOutcome === outcome",
        arg=[node_id, outcome], timeout=RUN_TIMEOUT_MS)
    # every picture beside the status has loaded
    page.wait_for_function(
        "(id) => { const imgs = [...document.querySelectorAll(`.carnator-status[data-carnator-node='${id}'] figure:not([hidden]) img`)];"
        " return imgs.length > 0 && imgs.every((img) => img.complete && img.naturalWidth > 0); }",
        arg=node_id, timeout=30_000)
    return status(page, node_id)


def badge(page, node_id: int, outcome: str) -> dict:
    return page.evaluate(BADGE, [node_id, list(BADGE_COLOUR[outcome])])


def assert_badge(page, node_id: int, outcome: str, nodes2: bool) -> None:
    want = "dom" if nodes2 else "canvas"
    try:  # the header badge is synced, the canvas redrawn, on the next frames
        page.wait_for_function(
            f"([id, rgb]) => {{ const b = ({BADGE})([id, rgb]); return b.kind === '{want}' && "
            f"b.text === '{outcome.upper()}' && (b.kind === 'dom' ? b.visible : b.pixels >= 60); }}",
            arg=[node_id, list(BADGE_COLOUR[outcome])], timeout=10_000)
    except Exception:  # noqa: BLE001 - the assertions below say what was seen instead
        pass
    got = badge(page, node_id, outcome)
    assert got["text"] == outcome.upper(), got
    if nodes2:
        assert got["kind"] == "dom" and got["visible"], got
    else:  # drawn: a filled badge of the outcome's colour in the title bar
        assert got["kind"] == "canvas" and got["pixels"] >= 60, got


def picture_stats(server, src: str) -> dict:
    """What a preview shows: the tiny world's grey background, coloured objects, and how
    rough it is (noise changes colour from one pixel to the next; objects do not)."""
    import numpy as np
    from PIL import Image
    path = src[src.index("/carnator/"):] if "/carnator/" in src else src
    img = np.asarray(Image.open(io.BytesIO(server.get(path))).convert("RGB")).astype(np.int32)
    grey = (np.abs(img - 128) < 30).all(axis=2).mean()
    coloured = ((img.max(axis=2) - img.min(axis=2)) > 120).mean()
    rough = np.abs(np.diff(img, axis=1)).mean()
    return {"grey": float(grey), "coloured": float(coloured), "rough": float(rough)}


def assert_recognisable(server, pic: dict) -> None:
    assert pic and pic["complete"] and pic["width"] > 0, pic
    # shown whole: not collapsed, not cut off by the node
    assert pic["shownWidth"] > 50 and pic["shownHeight"] >= 40 and pic["shownHeight"] >= pic["height"] - 1, pic
    got = picture_stats(server, pic["src"])
    # measured: tiny-world frames are ~80-90% background with 5-20% saturated objects and
    # a mean neighbour difference under 10; the random models' previews are under 5% grey
    assert got["grey"] > 0.5 and got["coloured"] > 0.02 and got["rough"] < 20, got


def screenshot_nodes(page, ids, path: Path, pad: int = 24) -> None:
    box = page.evaluate(NODE_BOX, ids)
    vw, vh = page.viewport_size["width"], page.viewport_size["height"]
    x, y = max(0, box["x"] - pad), max(0, box["y"] - pad)
    clip = {"x": x, "y": y, "width": min(vw - x, box["width"] + 2 * pad),
            "height": min(vh - y, box["height"] + 2 * pad)}
    page.screenshot(path=str(path), clip=clip)


def keep_for_readme(src: Path, name: str) -> None:
    if os.environ.get("CARNATOR_UPDATE_SCREENSHOTS") == "1" or not (DOCS / name).exists():
        keep_screenshot(src, DOCS / name)


def carnator_errors(console: list[str]) -> list[str]:
    """Errors from the pack's scripts, and the deprecation 1.58 reports for what the pack once
    read (output.links: phases are routed with node.getOutputNodes() now)."""
    return [c for c in console if (c.startswith("pageerror") and "carnator" in c.lower())
            or "output.links is deprecated" in c]


# ------------------------------------------------------------------ the tests
@pytest.mark.parametrize("mode", list(MODES))
def test_outcome_on_the_node(server, mode):
    from playwright.sync_api import sync_playwright

    nodes2 = MODES[mode]
    name = f"{server.front_end}-{mode}"
    OUTPUT.mkdir(parents=True, exist_ok=True)
    console: list[str] = []
    # a seed of its own: the first request misses even though the server's cache is shared
    seed = 1000 + list(MODES).index(mode)
    with sync_playwright() as pw:
        browser, page = open_page(pw, server, nodes2, console, height=1300)  # the whole node in view
        try:
            load_workflow(page, SAMPLER_WORKFLOW)
            page.evaluate(FRAME, [SAMPLER_NODE, 0.8, 560, 70])
            page.wait_for_selector(f'.carnator-status[data-carnator-node="{SAMPLER_NODE}"]', timeout=30_000)
            idle = status(page, SAMPLER_NODE)
            assert idle["visible"] and idle["outcome"] == "idle", idle  # shown before any run
            page.evaluate(SET_WIDGETS, [[SAMPLER_PROMPT_NODE, "text", PROMPT], [SAMPLER_NODE, "seed", seed]])

            first = queue_and_wait(page, SAMPLER_NODE, "miss")
            assert first["visible"] and first["shown"] == "MISS · stored", first
            assert_badge(page, SAMPLER_NODE, "miss", nodes2)
            assert first["source"] is None, first
            assert_recognisable(server, first["request"])
            stored_first = first["request"]["entry"]

            page.evaluate(SET_WIDGETS, [[SAMPLER_PROMPT_NODE, "text", ADDED]])
            second = queue_and_wait(page, SAMPLER_NODE, "hit")
            assert second["shown"].startswith("HIT k*="), second
            assert " · saved " in second["shown"] and " · risk " in second["shown"], second
            assert_badge(page, SAMPLER_NODE, "hit", nodes2)
            # the entry it reused, beside this request's own video with region M outlined
            assert second["source"]["entry"] == stored_first, second
            assert "reused entry" in second["source"]["caption"], second
            assert second["request"]["entry"] not in (None, stored_first), second
            assert second["request"]["src"].endswith("?region=1"), second
            assert "region M outlined" in second["request"]["caption"], second
            assert_recognisable(server, second["source"])
            assert_recognisable(server, second["request"])
            shot = OUTPUT / f"node-status-{name}.png"
            screenshot_nodes(page, [SAMPLER_NODE], shot)
            page.screenshot(path=str(OUTPUT / f"page-{name}.png"))
        finally:
            (OUTPUT / f"console-{name}.log").write_text("\n".join(console))
            browser.close()
    assert not carnator_errors(console), carnator_errors(console)
    if server.front_end == NEWEST:
        keep_for_readme(shot, f"node-status-{mode}.png")


def test_miss_then_hit_on_the_node_and_the_cache_tab(server):
    from playwright.sync_api import sync_playwright

    OUTPUT.mkdir(parents=True, exist_ok=True)
    name = server.front_end
    server.request("POST", "/carnator/clear", {"confirm": True})  # a cache of its own
    console: list[str] = []
    with sync_playwright() as pw:
        browser, page = open_page(pw, server, False, console)
        try:
            load_workflow(page, FOUR_NODE_WORKFLOW)
            page.evaluate(WATCH_STATUS)
            # label is left empty, as the workflow ships: each entry is listed under its own prompt
            page.evaluate(SET_WIDGETS, [[PROMPT_NODE, "text", PROMPT]])

            page.evaluate(FRAME, [6, 1.0, 60, 220])
            first = queue_and_wait(page, REUSE_NODE, "miss", OUTPUT / f"00-running-{name}.png")
            assert first["shown"] == "MISS · stored", first
            seen = page.evaluate("() => window.__carnatorSeen")
            for phase in ("probe", "lookup", "gate", "sample"):
                assert f"event:{phase}" in seen, seen
                assert f"node{REUSE_NODE}:running:{phase}" in seen, seen  # shown on the node
            page.screenshot(path=str(OUTPUT / f"01-miss-{name}.png"))
            stored_first = first["request"]["entry"]

            page.evaluate(SET_WIDGETS, [[PROMPT_NODE, "text", PARAPHRASE]])
            second = queue_and_wait(page, REUSE_NODE, "hit")
            assert second["shown"].startswith("HIT k*="), second
            assert second["source"]["entry"] == stored_first  # the matched entry's picture
            seen = page.evaluate("() => window.__carnatorSeen")
            assert f"node{REUSE_NODE}:running:reuse" in seen, seen
            page.screenshot(path=str(OUTPUT / f"02-hit-{name}.png"))
            # the status is display only: not in the saved workflow, not sent with the prompt
            sent, saved = page.evaluate(
                "async (id) => { const p = await app.graphToPrompt();"
                " return [Object.keys(p.output[id].inputs), p.workflow.nodes.find((n) => n.id == id).widgets_values ?? []]; }",
                REUSE_NODE)
            ui_node = next(n for n in json.loads(FOUR_NODE_WORKFLOW.read_text())["nodes"] if n["id"] == REUSE_NODE)
            assert sorted(sent) == sorted(["plan"] + SPARSE_WIDGETS + AUDIT_WIDGETS), (sent, saved)
            assert saved == ui_node["widgets_values"], (sent, saved)  # no status value saved
            screenshot_nodes(page, [6, 7, REUSE_NODE, 9], OUTPUT / f"03-node-status-{name}.png")

            # the cache tab: both entries, each with its picture and its own prompt
            page.locator('.side-bar-button[aria-label="Carnator cache"]').click()
            page.wait_for_function("() => document.querySelectorAll('.carnator-entry').length === 2",
                                   timeout=30_000)
            page.wait_for_function(
                "() => [...document.querySelectorAll('.carnator-entry img')]"
                ".every((img) => img.complete && img.naturalWidth > 0)", timeout=30_000)
            ids = page.eval_on_selector_all(".carnator-entry", "els => els.map((e) => e.dataset.entryId)")
            assert set(ids) == db_ids(server.cache_dir) and len(set(ids)) == 2
            prompts = page.eval_on_selector_all(".carnator-entry-prompt", "els => els.map((e) => e.textContent)")
            assert sorted(prompts) == sorted([PROMPT, PARAPHRASE])
            for src in page.eval_on_selector_all(".carnator-entry img", "els => els.map((e) => e.getAttribute('src'))"):
                got = picture_stats(server, src)
                assert got["grey"] > 0.5 and got["coloured"] > 0.02 and got["rough"] < 20, got
            totals = page.locator(".carnator-totals").inner_text()
            assert "2 entries" in totals and "hit rate 50%" in totals, totals
            # the gate panel: this model is calibrated (its file in the cache), at the steps
            # its calibration records (the route's measured_steps), no audits yet
            gate = page.locator(".carnator-gate").first.inner_text()
            assert "calibrated: " in gate and "reuses measured" in gate, gate
            listed = server.get("/carnator/calibration")["models"][0]
            assert (f"measured at {listed['measured_steps']} steps" in gate) == bool(listed["measured_steps"]), gate
            sizes = ", ".join("×".join(map(str, t)) for t in listed["measured_latents"])
            assert (f", latent {sizes}" in gate) == bool(sizes), gate
            assert "no live audits yet" in gate, gate
            # the model is named as it was loaded (UNETLoader's file), its fingerprint on hover
            named = [m for m in server.get("/carnator/calibration")["models"] if m["names"]]
            assert [m["names"] for m in named] == [["carnator_tinyworld_wan21.safetensors"]], named
            label = page.locator(f'.carnator-gate[data-fingerprint="{named[0]["fingerprint"]}"] '
                                 '.carnator-gate-model')
            assert label.inner_text() == "carnator_tinyworld_wan21.safetensors"
            assert named[0]["fingerprint"] in label.get_attribute("title")
            assert "demo_models" not in page.locator(".carnator-gates").inner_text()
            # a calibration measured at its own N is listed with the model it belongs to
            at_n = [m for m in server.get("/carnator/calibration")["models"] if m["calibrated_steps"]]
            assert at_n, "the bundled tiny world's 30-step calibration is not listed"
            for m in at_n:
                row = page.locator(f'.carnator-gate[data-fingerprint="{m["fingerprint"]}"]').inner_text()
                for c in m["calibrated_steps"]:
                    assert f"{c['steps']} steps" in row and "own calibration at" in row, row
            page.screenshot(path=str(OUTPUT / f"04-cache-tab-{name}.png"))

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
            page.screenshot(path=str(OUTPUT / f"05-after-delete-{name}.png"))

            # pin the remaining entry, then "clear all": cancel once, confirm the second time
            (kept,) = db_ids(server.cache_dir)
            page.locator(f'.carnator-entry[data-entry-id="{kept}"] .carnator-pin').click()
            page.wait_for_selector(f'.carnator-entry[data-entry-id="{kept}"][data-pinned="true"]')
            assert server.get(f"/carnator/entries/{kept}")["pinned"] is True
            page.locator(".carnator-clear").click()
            confirm = page.locator(".carnator-confirm")
            assert "1 pinned included" in confirm.inner_text()
            page.screenshot(path=str(OUTPUT / f"06-clear-confirm-{name}.png"))
            page.locator(".carnator-clear-cancel").click()
            assert db_ids(server.cache_dir) == {kept}
            page.locator(".carnator-clear").click()
            page.locator(".carnator-clear-confirm").click()
            page.wait_for_selector(".carnator-empty")
            assert db_ids(server.cache_dir) == set()
        finally:
            (OUTPUT / f"console-cache-tab-{name}.log").write_text("\n".join(console))
            browser.close()

    assert not carnator_errors(console), carnator_errors(console)
    # the README's pictures: refreshed on request, so a test run leaves the work tree clean
    if name == NEWEST:
        keep_for_readme(OUTPUT / f"04-cache-tab-{name}.png", "cache-tab.png")


def test_every_example_workflow_loads_in_the_page_as_its_api_twin(server):
    """Each UI workflow in workflows/ (Wan 2.2 5B and A14B, HunyuanVideo 1.5 included) loads
    in the real front end with every node known, and the page turns it into exactly the
    API twin scripts/make_workflows.py wrote."""
    from playwright.sync_api import sync_playwright

    ui_files = sorted((REPO / "workflows").glob("*.json"))
    assert {f"carnator_{b}_{kind}.json" for b in ("wan22_5b", "wan22_a14b", "hunyuan_video15")
            for kind in ("4node", "sampler")} <= {f.name for f in ui_files}
    console: list[str] = []
    with sync_playwright() as pw:
        browser, page = open_page(pw, server, False, console)
        try:
            for ui_file in ui_files:
                twin = json.loads((REPO / "workflows" / "api" / f"{ui_file.stem}.api.json").read_text())
                unknown, output = page.evaluate(
                    "async (wf) => { await app.loadGraphData(wf);"
                    " const unknown = app.graph.nodes.filter((n) => !LiteGraph.registered_node_types[n.type]);"
                    " return [unknown.map((n) => n.type), (await app.graphToPrompt()).output]; }",
                    json.loads(ui_file.read_text()))
                assert not unknown, (ui_file.name, unknown)
                assert {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in output.items()} == \
                    {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in twin.items()}, ui_file.name
        finally:
            browser.close()
