// prefixgate dashboard: polls /dashboard/data and draws small line charts on <canvas>.
// No library, no build step, no outside network.
"use strict";

var COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
var KEY_STORE = "prefixgate-dashboard-key";
var apiKey = null;
var pollMs = 2000;
var timer = null;

function readKey() {
  var params = new URLSearchParams(window.location.search);
  var k = params.get("key");
  if (k) {
    // Keep the key out of the address bar and history once read.
    sessionStorage.setItem(KEY_STORE, k);
    params.delete("key");
    var rest = params.toString();
    history.replaceState(null, "", window.location.pathname + (rest ? "?" + rest : ""));
  }
  return sessionStorage.getItem(KEY_STORE);
}

// Nice round step for about `n` ticks over [0, max].
function niceStep(max, n) {
  var raw = max / n;
  var mag = Math.pow(10, Math.floor(Math.log10(raw)));
  var steps = [1, 2, 2.5, 5, 10];
  for (var i = 0; i < steps.length; i++) {
    if (steps[i] * mag >= raw) { return steps[i] * mag; }
  }
  return 10 * mag;
}

// A time step of about `s` seconds that reads well on an axis.
function niceSeconds(s) {
  var steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600];
  for (var i = 0; i < steps.length; i++) {
    if (steps[i] >= s) { return steps[i]; }
  }
  return 3600;
}

function ago2text(s) {
  return s % 60 === 0 ? s / 60 + "m" : s + "s";
}

// An axis label: as many decimals as the tick step needs.
function tick(v, step) {
  var decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  if (step * Math.pow(10, decimals) % 1 > 1e-9) { decimals += 1; }
  return v.toFixed(decimals);
}

function fmt(v) {
  if (v === null || v === undefined || !isFinite(v)) { return "-"; }
  var a = Math.abs(v);
  if (a >= 1000) { return v.toFixed(0); }
  if (a >= 100) { return v.toFixed(1); }
  if (a >= 10) { return v.toFixed(2); }
  return v.toPrecision(3).replace(/\.?0+$/, "") || "0";
}

