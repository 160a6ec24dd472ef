// Carnator's front end: what a request did, shown on the node, and the cache sidebar tab.
//
// On the node (Carnator Reuse Sampler, Carnator Sampler) after a run:
//   HIT k*=8/12 · saved 12.4 s · risk 7.6%     |   MISS · stored   |   EXACT
// with the matched (or newly stored) entry's preview picture under it. While a request runs,
// each Carnator node shows the phase it is in (probe, lookup, gate, reuse) as a badge in its
// title bar, and the sampler node that will report the result says where the request is.
//
// The status lives in a DOM widget, so it is drawn with the node and readable from the page
// (data-carnator-node / data-carnator-outcome / data-carnator-phase attributes). The widget is
// added when the node joins the graph, not at its first result: the "Nodes 2.0" (Vue) node view
// of front end 1.32 builds a node's widget list once and never shows a widget added later.
// The title-bar badge is drawn on the canvas in the classic view (it stays visible when the
// graph is zoomed out); Vue nodes are DOM, not canvas, so there the same badge is a DOM element
// in the node's header (data-carnator-badge).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { registerCacheTab } from "./cache_tab.js";

const STATUS_NODES = new Set(["CarnatorReuseSampler", "CarnatorSampler"]);
const STATUS_WIDGET = "carnator_status";
const PHASE_TEXT = {
  probe: "probe · computing the first steps",
  lookup: "lookup · searching the cache",
  gate: "gate · checking compatibility",
  reuse: "reuse · resuming from the stored trajectory",
  sample: "sample · computing the remaining steps",
};
const OUTCOME_COLOR = { hit: "#2e9e5b", miss: "#b7791f", exact: "#3a7bd5", running: "#6b7280", stopped: "#b83232",
                        idle: "#4b5563" };
const IDLE_TEXT = "Carnator · queue the prompt: MISS, HIT or EXACT shows here";

function loadStylesheet() {
  const href = new URL("./carnator.css", import.meta.url).href;
  if (document.querySelector(`link[href="${href}"]`)) return;
  const link = document.createElement("link");
  link.rel = "stylesheet";
  link.href = href;
  document.head.appendChild(link);
}

// ------------------------------------------------------------------ formatting
export function formatSeconds(s) {
  if (s == null || !Number.isFinite(s)) return "?";
  return s >= 100 ? `${Math.round(s)} s` : `${s.toFixed(1)} s`;
}

function percent(x) {
  return x == null || !Number.isFinite(x) ? "?" : `${(x * 100).toFixed(1)}%`;
}

/** The one-line status for a result summary (see carnator_core.pipeline.Summary). */
export function headline(summary) {
  switch (summary.outcome) {
    case "hit":
      return `HIT k*=${summary.reuse_step}/${summary.steps_total} · saved ${formatSeconds(summary.saved_seconds)} · risk ${percent(summary.risk)}`;
    case "exact":
      return "EXACT · repeat of a stored request";
    case "miss":
      return summary.stored_id ? "MISS · stored" : "MISS · not stored";
    default:
      return String(summary.outcome ?? "?").toUpperCase();
  }
}

function detailLine(summary) {
  const parts = [`computed ${summary.steps_computed}/${summary.steps_total} steps`, formatSeconds(summary.seconds)];
  if (summary.outcome === "hit" && summary.region_fraction != null) {
    parts.push(`${Math.round(summary.region_fraction * 100)}% region recomputed`);
  }
  return parts.join(" · ");
}

function shortId(id) {
  return id ? String(id).slice(0, 8) : "";
}

export function previewUrl(entryId) {
  return api.apiURL(`/carnator/entries/${encodeURIComponent(entryId)}/preview.png`);
}

// ------------------------------------------------------------------ graph helpers
function nodeById(id) {
  if (id == null) return null;
  const graph = app.graph;
  return graph?.getNodeById(id) ?? graph?.getNodeById(Number(id)) ?? null;
}

