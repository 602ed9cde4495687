/* hookcli HTML report: sort, filter, deep links, module tree, call detail.
   Every number shown is read from the embedded JSON (#hookcli-data), never recomputed.
   Text from the report is set with textContent, never as markup. No request is made. */
(function () {
  "use strict";
  var started = performance.now();
  var timing = (window.hookcliTiming = { script: started });
  document.documentElement.classList.add("js");
  var data = JSON.parse(document.getElementById("hookcli-data").textContent);
  window.hookcliData = data;
  var table = document.getElementById("calls");
  function painted() {
    timing.ready = performance.now();
    requestAnimationFrame(function () {
      setTimeout(function () {
        timing.paint = performance.now();
      }, 0);
    });
  }
  if (!table) {
    painted();
    return;
  }
  var diff = document.body.classList.contains("kind-diff");
  var recs = diff ? data.calls.concat(data.outputs || []) : data.layers;
  var tbody = table.tBodies[0];
  var trs = Array.prototype.slice.call(tbody.rows);
  var app = document.getElementById("app");

  // ------------------------------------------------------------ helpers
  var UNSAFE = /[\u0000-\u001f\u007f-\u009f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]/g;
  function safe(s) {
    return String(s).replace(UNSAFE, function (ch) {
      var h = ch.charCodeAt(0).toString(16);
      return ch.charCodeAt(0) < 256 ? "\\x" + ("0" + h).slice(-2) : "\\u" + ("000" + h).slice(-4);
    });
  }
  function el(tag, attrs, children) {
    var e = document.createElement(tag);
    if (attrs) {
      Object.keys(attrs).forEach(function (k) {
        if (k === "text") e.textContent = safe(attrs[k]);
        else if (k === "className") e.className = attrs[k];
        else e.setAttribute(k, attrs[k]);
      });
    }
    (children || []).forEach(function (c) {
      if (c) e.appendChild(c);
    });
    return e;
  }
  function svg(tag, attrs) {
    var e = document.createElementNS("http://www.w3.org/2000/svg", tag);
    Object.keys(attrs || {}).forEach(function (k) {
      e.setAttribute(k, attrs[k]);
    });
    return e;
  }
  // Numbers as the text formats print them (render/fmt.py), digit for digit: JavaScript rounds
  // a tie up, Python to even, so a tie (exact in binary: 9698.5, 0.0625) is found in the
  // value's longer expansion and rounded as Python does. The value itself is the JSON's.
  var EXTRA = 22;
  function tie(exact, keep) {
    // exact: the digits with EXTRA more than `keep`; a tie when they are 5 then zeros
    return exact.slice(keep) === "5" + new Array(EXTRA).join("0");
  }
  function sig(a, p) {
    // |v| to p significant digits, half to even: [digits, exponent]
    var m = a.toExponential(p - 1).split("e");
    var digits = m[0].replace(".", ""), exp = +m[1];
    var x = a.toExponential(p - 1 + EXTRA).split("e");
    var all = x[0].replace(".", "");
    if (tie(all, p) && +all[p - 1] % 2 === 0) {
      digits = all.slice(0, p);
      exp = +x[1];
    }
    return [digits, exp];
  }
  function pyG(v, p) {
    // Python's format(v, ".{p}g")
    var r = sig(Math.abs(v), p), d = r[0], e = r[1], out;
    if (e < -4 || e >= p) {
      var mant = d.length > 1 ? d[0] + "." + d.slice(1) : d;
      mant = mant.indexOf(".") >= 0 ? mant.replace(/0+$/, "").replace(/\.$/, "") : mant;
      out = mant + "e" + (e < 0 ? "-" : "+") + (Math.abs(e) < 10 ? "0" : "") + Math.abs(e);
    } else {
      out = e >= 0 ? d.slice(0, e + 1) + "." + d.slice(e + 1) : "0." + new Array(-e).join("0") + d;
      out = out.replace(/0+$/, "").replace(/\.$/, "");
    }
    return (v < 0 ? "-" : "") + out;
  }
  function pyF(v, f) {
    // Python's format(v, ".{f}f")
    var a = Math.abs(v), s = a.toFixed(f), x = a.toFixed(f + EXTRA);
    var cut = x.length - EXTRA, last = f ? cut - 1 : cut - 2;
    if (tie(x, cut) && +x[last] % 2 === 0) s = x.slice(0, last + 1);
    return (v < 0 || Object.is(v, -0) ? "-" : "") + s;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "\u2014";
    if (typeof v !== "number") return String(v);
    if (v === 0) return "0";
    return pyG(v, 4);
  }
  function pct(v) {
    if (v === null || v === undefined) return "\u2014";
    if (v === 0) return "0%";
    if (v < 0.001) return "<0.1%";
    return pyF(v * 100, 1) + "%";
  }
  function db(v, rel) {
    if (v === null || v === undefined) return rel === 0 ? "inf" : "\u2014";
    return pyF(v, 1);
  }
  function signed(v) {
    if (v === null || v === undefined) return "\u2014";
    return v === 0 ? "0" : (v > 0 ? "+" : "") + pyG(v, 4);
  }
  function shape(s) {
    return s && s.length ? s.join("x") : "scalar";
  }

  window.hookcliFormat = { fmt: fmt, pct: pct, db: db, signed: signed, fixed: pyF };
  // a tensor's statistics as records.TensorStats declares them: [JSON key, label, format]
  var STATS = JSON.parse(app.getAttribute("data-stats") || "[]");
  var SHOWN = { num: fmt, pct: pct, int: String };

  // ------------------------------------------------------------ values by column key
  var PICK = {
    out: function (r) { return (r.outputs || [])[0]; },
    "in": function (r) { return (r.inputs || [])[0]; },
    gout: function (r) { return (r.grad_outputs || [])[0]; },
    gin: function (r) { return (r.grad_inputs || [])[0]; },
    b: function (r) { return (r.b || [])[0]; },
    a: function (r) { return (r.a || [])[0]; },
    prof: function (r) { return r.profile; }
  };
  function tensorsOf(r) {
    return [].concat(r.inputs || [], r.outputs || [], r.grad_outputs || [], r.grad_inputs || []);
  }
  function nonfinite(r) {
    if (diff) {
      return [].concat(r.a || [], r.b || []).reduce(function (n, d) { return n + d.nonfinite; }, 0);
    }
    return tensorsOf(r).reduce(function (n, t) { return n + t.nan + t.inf; }, 0);
  }
  function value(r, key) {
    if (key === "name" || key === "type" || key === "call") return r[key];
    if (key === "nonfinite") return nonfinite(r);
    if (key === "over") {
      return [].concat(r.a || [], r.b || []).filter(function (d) { return d.over || d.nonfinite; }).length;
    }
    var dot = key.indexOf(".");
    var pick = PICK[key.slice(0, dot)];
    var obj = pick ? pick(r) : null;
    var field = key.slice(dot + 1);
    var v = obj ? obj[field] : null;
    if (v === null && obj && field === "sqnr_db" && obj.rel_l2 === 0) return Infinity; // identical
    return v === undefined ? null : v;
  }

  // ------------------------------------------------------------ controls
  var types = [];
  recs.forEach(function (r) {
    if (types.indexOf(r.type) < 0) types.push(r.type);
  });
  types.sort();
  var fLayer = el("input", {
    id: "f-layer",
    type: "search",
    placeholder: "layer: text, or a glob (layer4.*.conv*)",
    "aria-label": "filter layers by name or glob"
  });
  var fType = el("select", { id: "f-type", "aria-label": "filter by module type" }, [
    el("option", { value: "", text: "all types" })
  ].concat(types.map(function (t) { return el("option", { value: t, text: t }); })));
  var fBad = el("input", { id: "f-bad", type: "checkbox" });
  var shown = el("span", { id: "shown", "aria-live": "polite" });
  var controls = el("div", { id: "controls" }, [
    fLayer,
    fType,
    el("label", null, [fBad, document.createTextNode(diff ? " over tolerance only" : " flagged only")]),
    shown
  ]);
  app.appendChild(controls);

  function globRe(text) {
    if (!/[*?[]/.test(text)) return null;
    var out = "";
    for (var i = 0; i < text.length; i++) {
      var ch = text[i];
      if (ch === "*") out += ".*";
      else if (ch === "?") out += ".";
      else if (ch === "[") {
        // as fnmatch: [!…] negates, a ] first in the class is a member, no closing ] is a [
        var j = i + 1;
        if (text[j] === "!") j++;
        if (text[j] === "]") j++;
        while (j < text.length && text[j] !== "]") j++;
        if (j >= text.length) out += "\\[";
        else {
          var body = text.slice(i + 1, j).replace(/\\/g, "\\\\").replace(/]/g, "\\]");
          if (body[0] === "!") body = "^" + body.slice(1);
          else if (body[0] === "^") body = "\\^" + body.slice(1); // fnmatch: a literal ^
          out += "[" + body + "]";
          i = j;
        }
      } else out += ch.replace(/[.+^${}()|\\\/]/g, "\\$&");
    }
    try {
      return new RegExp("^" + out + "$", "s"); // s: * spans any character, as in fnmatch
    } catch (e) {
      return /^$/;
    }
  }
  function applyFilter() {
    var text = fLayer.value.trim();
    var re = globRe(text);
    var type = fType.value;
    var bad = fBad.checked;
    var n = 0;
    trs.forEach(function (tr) {
      var r = recs[+tr.getAttribute("data-i")];
      var ok = !text || (re ? re.test(r.name) : r.name.indexOf(text) >= 0);
      ok = ok && (!type || r.type === type);
      ok = ok && (!bad || tr.classList.contains("bad"));
      tr.hidden = !ok;
      if (ok) n++;
    });
    shown.textContent = n + " of " + trs.length + (diff ? " rows" : " calls");
  }
  [fLayer, fType, fBad].forEach(function (c) {
    c.addEventListener("input", applyFilter);
    c.addEventListener("change", applyFilter);
  });

  // ------------------------------------------------------------ sort
  var ths = Array.prototype.slice.call(table.tHead.rows[0].cells);
  function sortBy(th, dir) {
    var key = th.getAttribute("data-key");
    ths.forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", dir > 0 ? "ascending" : "descending");
    var order = trs.slice().sort(function (x, y) {
      var i = +x.getAttribute("data-i"), j = +y.getAttribute("data-i");
      var a = value(recs[i], key), b = value(recs[j], key);
      if (a === null && b === null) return i - j;
      if (a === null) return 1; // missing values last, either way
      if (b === null) return -1;
      var c = typeof a === "string" ? a.localeCompare(b) : a - b;
      return c !== 0 ? c * dir : i - j;
    });
    var frag = document.createDocumentFragment();
    order.forEach(function (tr) { frag.appendChild(tr); });
    tbody.appendChild(frag);
  }
  ths.forEach(function (th) {
    if (!th.getAttribute("data-key")) return;
    th.tabIndex = 0;
    th.classList.add("sortable");
    function go() {
      var key = th.getAttribute("data-key");
      var numeric = recs.some(function (r) { return typeof value(r, key) === "number"; });
      var now = th.getAttribute("aria-sort");
      var dir = now ? (now === "ascending" ? -1 : 1) : numeric ? -1 : 1;
      sortBy(th, dir);
    }
    th.addEventListener("click", go);
    th.addEventListener("keydown", function (ev) {
      if (ev.key === "Enter" || ev.key === " ") {
        ev.preventDefault();
        go();
      }
    });
  });

  // ------------------------------------------------------------ detail of one call
  var detail = el("aside", { id: "detail", hidden: "", "aria-label": "layer call detail" });
  document.body.appendChild(detail);
  function histSvg(h) {
    var counts = h.counts, edges = h.edges;
    var top = Math.max.apply(null, counts) || 1;
    var w = 280, hgt = 70, bw = w / counts.length;
    var s = svg("svg", { viewBox: "0 0 " + w + " " + (hgt + 14), width: w, height: hgt + 14, "class": "hist", role: "img" });
    counts.forEach(function (c, i) {
      var bh = (hgt * c) / top;
      if (bh <= 0) return;
      var r = svg("rect", { x: i * bw, y: hgt - bh, width: Math.max(bw - 0.5, 0.5), height: bh });
      var tip = svg("title");
      tip.textContent = "[" + fmt(edges[i]) + ", " + fmt(edges[i + 1]) + "): " + c;
      r.appendChild(tip);
      s.appendChild(r);
    });
    var lo = svg("text", { x: 0, y: hgt + 12 });
    lo.textContent = fmt(edges[0]);
    var hi = svg("text", { x: w, y: hgt + 12, "text-anchor": "end" });
    hi.textContent = fmt(edges[edges.length - 1]);
    s.appendChild(lo);
    s.appendChild(hi);
    return s;
  }
  function kv(pairs) {
    return el("dl", null, [].concat.apply([], pairs.map(function (p) {
      return [el("dt", { text: p[0] }), el("dd", { text: p[1] })];
    })));
  }
  function tensorBlock(title, ts) {
    if (!ts || !ts.length) return null;
    return el("section", null, [el("h4", { text: title })].concat(ts.map(function (t) {
      var pairs = diff
        ? [["shape", shape(t.shape)], ["max|\u0394|", fmt(t.max_abs)], ["rel L2", fmt(t.rel_l2)],
           ["own L2", fmt(t.own_rel_l2)], ["cosine", t.cosine === null ? "\u2014" : pyF(t.cosine, 6)],
           ["SQNR dB", db(t.sqnr_db, t.rel_l2)], ["norm \u0394", signed(t.norm_rel)],
           ["not finite", String(t.nonfinite)],
           ["over tol", t.over ? "yes" : "no"]]
        : [["shape", shape(t.shape)], ["dtype", t.dtype]].concat(STATS.map(function (s) {
            return [s[1], SHOWN[s[2]](t[s[0]])];  // the declared statistics (#app's data-stats)
          }));
      if (t.layout) pairs.push(["layout", t.layout]);
      if (t.note) pairs.push(["note", t.note]);
      return el("div", { className: "tensor" }, [
        el("h5", { text: t.path }),
        kv(pairs),
        t.hist && t.hist.counts && t.hist.counts.length ? histSvg(t.hist) : null
      ]);
    })));
  }
  function paramBlock(ps) {
    if (!ps || !ps.length) return null;
    var head = el("tr", null, ["param", "shape", "norm", "grad norm", "grad/weight"].map(function (h) {
      return el("th", { text: h });
    }));
    var body = ps.map(function (p) {
      return el("tr", null, [p.name, shape(p.shape), fmt(p.norm), fmt(p.grad_norm), fmt(p.ratio)].map(function (c) {
        return el("td", { text: c });
      }));
    });
    return el("section", null, [el("h4", { text: "parameters" }), el("table", null, [el("thead", null, [head]), el("tbody", null, body)])]);
  }
  function showDetail(i) {
    var r = recs[i];
    var close = el("button", { type: "button", className: "close", "aria-label": "close", text: "\u00d7" });
    close.addEventListener("click", function () {
      detail.hidden = true;
      document.body.classList.remove("detail-open");
    });
    var parts = [close, el("h3", { text: r.name }), el("p", { className: "dim", text: r.type + (r.type_b ? " / " + r.type_b : "") + ", call " + r.call })];
    if (r.error) parts.push(el("p", { className: "bad", text: r.error }));
    if (diff) {
      parts.push(tensorBlock(data.ref ? "B against the reference" : "B against A", r.b));
      parts.push(tensorBlock("A against the reference", r.a));
    } else {
      parts.push(tensorBlock("inputs", r.inputs));
      parts.push(tensorBlock("outputs", r.outputs));
      parts.push(tensorBlock("gradients w.r.t. outputs", r.grad_outputs));
      parts.push(tensorBlock("gradients w.r.t. inputs", r.grad_inputs));
      parts.push(paramBlock(r.params));
      if (r.profile) {
        parts.push(el("section", null, [el("h4", { text: "profile" }), kv([
          ["total ms", pyF(r.profile.forward_ms, 3)],
          ["self ms", r.profile.self_ms === null ? "\u2014" : pyF(r.profile.self_ms, 3)],
          ["backward ms", r.profile.backward_ms === null ? "\u2014" : pyF(r.profile.backward_ms, 3)],
          ["FLOPs", fmt(r.profile.flops)],
          ["output bytes", fmt(r.profile.output_bytes)]
        ])]));
      }
    }
    detail.textContent = "";
    parts.forEach(function (p) {
      if (p) detail.appendChild(p);
    });
    detail.hidden = false;
    document.body.classList.add("detail-open");
  }

  // ------------------------------------------------------------ deep links
  var status = el("p", { id: "link-status", className: "note", hidden: "" });
  app.appendChild(status);
  function select(tr, scroll) {
    trs.forEach(function (x) { x.classList.remove("target"); });
    if (tr.hidden) {
      fLayer.value = "";
      fType.value = "";
      fBad.checked = false;
      applyFilter();
    }
    tr.classList.add("target");
    if (scroll) tr.scrollIntoView({ block: "center" });
    showDetail(+tr.getAttribute("data-i"));
  }
  function rec(tr) {
    return recs[+tr.getAttribute("data-i")];
  }
  function link(tr) {
    var r = rec(tr);
    return "#layer=" + encodeURIComponent(r.name) + "&call=" + r.call;
  }
  function follow() {
    var hash = location.hash.slice(1);
    if (hash.indexOf("layer=") < 0) return;
    var q = new URLSearchParams(hash);
    var name = q.get("layer"), call = q.get("call") || "0";
    var tr = trs.filter(function (x) {
      return rec(x).name === name && String(rec(x).call) === call;
    })[0];
    status.hidden = !!tr;
    if (!tr) {
      trs.forEach(function (x) { x.classList.remove("target"); });
      detail.hidden = true;
      document.body.classList.remove("detail-open");
      status.textContent = safe("no call " + call + " of " + name + " in this report");
      return;
    }
    select(tr, true);
  }
  tbody.addEventListener("click", function (ev) {
    var tr = ev.target.closest("tr");
    if (!tr || ev.target.closest("a")) return;
    history.replaceState(null, "", link(tr));
    status.hidden = true;
    select(tr, false);
  });
  window.addEventListener("hashchange", follow);

  // ------------------------------------------------------------ module tree
  var metrics = diff
    ? [["b.rel_l2", data.ref ? "error of B (rel L2)" : "error (rel L2)"]]
        .concat(data.ref ? [["a.rel_l2", "error of A (rel L2)"]] : [])
        .concat(data.isolate ? [] : [["b.own_rel_l2", "own error (rel L2)"]])
        .concat([["b.max_abs", "max|\u0394|"], ["nonfinite", "not finite"]])
    : [["out.std", "std"], ["out.zeros", "zeros"], ["nonfinite", "NaN/Inf"], ["gout.norm", "gradient norm"], ["prof.forward_ms", "time (ms)"], ["out.norm", "output norm"]];
  metrics = metrics.filter(function (m) {
    return recs.some(function (r) { return value(r, m[0]) !== null; });
  });
  function buildTree() {
    var root = { name: "", label: data.model.spec, kids: {}, order: [], calls: [] };
    recs.forEach(function (r, i) {
      var node = root, path = "";
      r.name.split(".").forEach(function (seg) {
        path = path ? path + "." + seg : seg;
        if (!node.kids[seg]) {
          node.kids[seg] = { name: path, label: seg, kids: {}, order: [], calls: [] };
          node.order.push(seg);
        }
        node = node.kids[seg];
      });
      node.calls.push(i);
      node.type = r.type;
    });
    return root;
  }
  if (metrics.length) {
    var treeRoot = buildTree();
    var metricSel = el("select", { id: "tree-metric", "aria-label": "colour the tree by" },
      metrics.map(function (m) { return el("option", { value: m[0], text: m[1] }); }));
    var legend = el("span", { id: "tree-legend", className: "dim" });
    var treeBox = el("div", { id: "tree-body" });
    var tree = el("details", { id: "tree" }, [
      el("summary", { text: "module tree" }),
      el("div", { className: "tree-bar" }, [document.createTextNode("colour by "), metricSel, legend]),
      treeBox
    ]);
    app.insertBefore(tree, controls);
    var drawTree = function () {
      var key = metricSel.value;
      var log = key !== "out.zeros" && key !== "nonfinite";
      var vals = [];
      (function agg(node) {
        var best = null;
        node.calls.forEach(function (i) {
          var v = value(recs[i], key);
          if (typeof v === "number" && (best === null || v > best)) best = v;
        });
        node.own = best;
        node.order.forEach(function (k) {
          var v = agg(node.kids[k]);
          if (v !== null && (best === null || v > best)) best = v;
        });
        node.value = best;
        if (node.own !== null) vals.push(node.own);
        return best;
      })(treeRoot);
      var f = function (v) { return log ? Math.log10(Math.max(v, 1e-30)) : v; };
      var pos = vals.filter(function (v) { return !log || v > 0; });
      var lo = pos.length ? Math.min.apply(null, pos.map(f)) : 0;
      var hi = pos.length ? Math.max.apply(null, pos.map(f)) : 1;
      var min = pos.length ? Math.min.apply(null, pos) : null, max = pos.length ? Math.max.apply(null, pos) : null;
      var tol = diff && /rel_l2$/.test(key) && data.tol > 0 ? data.tol : null;
      if (tol !== null) {
        // an error is coloured against the tolerance: red at or past it, whatever the spread
        hi = f(tol);
        lo = Math.min(lo, hi - 3);
      }
      legend.textContent = " " + fmt(min) + " \u2192 " + fmt(max) + (log ? " (log scale" + (vals.length > pos.length ? "; 0 drawn as the least" : "") + ")" : "") +
        (tol !== null ? "; red: at or past tol " + fmt(tol) : "") + "; a module: the largest of its calls and of the modules in it";
      function colour(v) {
        if (v === null) return "";
        if (key === "nonfinite") return v > 0 ? "hsl(0,80%,75%)" : "hsl(120,40%,88%)";
        var t = hi > lo ? (f(v) - lo) / (hi - lo) : 0.5;
        t = Math.min(1, Math.max(0, t));
        if (tol !== null) {
          // under tol: blue to amber; at or past it: red, apart from the scale
          return v >= tol ? "hsl(0,85%,62%)" : "hsl(" + Math.round(220 - 175 * t) + ",75%," + Math.round(88 - 14 * t) + "%)";
        }
        return "hsl(" + Math.round(220 - 220 * t) + ",75%," + Math.round(88 - 28 * t) + "%)";
      }
      function render(node) {
        var label = el("span", { className: "node", text: node.label });
        if (node.type) label.appendChild(el("small", { text: " " + node.type }));
        var val = el("small", { className: "val", text: " " + fmt(node.value) });
        var row = el("div", { className: "tree-row", "data-name": safe(node.name) }, [label, val]);
        row.__name = node.name;
        var c = colour(node.own !== null ? node.own : node.value);
        if (c) row.style.background = c;
        if (node.own === null) row.classList.add("inner");
        if (!node.order.length) return el("li", null, [row]);
        return el("li", null, [
          el("details", { open: "" }, [
            el("summary", null, [row]),
            el("ul", null, node.order.map(function (k) { return render(node.kids[k]); }))
          ])
        ]);
      }
      treeBox.textContent = "";
      treeBox.appendChild(el("ul", null, treeRoot.order.map(function (k) { return render(treeRoot.kids[k]); })));
    };
    metricSel.addEventListener("change", drawTree);
    tree.addEventListener("toggle", function () {
      if (tree.open && !treeBox.firstChild) drawTree();
    });
    treeBox.addEventListener("click", function (ev) {
      var row = ev.target.closest(".tree-row");
      if (!row) return;
      var name = row.__name;
      var tr = trs.filter(function (x) { return rec(x).name === name; })[0];
      if (tr) {
        ev.preventDefault();
        history.replaceState(null, "", link(tr));
        select(tr, true);
      } else {
        fLayer.value = name + ".*";
        applyFilter();
      }
    });
  }

  applyFilter();
  follow();
  painted();
})();
