// Small inline-SVG plots for the feature pages (no library): a histogram of binned counts
// and a density bar on a log scale. Every bar keeps its exact numbers in data attributes
// and says them in its <title>.

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) node.setAttribute(k, String(v));
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

/** A density (share of tokens) as a percentage. */
export function fmtDensity(d) {
  if (d === null || d === undefined) return "—";
  const pct = 100 * Number(d);
  return pct === 0 ? "0%" : `${pct >= 1 ? pct.toFixed(2) : pct.toPrecision(2)}%`;
}

const short = (v) => (Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 1 ? v.toFixed(2) : v.toPrecision(2));

/**
 * A histogram: `edges` (n+1) and `counts` (n), one bar per bin (`rect.hist-bar`, with
 * data-lo, data-hi and data-count), the x axis labelled at its ends.
 */
export function histogramSVG({ edges = [], counts = [] } = {},
  { label, xLabel = "activation", yLabel = "count", width = 340 } = {}) {
  const W = width;
  const H = 170;
  const L = 40;
  const R = 8;
  const T = 8;
  const B = 34;
  const n = counts.length;
  const top = Math.max(1, ...counts);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img",
    "aria-label": label || `Histogram: ${n} bins from ${edges[0] ?? 0} to ${edges[n] ?? 0}, at most ${top} in a bin` });
  root.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }),
    svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }),
    svg("text", { x: L - 4, y: T + 8, "text-anchor": "end" }, String(top)),
    svg("text", { x: L - 4, y: H - B, "text-anchor": "end" }, "0"),
    svg("text", { x: 12, y: (T + H - B) / 2, "text-anchor": "middle", transform: `rotate(-90 12 ${(T + H - B) / 2})` }, yLabel));
  const step = (W - L - R) / Math.max(1, n);
  counts.forEach((count, i) => {
    const h = ((H - B - T) * count) / top;
    const lo = edges[i];
    const hi = edges[i + 1];
    root.append(svg("rect", {
      class: "hist-bar", x: L + i * step + 0.5, y: H - B - h, width: Math.max(0.5, step - 1), height: h,
      "data-lo": lo, "data-hi": hi, "data-count": count,
    }, svg("title", {}, `${short(Number(lo))} to ${short(Number(hi))}: ${count}`)));
  });
  if (n) {
    root.append(svg("text", { x: L, y: H - B + 14, "text-anchor": "start" }, short(Number(edges[0]))),
      svg("text", { x: W - R, y: H - B + 14, "text-anchor": "end" }, short(Number(edges[n]))));
  }
  root.append(svg("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, xLabel));
  return root;
}

/**
 * The density (share of tokens above 0) as a bar on a log axis from 10⁻⁶ to 1, the
 * decades marked; `rect.density-bar` keeps the value in data-density.
 */
export function densitySVG(density) {
  const W = 340;
  const H = 46;
  const L = 8;
  const R = 8;
  const lo = -6;
  const d = Math.max(0, Number(density) || 0);
  const x = (v) => L + ((W - L - R) * (Math.max(lo, Math.log10(v)) - lo)) / -lo;
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img",
    "aria-label": `Density ${(100 * d).toPrecision(3)}% of tokens, on a log scale from 0.0001% to 100%` });
  root.append(svg("rect", { class: "density-track", x: L, y: 6, width: W - L - R, height: 14, rx: 3 }));
  root.append(svg("rect", { class: "density-bar", x: L, y: 6, width: d > 0 ? Math.max(1, x(d) - L) : 0, height: 14, rx: 3,
    "data-density": String(d) }, svg("title", {}, `density ${d}`)));
  for (let e = lo; e <= 0; e += 1) {
    const at = x(10 ** e);
    root.append(svg("line", { x1: at, x2: at, y1: 20, y2: 25, class: "axis" }),
      svg("text", { x: at, y: 38, "text-anchor": e === lo ? "start" : e === 0 ? "end" : "middle" }, `1e${e}`));
  }
  return root;
}

