// Small charts on <canvas>: time on x, stacked bars or lines on y, optional log scale.
// drawChart(canvas, {series: [{name, color, points: [[t, v], ...]}], bars, log, from, to, format})
"use strict";

(function () {
  const PAD = { left: 52, right: 10, top: 24, bottom: 22 };

  // The smallest "round" number (1, 2, 2.5, 5 x 10^k) at least ``value``.
  function niceCeil(value) {
    if (value <= 0) return 1;
    const exp = Math.pow(10, Math.floor(Math.log10(value)));
    for (const step of [1, 2, 2.5, 5, 10]) {
      if (value <= step * exp) return step * exp;
    }
    return 10 * exp;
  }

  function clock(t, withSeconds) {
    const d = new Date(t * 1000);
    const two = (n) => String(n).padStart(2, "0");
    const text = two(d.getHours()) + ":" + two(d.getMinutes());
    return withSeconds ? text + ":" + two(d.getSeconds()) : text;
  }

  function drawChart(canvas, opts) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 400;
    const height = canvas.clientHeight || 180;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = "11px system-ui, sans-serif";

    const format = opts.format || ((v) => String(Math.round(v * 100) / 100));
    const from = opts.from;
    const to = opts.to;
    const plotW = width - PAD.left - PAD.right;
    const plotH = height - PAD.top - PAD.bottom;
    const x = (t) => PAD.left + ((t - from) / Math.max(to - from, 1)) * plotW;

    // y range: stacked sums for bars, the largest value for lines.
    let max = 0;
    let min = Infinity;
    if (opts.bars) {
      const sums = new Map();
      for (const s of opts.series) {
        for (const [t, v] of s.points) sums.set(t, (sums.get(t) || 0) + v);
      }
      for (const v of sums.values()) max = Math.max(max, v);
    } else {
      for (const s of opts.series) {
        for (const [, v] of s.points) {
          if (v > 0) { max = Math.max(max, v); min = Math.min(min, v); }
        }
      }
    }
    const hasData = max > 0;
    let y;
    let ticks;
    if (opts.log) {
      const lo = Math.pow(10, Math.floor(Math.log10(Math.min(min === Infinity ? 0.001 : min, 0.001))));
      const hi = Math.pow(10, Math.ceil(Math.log10(Math.max(max, lo * 10))));
      y = (v) => PAD.top + plotH - ((Math.log10(v) - Math.log10(lo)) / (Math.log10(hi) - Math.log10(lo))) * plotH;
      ticks = [];
      for (let v = lo; v <= hi * 1.0001; v *= 10) ticks.push(v);
    } else {
      // Four grid steps of a round size; counts never get fractional steps.
      let step = niceCeil((max * 1.05) / 4);
      if (opts.integer) step = Math.max(1, Math.ceil(step));
      const top = 4 * step;
      y = (v) => PAD.top + plotH - (v / top) * plotH;
      ticks = [0, step, 2 * step, 3 * step, top];
    }

    // Grid and y labels.
    ctx.strokeStyle = "#e5e7eb";
    ctx.fillStyle = "#68717d";
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (const v of ticks) {
      const py = Math.round(y(v)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(PAD.left, py);
      ctx.lineTo(width - PAD.right, py);
      ctx.stroke();
      ctx.fillText(format(v), PAD.left - 6, py);
    }
    // x labels: about one per 120 px.
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const count = Math.max(2, Math.floor(plotW / 120));
    for (let i = 0; i <= count; i++) {
      const t = from + ((to - from) * i) / count;
      ctx.fillText(clock(t, to - from < 600), Math.min(Math.max(x(t), PAD.left + 14), width - PAD.right - 14), height - PAD.bottom + 5);
    }

    if (!hasData) {
      ctx.fillStyle = "#9aa1ab";
      ctx.textBaseline = "middle";
      ctx.fillText(opts.empty || "no data yet", PAD.left + plotW / 2, PAD.top + plotH / 2);
    } else if (opts.bars) {
      // One bar per point time (a minute), stacked in series order.
      const step = opts.step || 60;
      const barW = Math.max(1, (step / Math.max(to - from, 1)) * plotW - 2);
      const base = new Map();
      for (const s of opts.series) {
        ctx.fillStyle = s.color;
        for (const [t, v] of s.points) {
          if (!v) continue;
          const below = base.get(t) || 0;
          const y0 = y(below);
          const y1 = y(below + v);
          ctx.fillRect(x(t) + 1, y1, barW, y0 - y1);
          base.set(t, below + v);
        }
      }
    } else {
      for (const s of opts.series) {
        ctx.strokeStyle = s.color;
        ctx.lineWidth = 1.6;
        ctx.beginPath();
        let drawing = false;
        for (const [t, v] of s.points) {
          if (v === null || (opts.log && !(v > 0))) { drawing = false; continue; }
          const px = x(t);
          const py = y(v);
          if (drawing) ctx.lineTo(px, py); else ctx.moveTo(px, py);
          drawing = true;
        }
        ctx.stroke();
        if (opts.dots) {
          ctx.fillStyle = s.color;
          for (const [t, v] of s.points) {
            if (v === null || (opts.log && !(v > 0))) continue;
            ctx.beginPath();
            ctx.arc(x(t), y(v), 2.5, 0, 2 * Math.PI);
            ctx.fill();
          }
        }
      }
    }

    // Legend along the top.
    ctx.textAlign = "left";
    ctx.textBaseline = "middle";
    let lx = PAD.left;
    for (const s of opts.series) {
      ctx.fillStyle = s.color;
      ctx.fillRect(lx, 8, 10, 10);
      ctx.fillStyle = "#1d232b";
      ctx.fillText(s.name, lx + 14, 13);
      lx += 22 + ctx.measureText(s.name).width;
    }
  }

  window.drawChart = drawChart;
})();