/** The nodes an output slot feeds. node.getOutputNodes() where the front end has it (1.58
 * reports output.links as deprecated); the graph's link table otherwise. */
function outputNodes(node, slot) {
  if (typeof node.getOutputNodes === "function") return node.getOutputNodes(slot) ?? [];
  const graph = node.graph ?? app.graph;
  const links = graph?.links;
  if (!links) return [];
  const all = typeof links.values === "function" ? [...links.values()] : Object.values(links);
  return all.filter((l) => l && l.origin_id === node.id && l.origin_slot === slot)
    .map((l) => nodeById(l.target_id));
}

/** The status nodes a phase message concerns: the node itself or those it feeds. */
function statusNodesFrom(node) {
  const found = [];
  const seen = new Set();
  const queue = [node];
  while (queue.length && seen.size < 64) {
    const n = queue.shift();
    if (!n || seen.has(n.id)) continue;
    seen.add(n.id);
    if (STATUS_NODES.has(n.comfyClass ?? n.type)) found.push(n);
    (n.outputs ?? []).forEach((_, slot) => queue.push(...outputNodes(n, slot)));
  }
  return found;
}

function redraw() {
  app.graph?.setDirtyCanvas(true, true);
  syncHeaderBadges();
}

// ------------------------------------------------------------------ the status widget
// Up to two pictures under the status: the request's own video ("this request", region M
// outlined on a hit) and the entry it reused. Each is a frame strip served by the pack.
function picture(role) {
  const figure = document.createElement("figure");
  figure.className = `carnator-status-picture carnator-${role}`;
  figure.hidden = true;
  const img = document.createElement("img");
  img.alt = "";
  img.dataset.role = role;
  const caption = document.createElement("figcaption");
  figure.append(img, caption);
  return { figure, img, caption };
}

function statusWidget(node) {
  let widget = node.widgets?.find((w) => w.name === STATUS_WIDGET);
  if (widget) return widget;
  const root = document.createElement("div");
  root.className = "carnator-status";
  root.dataset.carnatorNode = String(node.id);
  const head = document.createElement("div");
  head.className = "carnator-status-head";
  const detail = document.createElement("div");
  detail.className = "carnator-status-detail";
  const figure = document.createElement("div");
  figure.className = "carnator-status-preview";
  figure.hidden = true;
  const pictures = { request: picture("request"), source: picture("source") };
  figure.append(pictures.request.figure, pictures.source.figure);
  root.append(head, detail, figure);
  const shown = () => Object.values(pictures).filter((p) => !p.figure.hidden).length;

  widget = node.addDOMWidget(STATUS_WIDGET, "carnator-status", root, {
    serialize: false, // never part of the saved workflow or of the prompt sent to the server
    hideOnZoom: false,
    getValue: () => root.dataset.carnatorText ?? "",
    setValue: () => {},
    getMinHeight: () => 64 + 95 * shown(),
    getMaxHeight: () => 90 + 130 * shown(),
  });
  widget.serialize = false;
  widget.carnator = { root, head, detail, figure, pictures, shown };
  // grow downwards only: a wider node would overlap its neighbours in a laid-out workflow
  node.setSize([Math.max(node.size[0], 240), Math.max(node.size[1], node.computeSize()[1])]);
  return widget;
}

function setPicture(p, entryId, caption, withRegion = false) {
  if (!entryId) {
    p.figure.hidden = true;
    p.img.removeAttribute("src");
    delete p.img.dataset.entryId;
    return;
  }
  p.img.src = previewUrl(entryId) + (withRegion ? "?region=1" : "");
  p.img.alt = caption;
  p.img.dataset.entryId = entryId;
  p.caption.textContent = caption;
  p.figure.hidden = false;
}

/** pictures: {request: [entryId, caption, withRegion], source: [entryId, caption]} or null
 * (keep what is shown: a running request dims the previous result's pictures). */