/**
 * Lines of (x, y) points on linear axes (the experiments page: KL and a feature's
 * activation against strength). `series` is [{name, points: [{x, y}], key, dashed}]; series
 * with the same `key` share a colour (class `series-<key mod 6>`). Every point is a
 * `circle.dot` keeping its series and numbers in data-series, data-x and data-y and saying
 * them in its <title>; each line is a `path.line` with data-series. `hline` {y, label} draws
 * a dashed reference line (a KL budget), `vline` {x, label} a vertical one (the strength
 * found). Points with a null y are left out (a figure the run could not compute).
 */
export function lineSVG(series, { label, xLabel = "strength", yLabel = "", width = 560, height = 240,
  hline = null, vline = null } = {}) {
  const W = width;
  const H = height;
  const L = 56;
  const R = 12;
  const T = 12;
  const B = 38;
  const pts = series.flatMap((s) => s.points.filter((p) => p.y !== null && p.y !== undefined && Number.isFinite(p.y)));
  const xs = [...pts.map((p) => p.x), ...(vline ? [vline.x] : [])];
  const ys = [...pts.map((p) => p.y), ...(hline ? [hline.y] : [])];
  let [x0, x1] = xs.length ? [Math.min(...xs), Math.max(...xs)] : [0, 1];
  let [y0, y1] = ys.length ? [Math.min(0, ...ys), Math.max(...ys)] : [0, 1];
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) y1 = y0 + 1;
  y1 += (y1 - y0) * 0.05;
  const x = (v) => L + ((W - L - R) * (v - x0)) / (x1 - x0);
  const y = (v) => T + (H - T - B) * (1 - (v - y0) / (y1 - y0));
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img",
    "aria-label": label || `${yLabel} against ${xLabel}: ${series.length} line(s)` });
  root.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }),
    svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
  for (let t = 0; t <= 4; t += 1) {
    const v = y0 + ((y1 - y0) * t) / 4;
    root.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid-line" }),
      svg("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end" }, short(v)));
  }
  for (const v of [...new Set(pts.map((p) => p.x))].sort((a, b) => a - b)) {
    root.append(svg("text", { x: x(v), y: H - B + 15, "text-anchor": "middle" }, short(v)));
  }
  root.append(svg("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, xLabel),
    svg("text", { x: 12, y: (T + H - B) / 2, "text-anchor": "middle", transform: `rotate(-90 12 ${(T + H - B) / 2})` }, yLabel));
  if (hline) {
    root.append(svg("line", { x1: L, x2: W - R, y1: y(hline.y), y2: y(hline.y), class: "ref-line", "data-y": hline.y },
      svg("title", {}, `${hline.label || ""} ${hline.y}`)));
  }
  if (vline) {
    root.append(svg("line", { x1: x(vline.x), x2: x(vline.x), y1: T, y2: H - B, class: "ref-line", "data-x": vline.x },
      svg("title", {}, `${vline.label || ""} ${vline.x}`)));
  }
  series.forEach((s, i) => {
    const key = `series-${(s.key ?? i) % 6}`;
    const shown = s.points.filter((p) => p.y !== null && p.y !== undefined && Number.isFinite(p.y))
      .sort((a, b) => a.x - b.x);
    if (shown.length > 1) {
      root.append(svg("path", { class: `line ${key}${s.dashed ? " dashed" : ""}`, "data-series": s.name,
        d: shown.map((p, k) => `${k ? "L" : "M"}${x(p.x).toFixed(1)},${y(p.y).toFixed(1)}`).join(" ") }));
    }
    for (const p of shown) {
      root.append(svg("circle", { class: `dot ${key}${s.dashed ? " hollow" : ""}`, cx: x(p.x), cy: y(p.y), r: 3.5,
        "data-series": s.name, "data-x": String(p.x), "data-y": String(p.y) },
      svg("title", {}, `${s.name}, ${xLabel} ${short(p.x)}: ${p.y}`)));
    }
  });
  return root;
}
