// Draws the step timelines of timeline_html.py from the JSON in <script id="timeline-data">: per plan, one row per
// stream and the per-rank memory curve under it, all plans on one time axis. Scroll zooms around the pointer, drag
// pans, double-click resets; hovering a bar names its group and times. No network access, no library.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("timeline-data").textContent);
  const root = document.getElementById("timeline");
  const tip = document.getElementById("tip");
  const SVG = "http://www.w3.org/2000/svg";
  const LEFT = 120, RIGHT = 24, LANE = 26, MEMORY = 150, TITLE = 30, GAP = 18, AXIS = 34;
  const MIN_EXPOSED_PX = 1.5;
  let view = [0, data.end];

  function el(tag, attrs, parent) {
    const e = document.createElementNS(SVG, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }

  function three(x) {
    return Math.abs(x) < 999.5 ? Number(x.toPrecision(3)).toString() : x.toFixed(0);
  }

  function fmtTime(s) {
    if (typeof s !== "number" || !isFinite(s)) return "n/a";  // null: a figure that was not finite (NaN)
    if (s >= 0.9995) return three(s) + " s";
    if (s >= 0.9995e-3) return three(s * 1e3) + " ms";
    return three(s * 1e6) + " us";
  }

  function fmtBytes(n) {
    if (typeof n !== "number" || !isFinite(n)) return "n/a";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    if (Math.abs(n) < 1024) return n.toFixed(0) + " B";
    let i = 0;
    while (i < units.length - 1 && Math.abs(n) >= 999.5) { n /= 1024; i++; }
    return three(n) + " " + units[i];
  }

  function niceStep(span, count) {
    const raw = span / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * mag >= raw) return m * mag;
    return 10 * mag;
  }

  function unitFor(seconds) {
    if (seconds >= 1) return ["s", 1];
    if (seconds >= 1e-3) return ["ms", 1e3];
    return ["us", 1e6];
  }

  function memoryPath(mem, x, y, width) {
    // the curve's maximum per pixel column within the visible range, so zooming out never hides the peak
    const t = mem.t, b = mem.b, cols = new Map();
    let lo = 0, hi = t.length - 1;
    while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (t[mid] <= view[0]) lo = mid; else hi = mid - 1; }
    for (let i = lo; i < t.length - 1 && t[i] <= view[1]; i++) {
      const px = Math.max(0, Math.min(width, Math.round(x(Math.max(t[i], view[0])) - LEFT)));
      cols.set(px, Math.max(cols.get(px) ?? -Infinity, b[i]));
    }
    const px = [...cols.keys()].sort((a, c) => a - c);
    let d = "", last = null;
    for (const p of px) {
      const yy = y(cols.get(p));
      d += last === null ? `M${LEFT + p},${yy}` : `H${LEFT + p}V${yy}`;
      last = yy;
    }
    const endPx = Math.min(width, x(Math.min(t[t.length - 1], view[1])) - LEFT);
    return d + `H${LEFT + endPx}`;
  }

  function draw() {
    root.textContent = "";
    const width = Math.max(600, root.clientWidth || 1400);
    const plot = width - LEFT - RIGHT;
    const x = (s) => LEFT + (s - view[0]) / (view[1] - view[0]) * plot;
    let height = AXIS;
    for (const v of data.views) height += TITLE + v.lanes.length * LANE + MEMORY + GAP;
    const svg = el("svg", {width: width, height: height, "font-family": "sans-serif", "font-size": 12}, root);
    const clipId = "plot-area";
    el("rect", {x: LEFT, y: 0, width: plot, height: height}, el("clipPath", {id: clipId}, el("defs", {}, svg)));
    let top = 0, bars = 0;
    data.views.forEach((v, vi) => {
      el("text", {x: 4, y: top + 19, "font-weight": "bold", "font-size": 13}, svg).textContent = v.summary;
      top += TITLE;
      v.lanes.forEach((lane, li) => {
        const y0 = top + li * LANE;
        el("rect", {x: LEFT, y: y0, width: plot, height: LANE, fill: li % 2 ? "#fafafa" : "#f2f2f2"}, svg);
        el("text", {x: LEFT - 8, y: y0 + LANE / 2 + 4, "text-anchor": "end"}, svg).textContent = lane.name;
        const g = el("g", {"clip-path": `url(#${clipId})`, class: "lane", "shape-rendering": "crispEdges"}, svg);
        lane.bars.forEach((b, bi) => {
          const [s, e, kind] = b;
          if (e < view[0] || s > view[1]) return;
          let w = x(e) - x(s);
          if (data.kinds[kind].key === "exposed") w = Math.max(w, MIN_EXPOSED_PX);
          if (w < 0.05) return;
          el("rect", {x: x(s), y: y0 + 3, width: w, height: LANE - 6, fill: data.kinds[kind].color,
                      stroke: w >= 4 && li > 0 ? "#ffffff" : "none", "stroke-width": 0.6,
                      class: "bar", "data-v": vi, "data-l": li, "data-b": bi}, g);
          if (li > 0 && w >= 60) {  // a collective wide enough carries its group's name
            const name = v.names[b[3]], chars = Math.floor(w / 6.5);
            el("text", {x: x(s) + w / 2, y: y0 + LANE / 2 + 4, "text-anchor": "middle", fill: "#ffffff",
                        "font-size": 11, "pointer-events": "none"}, g).textContent =
              name.length <= chars ? name : name.slice(0, Math.max(1, chars - 1)) + "…";
          }
          bars++;
        });
      });
      top += v.lanes.length * LANE;
      drawMemory(svg, v, top + 6, MEMORY - 12, plot, x, clipId);
      top += MEMORY + GAP;
    });
    drawAxis(svg, top, plot, x);
    svg.setAttribute("data-bars", bars);
    document.body.setAttribute("data-rendered", "1");
  }

  function drawMemory(svg, v, y0, h, plot, x, clipId) {
    const top = Math.max(v.peak, v.reserved);
    const showCapacity = v.capacity <= 8 * top;
    const ymax = (showCapacity ? Math.max(top, v.capacity) : top) * 1.15;
    const y = (bytes) => y0 + h - bytes / ymax * h;
    el("rect", {x: LEFT, y: y0, width: plot, height: h, fill: "#ffffff", stroke: "#dddddd"}, svg);
    const [unit, div] = ymax >= 2 ** 30 ? ["GiB", 2 ** 30] : ymax >= 2 ** 20 ? ["MiB", 2 ** 20] : ["KiB", 1024];
    const step = niceStep(ymax / div, 4);
    for (let t = 0; t * div <= ymax; t += step) {
      el("line", {x1: LEFT, x2: LEFT + plot, y1: y(t * div), y2: y(t * div), stroke: "#eeeeee"}, svg);
      el("text", {x: LEFT - 8, y: y(t * div) + 4, "text-anchor": "end", fill: "#555"}, svg).textContent =
        `${three(t)} ${unit}`;
    }
    const g = el("g", {"clip-path": `url(#${clipId})`}, svg);
    const d = memoryPath(v.memory, x, y, plot);
    el("path", {d: d + `V${y(0)}H${x(Math.max(v.memory.t[0], view[0]))}Z`, fill: "#4c78a8", "fill-opacity": 0.22,
                stroke: "none"}, g);
    el("path", {d: d, fill: "none", stroke: "#4c78a8", "stroke-width": 1.3, class: "memory"}, g);
    el("line", {x1: LEFT, x2: LEFT + plot, y1: y(v.reserved), y2: y(v.reserved), stroke: "#7f7f7f",
                "stroke-dasharray": "2,3"}, svg);
    el("text", {x: LEFT + plot - 4, y: y(v.reserved) + 13, "text-anchor": "end", fill: "#7f7f7f"}, svg).textContent =
      `reserved at peak ${fmtBytes(v.reserved)}`;
    const cap = showCapacity ? `${v.gpu}: ${fmtBytes(v.capacity)}` :
      `${v.gpu} capacity ${fmtBytes(v.capacity)}: far above this scale`;
    const capY = showCapacity ? y(v.capacity) - 4 : y0 + 14;
    if (showCapacity) {
      el("line", {x1: LEFT, x2: LEFT + plot, y1: y(v.capacity), y2: y(v.capacity), stroke: "#d62728",
                  "stroke-width": 1.4, "stroke-dasharray": "7,4", class: "capacity"}, svg);
    }
    el("text", {x: LEFT + 6, y: capY, fill: "#d62728"}, svg).textContent = cap;
    el("text", {x: 14, y: y0 + h / 2, transform: `rotate(-90 14 ${y0 + h / 2})`, "text-anchor": "middle",
                fill: "#555"}, svg).textContent = "memory per rank";
    el("rect", {x: LEFT, y: y0, width: plot, height: h, fill: "transparent", class: "memory-hover",
                "data-v": data.views.indexOf(v), "data-y0": y0, "data-h": h, "data-ymax": ymax}, svg);
  }

  function drawAxis(svg, top, plot, x) {
    const span = view[1] - view[0];
    const [unit, scale] = unitFor(Math.max(Math.abs(view[0]), Math.abs(view[1])));
    const step = niceStep(span * scale, 10) / scale;
    el("line", {x1: LEFT, x2: LEFT + plot, y1: top, y2: top, stroke: "#333"}, svg);
    for (let t = Math.ceil(view[0] / step) * step; t <= view[1] + step * 1e-9; t += step) {
      el("line", {x1: x(t), x2: x(t), y1: top, y2: top + 5, stroke: "#333"}, svg);
      el("text", {x: x(t), y: top + 18, "text-anchor": "middle"}, svg).textContent = three(t * scale);
    }
    el("text", {x: LEFT + plot, y: top + 32, "text-anchor": "end", fill: "#555"}, svg).textContent =
      `time in the training step (${unit})`;
  }

  function memoryAt(v, s) {
    const t = v.memory.t;
    let lo = 0, hi = t.length - 1;
    while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (t[mid] <= s) lo = mid; else hi = mid - 1; }
    return v.memory.b[lo];
  }

  // Names come from plan, cluster and model files: every string reaches the page as a text node, never as HTML.
  function showTip(ev, bold, rest, lines) {
    tip.textContent = "";
    const b = document.createElement("b");
    b.textContent = bold;
    tip.append(b, rest);
    for (const line of lines) tip.append(document.createElement("br"), line);
    tip.style.display = "block";
    tip.style.left = Math.min(ev.pageX + 14, window.scrollX + window.innerWidth - tip.offsetWidth - 8) + "px";
    tip.style.top = ev.pageY + 14 + "px";
  }

  root.addEventListener("mousemove", (ev) => {
    const t = ev.target;
    if (t.classList && t.classList.contains("bar")) {
      const v = data.views[+t.dataset.v], b = v.lanes[+t.dataset.l].bars[+t.dataset.b];
      const kind = data.kinds[b[2]];
      showTip(ev, kind.label, "", [v.names[b[3]], `${fmtTime(b[1] - b[0])} (${fmtTime(b[0])} to ${fmtTime(b[1])})`]);
    } else if (t.classList && t.classList.contains("memory-hover")) {
      const v = data.views[+t.dataset.v], box = t.getBoundingClientRect();
      const s = view[0] + (ev.clientX - box.left) / box.width * (view[1] - view[0]);
      showTip(ev, fmtBytes(memoryAt(v, s)), ` allocated at ${fmtTime(Math.max(0, s))}`, []);
    } else {
      tip.style.display = "none";
    }
  });
  root.addEventListener("mouseleave", () => { tip.style.display = "none"; });

  function timeAt(ev) {
    const box = root.querySelector("svg").getBoundingClientRect();
    const plot = box.width - LEFT - RIGHT;
    return view[0] + (ev.clientX - box.left - LEFT) / plot * (view[1] - view[0]);
  }

  root.addEventListener("wheel", (ev) => {
    ev.preventDefault();
    const at = Math.min(Math.max(timeAt(ev), view[0]), view[1]);
    const f = Math.exp(ev.deltaY * 0.002);
    const span = Math.min(data.end, Math.max(data.end * 1e-6, (view[1] - view[0]) * f));
    let lo = at - (at - view[0]) / (view[1] - view[0]) * span;
    lo = Math.min(Math.max(0, lo), data.end - span);
    view = [lo, lo + span];
    draw();
  }, {passive: false});

  let drag = null;
  root.addEventListener("mousedown", (ev) => { drag = {x: ev.clientX, view: view.slice()}; });
  window.addEventListener("mouseup", () => { drag = null; });
  window.addEventListener("mousemove", (ev) => {
    if (!drag) return;
    const box = root.querySelector("svg").getBoundingClientRect();
    const span = drag.view[1] - drag.view[0];
    let lo = drag.view[0] - (ev.clientX - drag.x) / (box.width - LEFT - RIGHT) * span;
    lo = Math.min(Math.max(0, lo), data.end - span);
    view = [lo, lo + span];
    draw();
  });
  root.addEventListener("dblclick", () => { view = [0, data.end]; draw(); });
  window.addEventListener("resize", draw);

  const legend = document.getElementById("legend");
  function legendKey(label, style, line) {
    const item = document.createElement("span"), swatch = document.createElement("i");
    item.className = "key";
    if (line) swatch.className = "line";
    swatch.style.cssText = style;
    item.append(swatch, label);
    legend.appendChild(item);
  }
  for (const k of data.kinds) if (data.used.includes(k.key)) legendKey(k.label, `background:${k.color}`, false);
  legendKey("allocated memory per rank", "border-top:2px solid #4c78a8", true);
  legendKey("GPU capacity", "border-top:2px dashed #d62728", true);
  legendKey("reserved at peak (caching allocator)", "border-top:2px dotted #7f7f7f", true);
  draw();
})();