function showStatus(node, { outcome, text, detail = "", pictures = null, phase = "" }) {
  const w = statusWidget(node).carnator;
  w.root.dataset.carnatorOutcome = outcome;
  w.root.dataset.carnatorPhase = phase;
  w.root.dataset.carnatorText = text;
  w.root.style.setProperty("--carnator-accent", OUTCOME_COLOR[outcome] ?? OUTCOME_COLOR.running);
  w.head.textContent = text;
  w.detail.textContent = detail;
  w.detail.title = detail;
  const before = w.shown();
  if (pictures || outcome !== "running") {
    setPicture(w.pictures.request, ...(pictures?.request ?? []));
    setPicture(w.pictures.source, ...(pictures?.source ?? []));
  }
  w.figure.hidden = w.shown() === 0;
  node.carnatorBadge = outcome === "idle" ? null
    : { text: outcome === "running" ? phase : outcome.toUpperCase(), outcome };
  if (before !== w.shown()) {
    node.setSize([node.size[0], Math.max(node.size[1], node.computeSize()[1])]);
  }
  redraw();
}

function showIdle(node) {
  showStatus(node, { outcome: "idle", text: IDLE_TEXT });
}

function showResult(node, summary) {
  const matched = summary.outcome === "miss" ? null : summary.entry_id;
  const own = summary.stored_id ?? null;
  let pictures;
  if (summary.outcome === "hit") {
    const region = summary.region_fraction ? ` · region M outlined (${Math.round(summary.region_fraction * 100)}% recomputed)` : " · nothing recomputed (M empty)";
    pictures = {
      request: [own, own ? `this request (entry ${shortId(own)})${region}` : "", true],
      source: [matched, `reused entry ${shortId(matched)}: resumed from its step ${summary.reuse_step}`],
    };
  } else if (summary.outcome === "exact") {
    pictures = { source: [matched, `the stored result (entry ${shortId(matched)}), returned as it is`] };
  } else {
    pictures = { request: [own, own ? `this request, stored as entry ${shortId(own)}` : ""] };
  }
  const extra = [detailLine(summary), summary.reason, ...(summary.messages ?? [])].filter(Boolean);
  showStatus(node, {
    outcome: summary.outcome,
    text: headline(summary),
    detail: extra.join(" · "),
    pictures,
  });
  node.carnatorResult = summary;
  node.carnatorPhase = null;
}

let phaseNode = null; // the pipeline node whose title shows the current phase

function showPhase(node, phase) {
  if (phaseNode && phaseNode !== node && phaseNode.carnatorBadge?.outcome === "running") {
    phaseNode.carnatorBadge = null;
  }
  phaseNode = node;
  node.carnatorPhase = phase;
  if (!STATUS_NODES.has(node.comfyClass ?? node.type)) {
    node.carnatorBadge = { text: phase, outcome: "running" };
  }
  for (const target of statusNodesFrom(node)) {
    target.carnatorPhase = phase;
    showStatus(target, { outcome: "running", text: `running · ${PHASE_TEXT[phase] ?? phase}`, phase });
  }
  redraw();
}

function clearPhases(stopped) {
  phaseNode = null;
  for (const node of app.graph?.nodes ?? []) {
    if (!node.carnatorPhase && node.carnatorBadge?.outcome !== "running") continue;
    node.carnatorPhase = null;
    if (STATUS_NODES.has(node.comfyClass ?? node.type) && node.carnatorBadge?.outcome === "running") {
      showStatus(node, { outcome: stopped ? "stopped" : "running", text: stopped ? "stopped before a result" : "finished", phase: "" });
    } else if (node.carnatorBadge?.outcome === "running") {
      node.carnatorBadge = null;
    }
  }
  redraw();
}

