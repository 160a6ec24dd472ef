// The "Carnator cache" sidebar tab: what the cache holds, with pictures, and the actions a
// person needs (pin, delete, clear all after a confirmation). Talks to nodes/routes.py.
//
// Built with plain DOM calls; prompts are user text, so they only ever go into textContent.

const PAGE_SIZE = 50;
const TAB_ID = "carnator-cache";

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (v == null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k in node && typeof v !== "string") node[k] = v;
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c != null) node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

export function formatBytes(n) {
  if (n == null || !Number.isFinite(n)) return "?";
  // binary units, as the capacity is set (Carnator Cache node: capacity_gb × 1024³ bytes)
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v >= 100 || i === 0 ? Math.round(v) : v.toFixed(1)} ${units[i]}`;
}

export function formatAge(epochSeconds, now = Date.now() / 1000) {
  const s = Math.max(0, now - epochSeconds);
  if (s < 60) return "just now";
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return `${Math.floor(s / 86400)} d ago`;
}

class CachePanel {
  constructor(app, api) {
    this.app = app;
    this.api = api;
    this.root = null;
    this.entries = [];
    this.total = 0;
    this.stats = null;
    this.calibration = [];
    this.confirmingClear = false;
    this.loading = false;
    this.error = "";
  }

  // -------------------------------------------------------------- server calls
  async call(path, options = {}) {
    const init = { ...options };
    // the server takes pin, delete and clear only as JSON (its guard against other pages)
    if (init.method && init.method !== "GET") init.headers = { "Content-Type": "application/json" };
    if (init.body !== undefined) init.body = JSON.stringify(init.body);
    const resp = await this.api.fetchApi(path, init);
    let data = null;
    try {
      data = await resp.json();
    } catch {
      data = null;
    }
    if (!resp.ok) throw new Error(data?.error ?? `${resp.status} ${resp.statusText}`);
    return data;
  }

  toast(severity, summary, detail) {
    const toast = this.app.extensionManager?.toast;
    if (toast?.add) toast.add({ severity, summary, detail, life: severity === "error" ? 6000 : 2500 });
    else if (severity === "error") console.error(`Carnator: ${summary}: ${detail}`);
  }

  async refresh() {
    if (!this.root) return;
    this.loading = true;
    this.render();
    try {
      const count = Math.min(Math.max(this.entries.length, PAGE_SIZE), 200);
      const [page, stats, calibration] = await Promise.all([
        this.call(`/carnator/entries?offset=0&limit=${count}`),
        this.call("/carnator/stats"),
        this.call("/carnator/calibration"),
      ]);
      this.entries = page.entries;
      this.total = page.total;
      this.stats = stats;
      this.calibration = calibration.models ?? [];
      this.error = "";
    } catch (e) {
      this.error = `Could not read the cache: ${e.message}`;
    } finally {
      this.loading = false;
      this.render();
    }
  }

  async loadMore() {
    try {
      const page = await this.call(`/carnator/entries?offset=${this.entries.length}&limit=${PAGE_SIZE}`);
      const known = new Set(this.entries.map((e) => e.id));
      this.entries.push(...page.entries.filter((e) => !known.has(e.id)));
      this.total = page.total;
    } catch (e) {
      this.toast("error", "Carnator cache", e.message);
    }
    this.render();
  }

  async setPinned(entry, pinned) {
    try {
      await this.call(`/carnator/entries/${entry.id}/pin`, { method: "POST", body: { pinned } });
      entry.pinned = pinned;
    } catch (e) {
      this.toast("error", "Could not pin the entry", e.message);
      await this.refresh();
      return;
    }
    this.render();
  }

  async remove(entry) {
    try {
      await this.call(`/carnator/entries/${entry.id}`, { method: "DELETE" });
      this.toast("success", "Carnator cache", `Deleted entry ${entry.id.slice(0, 8)}`);
    } catch (e) {
      this.toast("error", "Could not delete the entry", e.message);
    }
    this.entries = this.entries.filter((e) => e.id !== entry.id);
    await this.refresh();
  }

  async clearAll() {
    this.confirmingClear = false;
    try {
      const answer = await this.call("/carnator/clear", { method: "POST", body: { confirm: true } });
      this.toast("success", "Carnator cache", `Deleted ${answer.deleted} entries`);
    } catch (e) {
      this.toast("error", "Could not clear the cache", e.message);
    }
    this.entries = [];
    await this.refresh();
  }

  // -------------------------------------------------------------- rendering
  mount(container) {
    this.root = el("div", { class: "carnator-cache-panel", dataset: { carnatorPanel: "cache" } });
    container.replaceChildren(this.root);
    this.render();
    this.refresh();
  }

  unmount() {
    this.root?.remove();
    this.root = null;
    this.confirmingClear = false;
  }

  render() {
    if (!this.root) return;
    const scroll = this.root.querySelector(".carnator-entries")?.scrollTop ?? 0;
    this.root.replaceChildren(this.header(), this.totals(), this.gates(), this.clearBar(), this.list());
    const list = this.root.querySelector(".carnator-entries");
    if (list) list.scrollTop = scroll;
  }

  // Per model: is α a promise here (calibrated), and what live audits measured against it.
  gates() {
    const rows = this.calibration.map((m) => {
      const tol = m.tolerance;
      // a calibration holds for the probe_fraction it was measured with (the row: the samplers' default)
      const others = (m.other_probes ?? []).length ? ` · also for probe_fraction ${m.other_probes.join(", ")}` : "";
      // a calibration measured at one N is the one the gate uses at that N (and probe)
      const atN = (m.calibrated_steps ?? []).map((c) => `${c.steps} steps` +
        (c.probe_fraction === m.probe_fraction ? "" : ` (probe_fraction ${c.probe_fraction})`));
      const ownN = atN.length ? ` · own calibration at ${atN.join(", ")}, used at that N` : "";
      const what = m.problem ? `uncalibrated prior (α is not a promise): ${m.problem}`
        : m.calibrated ? `calibrated: ${m.measured_reuses.toLocaleString()} reuses measured` +
          // α is certified at the steps it was measured with; other N borrow it by depth share
          (m.measured_steps ? ` at ${m.measured_steps} steps` : "") +
          // the latent sizes measured: a request of another size is not certified (its summary says so)
          ((m.measured_latents ?? []).length ? `, latent ${m.measured_latents.map((t) => t.join("×")).join(", ")}` : "") +
          (tol ? `, PSNR on ${tol.space} ≥ ${tol.psnr_bound} dB` : "") + others
          : others ? `uncalibrated at probe_fraction ${m.probe_fraction}; calibrated for probe_fraction ${m.other_probes.join(", ")}`
          : "uncalibrated prior: α is a relative knob (run Carnator Calibrate)";
      const audits = Object.entries(m.audits ?? {}).map(([key, a]) => {
        const all = a.all;
        // what the online certificate changed at this α (extended, or stepped back on an alarm)
        const online = m.online?.[key]?.text;
        const levels = Object.entries(a.classes).filter(([, c]) => c.level > 0)
          .map(([k, c]) => `${k.replace("_", "-")} tightened ×${c.level}`);
        const pct = (x) => `${(100 * x).toFixed(1)}%`;
        return el("div", { class: "carnator-audit" + (all.rate > a.alpha ? " carnator-audit-over" : "") },
          `α ${pct(a.alpha)}: ${all.failures} of ${all.audits} audits beyond tolerance` +
          (all.audits ? ` (${pct(all.rate)}, 90% interval ${pct(all.lower)}–${pct(all.upper)})` : "") +
          (levels.length ? ` · ${levels.join(", ")}` : "") + (online ? ` · ${online}` : ""));
      }).concat(Object.entries(m.online ?? {})  // an α audited by exploring only
        .filter(([key, o]) => o.text && !(key in (m.audits ?? {})))
        .map(([, o]) => el("div", { class: "carnator-audit" }, `α ${(100 * o.alpha).toFixed(1)}%: ${o.text}`)));
      return el("div", { class: "carnator-gate", dataset: { fingerprint: m.fingerprint } },
        // named as people loaded it (a Wan 2.2 pair: both files); the fingerprint on hover
        el("div", { class: "carnator-gate-model",
                    title: `fingerprint ${m.fingerprint}` + (m.example ? ` · e.g. “${m.example}”` : "") },
          (m.names ?? []).length ? m.names.join(" + ") : `model ${m.fingerprint.slice(0, 8)}`),
        el("div", { class: m.calibrated ? "carnator-gate-calibrated" : "carnator-gate-prior" }, what + ownN),
        audits.length ? audits : el("div", { class: "carnator-audit" }, "no live audits yet (audit_rate on the sampler)"));
    });
    return el("div", { class: "carnator-gates" }, rows.length ? [el("h4", {}, "Gate calibration"), ...rows] : []);
  }

  header() {
    return el("div", { class: "carnator-cache-header" },
      el("h3", {}, "Carnator cache"),
      el("button", {
        class: "carnator-button carnator-refresh", title: "Reload the list", "aria-label": "Refresh",
        disabled: this.loading, onclick: () => this.refresh(),
      }, el("i", { class: this.loading ? "pi pi-spin pi-spinner" : "pi pi-refresh" })));
  }

  totals() {
    const s = this.stats;
    if (!s) return el("div", { class: "carnator-totals" }, this.error || "Loading…");
    const share = s.capacity_bytes ? Math.min(1, s.bytes / s.capacity_bytes) : 0;
    const rate = s.recent_hit_rate == null
      ? "no requests yet"
      : `hit rate ${Math.round(s.recent_hit_rate * 100)}% of the last ${s.recent_requests} request${s.recent_requests === 1 ? "" : "s"}`;
    return el("div", { class: "carnator-totals", dataset: { entries: String(s.entries) } },
      el("div", { class: "carnator-totals-line" },
        el("strong", {}, `${s.entries} entr${s.entries === 1 ? "y" : "ies"}`),
        ` · ${formatBytes(s.bytes)} of ${formatBytes(s.capacity_bytes)}`),
      el("div", { class: "carnator-capacity", title: `${(share * 100).toFixed(1)}% of the capacity used` },
        el("div", { class: "carnator-capacity-used", style: `width:${(share * 100).toFixed(1)}%` })),
      el("div", { class: "carnator-totals-line carnator-muted" }, rate),
      this.error ? el("div", { class: "carnator-error" }, this.error) : null);
  }

  clearBar() {
    if (!this.entries.length) return el("div", { class: "carnator-clear-bar" });
    if (!this.confirmingClear) {
      return el("div", { class: "carnator-clear-bar" },
        el("button", { class: "carnator-button carnator-clear", onclick: () => { this.confirmingClear = true; this.render(); } },
          el("i", { class: "pi pi-trash" }), " Clear all…"));
    }
    const pinned = this.entries.filter((e) => e.pinned).length;
    const n = this.total;
    return el("div", { class: "carnator-clear-bar carnator-confirm", role: "alertdialog" },
      el("span", {}, `Delete all ${n} entr${n === 1 ? "y" : "ies"}${pinned ? `, ${pinned} pinned included` : ""}? This cannot be undone.`),
      el("button", { class: "carnator-button carnator-danger carnator-clear-confirm", onclick: () => this.clearAll() }, "Delete all"),
      el("button", { class: "carnator-button carnator-clear-cancel", onclick: () => { this.confirmingClear = false; this.render(); } }, "Cancel"));
  }

  list() {
    if (!this.entries.length) {
      return el("div", { class: "carnator-entries carnator-empty" },
        this.stats ? "The cache is empty. Queue a workflow with Carnator nodes to fill it." : "");
    }
    const items = this.entries.map((e) => this.card(e));
    const more = this.entries.length < this.total
      ? el("button", { class: "carnator-button carnator-more", onclick: () => this.loadMore() },
        `Show more (${this.total - this.entries.length} left)`)
      : null;
    return el("div", { class: "carnator-entries" }, el("ul", {}, items), more);
  }

  card(entry) {
    const model = entry.backbone || entry.latent_format || "?";
    const prompt = entry.prompt || "(no prompt label)";
    return el("li", { class: "carnator-entry", dataset: { entryId: entry.id, pinned: entry.pinned ? "true" : "false" } },
      el("img", {
        class: "carnator-entry-preview", src: this.api.apiURL(entry.preview_url),
        alt: `Preview of cache entry ${entry.id.slice(0, 8)}`, decoding: "async",
      }),
      el("div", { class: "carnator-entry-body" },
        el("div", { class: "carnator-entry-prompt", title: prompt }, prompt),
        el("div", { class: "carnator-entry-meta" },
          `${model} · ${entry.latent_shape ?? "?"} · ${entry.steps} steps · seed ${entry.seed}`),
        el("div", { class: "carnator-entry-meta" },
          `${entry.hits} hit${entry.hits === 1 ? "" : "s"} · ${formatBytes(entry.bytes)} · ${formatAge(entry.created)}`,
          entry.pinned ? el("span", { class: "carnator-pinned-tag" }, " · pinned") : null),
        el("div", { class: "carnator-entry-actions" },
          el("button", {
            class: `carnator-button carnator-pin${entry.pinned ? " carnator-active" : ""}`,
            "aria-pressed": entry.pinned ? "true" : "false",
            title: entry.pinned ? "Unpin: let eviction remove it when space is needed" : "Pin: never evicted",
            onclick: () => this.setPinned(entry, !entry.pinned),
          }, el("i", { class: "pi pi-thumbtack" }), entry.pinned ? " Pinned" : " Pin"),
          el("button", {
            class: "carnator-button carnator-delete", title: "Delete this entry",
            onclick: () => this.remove(entry),
          }, el("i", { class: "pi pi-trash" }), " Delete"))));
  }
}

export function registerCacheTab(app, api) {
  const manager = app.extensionManager;
  if (!manager?.registerSidebarTab) {
    console.warn("Carnator: this ComfyUI front end has no sidebar tabs; the cache tab is not shown");
    return null;
  }
  const panel = new CachePanel(app, api);
  manager.registerSidebarTab({
    id: TAB_ID,
    icon: "pi pi-database",
    title: "Carnator cache",
    tooltip: "Carnator cache",
    label: "Carnator",
    type: "custom",
    render: (container) => panel.mount(container),
    destroy: () => panel.unmount(),
  });
  // a finished request may have stored or used an entry: keep an open tab current
  api.addEventListener("carnator.result", () => panel.refresh());
  return panel;
}