// Draws series [{label, color, values}] against times (unix seconds) on a canvas.
// null values leave gaps. opts: {window: seconds shown, interval: seconds between samples,
// yMax: fixed top (else from data)}.
function drawChart(canvas, times, series, opts) {
  var dpr = window.devicePixelRatio || 1;
  var w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  var ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  var left = 44, right = 8, top = 18, bottom = 18;
  var pw = w - left - right, ph = h - top - bottom;
  var tEnd = times.length ? times[times.length - 1] : Date.now() / 1000;
  var tStart = tEnd - opts.window;
  var max = 0;
  series.forEach(function (s) {
    s.values.forEach(function (v) { if (v !== null && v > max) { max = v; } });
  });
  if (opts.yMax !== undefined) { max = Math.max(max, opts.yMax); }
  if (max <= 0) { max = 1; }
  var step = niceStep(max, 4);
  max = Math.ceil(max / step) * step;
  var x = function (t) { return left + (t - tStart) / opts.window * pw; };
  var y = function (v) { return top + ph - v / max * ph; };

  ctx.font = "10px system-ui, sans-serif";
  ctx.strokeStyle = "#e4e4e4";
  ctx.fillStyle = "#777";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (var v = 0; v <= max + step / 2; v += step) {
    ctx.beginPath();
    ctx.moveTo(left, Math.round(y(v)) + 0.5);
    ctx.lineTo(left + pw, Math.round(y(v)) + 0.5);
    ctx.stroke();
    ctx.fillText(tick(v, step), left - 4, y(v));
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  var tstep = niceSeconds(opts.window / 5);
  for (var ago = 0; ago <= opts.window + 1e-9; ago += tstep) {
    var tx = Math.min(Math.max(x(tEnd - ago), left + 10), left + pw - 12);
    ctx.fillText(ago === 0 ? "now" : "-" + ago2text(ago), tx, top + ph + 4);
  }

  series.forEach(function (s) {
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    var pen = false;
    for (var i = 0; i < times.length; i++) {
      var val = s.values[i];
      if (val === null || val === undefined || times[i] < tStart) { pen = false; continue; }
      // A gap in the samples (a busy or restarted server) is left as a gap, not bridged.
      if (i > 0 && times[i] - times[i - 1] > 3 * opts.interval) { pen = false; }
      if (pen) { ctx.lineTo(x(times[i]), y(val)); } else { ctx.moveTo(x(times[i]), y(val)); }
      pen = true;
    }
    ctx.stroke();
  });

  // Legend, top left.
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  var lx = left;
  series.forEach(function (s) {
    ctx.fillStyle = s.color;
    ctx.fillRect(lx, 5, 10, 3);
    ctx.fillStyle = "#444";
    ctx.fillText(s.label, lx + 13, 7);
    lx += 20 + ctx.measureText(s.label).width;
  });
  canvas.setAttribute("data-points", String(times.length));
}

function column(samples, name, scale) {
  return samples.map(function (s) {
    var v = s[name];
    return v === null || v === undefined ? null : v * scale;
  });
}

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

function render(data) {
  var samples = data.samples;
  var times = samples.map(function (s) { return s.t; });
  var win = data.window_s;
  setText("mode", data.mode);
  setText("model", data.model);
  setText("qwin", String(data.quantile_window_s));
  setText("interval", String(data.interval_s));
  setText("window", String(data.window_s));
  var pairs = [
    ["c-ttft", [["p50", "ttft_p50", 1000], ["p99", "ttft_p99", 1000]]],
    ["c-tpot", [["p50", "tpot_p50", 1000], ["p99", "tpot_p99", 1000]]],
    ["c-rps", [["requests/s", "requests_per_s", 1]]],
    ["c-tps", [["generated tokens/s", "tokens_per_s", 1]]],
    ["c-queue", [["queued", "queued", 1], ["running", "running", 1]]],
    ["c-kv", [["used", "kv_usage", 100]]],
    ["c-hit", [["hit rate", "prefix_hit_rate", 100]]],
  ];
  pairs.forEach(function (p) {
    var series = p[1].map(function (c, i) {
      return { label: c[0], color: COLORS[i], values: column(samples, c[1], c[2]) };
    });
    var yMax = p[0] === "c-kv" || p[0] === "c-hit" ? 100 : undefined;
    drawChart(document.getElementById(p[0]), times, series, { window: win, interval: data.interval_s, yMax: yMax });
  });

  // Latest values (the newest sample that has one).
  var latest = function (name) {
    for (var i = samples.length - 1; i >= 0; i--) {
      if (samples[i][name] !== null && samples[i][name] !== undefined) { return samples[i][name]; }
    }
    return null;
  };
  ["ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"].forEach(function (n) {
    var v = latest(n);
    setText("v-" + n, v === null ? "-" : fmt(v * 1000) + " ms");
  });
  ["requests_per_s", "tokens_per_s", "queued", "running"].forEach(function (n) {
    setText("v-" + n, fmt(latest(n)));
  });
  ["kv_usage", "prefix_hit_rate"].forEach(function (n) {
    var v = latest(n);
    setText("v-" + n, v === null ? "-" : fmt(v * 100) + " %");
  });

  // Per key: requests/s and tokens/s from each sample's deltas.
  var names = Object.keys(data.keys);
  var dt = data.interval_s;
  var perKey = function (field) {
    return names.map(function (name, i) {
      return {
        label: name, color: COLORS[i % COLORS.length],
        values: samples.map(function (s, j) {
          // Deltas since the previous sample, over the time actually elapsed.
          var span = j > 0 ? s.t - samples[j - 1].t : dt;
          var k = s.keys[name];
          return k ? k[field] / span : (Object.keys(s.keys).length ? 0 : null);
        }),
      };
    });
  };
  drawChart(document.getElementById("c-key-req"), times, perKey("requests"), { window: win, interval: dt });
  drawChart(document.getElementById("c-key-tok"), times, perKey("tokens"), { window: win, interval: dt });
  var body = document.getElementById("keys");
  body.textContent = "";
  names.forEach(function (name) {
    var k = data.keys[name];
    var tr = document.createElement("tr");
    tr.className = "key-row";
    [name, k.requests, k.prompt_tokens, k.completion_tokens].forEach(function (v) {
      var td = document.createElement("td");
      td.textContent = String(v);
      tr.appendChild(td);
    });
    body.appendChild(tr);
  });
}

function poll() {
  var headers = apiKey ? { Authorization: "Bearer " + apiKey } : {};
  return fetch("/dashboard/data", { headers: headers, cache: "no-store" })
    .then(function (r) {
      if (r.status === 401) {
        document.getElementById("keyform").hidden = false;
        setText("status", apiKey ? "the API key was refused" : "an API key is needed");
        return null;
      }
      if (!r.ok) {
        setText("status", "HTTP " + r.status + " from /dashboard/data");
        return null;
      }
      return r.json();
    })
    .then(function (data) {
      if (data === null) { return; }
      document.getElementById("keyform").hidden = true;
      pollMs = Math.max(500, data.interval_s * 1000);
      render(data);
      setText("status", "updated " + new Date().toLocaleTimeString() + " · " + data.samples.length + " samples");
      document.body.setAttribute("data-samples", String(data.samples.length));
      document.body.setAttribute("data-ready", "1");
    }, function (err) {
      // The server went away or the network failed: not a page error, say it and retry.
      setText("status", "cannot reach the gateway (" + err + ")");
    })
    .then(schedule, function (err) {
      schedule();
      throw err; // reported by the page's unhandledrejection handler
    });
}

function schedule() {
  clearTimeout(timer);
  timer = setTimeout(poll, pollMs);
}

document.getElementById("keyform").addEventListener("submit", function (ev) {
  ev.preventDefault();
  apiKey = document.getElementById("keyinput").value.trim() || null;
  if (apiKey) { sessionStorage.setItem(KEY_STORE, apiKey); }
  poll();
});

apiKey = readKey();
poll();