// ------------------------------------------------------------------ canvas badge
function drawBadge(node, ctx) {
  const badge = node.carnatorBadge;
  if (!badge || node.flags?.collapsed) return;
  const titleHeight = globalThis.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
  ctx.save();
  ctx.font = "bold 11px sans-serif";
  const text = badge.text;
  const padX = 6;
  const w = ctx.measureText(text).width + padX * 2;
  const h = 16;
  const x = node.size[0] - w - 8;
  const y = -titleHeight + (titleHeight - h) / 2;
  ctx.fillStyle = OUTCOME_COLOR[badge.outcome] ?? OUTCOME_COLOR.running;
  ctx.beginPath();
  if (ctx.roundRect) ctx.roundRect(x, y, w, h, 4);
  else ctx.rect(x, y, w, h);
  ctx.fill();
  ctx.fillStyle = "#fff";
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  ctx.fillText(text, x + padX, y + h / 2 + 0.5);
  ctx.restore();
}

// ------------------------------------------------------------------ header badge (Vue nodes)
/** The badge as a DOM element in a Vue node's header; nothing in the classic view (no header
 * element there: the canvas badge above is drawn instead). */
function syncHeaderBadge(node) {
  const header = document.querySelector(`[data-testid="node-header-${node.id}"]`);
  if (!header) return;
  let el = header.querySelector(".carnator-badge");
  const badge = node.carnatorBadge;
  if (!badge) {
    el?.remove();
    return;
  }
  if (!el) {
    el = document.createElement("span");
    el.className = "carnator-badge";
    const title = header.querySelector('[data-testid="node-title"]');
    if (title?.parentElement) title.after(el);
    else header.append(el);
  }
  if (el.textContent !== badge.text) el.textContent = badge.text;
  el.dataset.carnatorBadge = badge.outcome;
  el.dataset.carnatorBadgeNode = String(node.id);
  el.style.background = OUTCOME_COLOR[badge.outcome] ?? OUTCOME_COLOR.running;
}

/** Vue re-renders a header now and then (title edits, collapse, a workflow reloaded) and
 * drops foreign elements with it: put the badges back. */
function syncHeaderBadges() {
  for (const node of app.graph?.nodes ?? []) {
    if (node.carnatorBadge || node.carnatorHadBadge) {
      node.carnatorHadBadge = !!node.carnatorBadge;
      syncHeaderBadge(node);
    }
  }
}

// ------------------------------------------------------------------ registration
app.registerExtension({
  name: "carnator.frontend",

  async setup() {
    loadStylesheet();
    api.addEventListener("carnator.phase", ({ detail }) => {
      const node = nodeById(detail?.node);
      if (node && detail.phase) showPhase(node, String(detail.phase));
    });
    api.addEventListener("carnator.result", ({ detail }) => {
      const node = nodeById(detail?.node);
      if (node && STATUS_NODES.has(node.comfyClass ?? node.type)) showResult(node, detail);
    });
    api.addEventListener("execution_start", () => clearPhases(false));
    api.addEventListener("execution_success", () => clearPhases(false));
    api.addEventListener("execution_error", () => clearPhases(true));
    api.addEventListener("execution_interrupted", () => clearPhases(true));
    registerCacheTab(app, api);
    setInterval(syncHeaderBadges, 500);
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!String(nodeData?.name ?? "").startsWith("Carnator")) return;
    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx, ...rest) {
      const r = onDrawForeground?.call(this, ctx, ...rest);
      drawBadge(this, ctx);
      return r;
    };
    if (!STATUS_NODES.has(nodeData.name)) return;
    // when the node joins a graph: earlier (onNodeCreated) the classic view never mounts a DOM
    // widget; later (the first result) the Vue view of 1.32 never shows it
    const onAdded = nodeType.prototype.onAdded;
    nodeType.prototype.onAdded = function (...args) {
      const r = onAdded?.apply(this, args);
      if (!this.widgets?.some((w) => w.name === STATUS_WIDGET)) showIdle(this);
      return r;
    };
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message, ...rest) {
      const r = onExecuted?.call(this, message, ...rest);
      const summary = message?.carnator?.[0];
      if (summary) showResult(this, summary);
      return r;
    };
  },
});
