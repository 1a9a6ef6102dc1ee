"""Benchmark: how the monitor's page draws its rate plot, its own SVG (monitor/static/app.js
`plot`) against uPlot, the smallest well-kept plotting library (`npm pack uplot`, its
dist/uPlot.iife.min.js given with --uplot). Each draws the page's two plots (samples/s and tokens/s,
two series each) of --points readings in headless Chromium (Debian's chromium, Playwright), --repeats
times; the median milliseconds per draw of both plots, and the bytes each ships to the browser.

Run: .venv/bin/python bench/plot.py --uplot /tmp/uplot/package/dist/uPlot.iife.min.js [--points 720,5000]
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "monitor" / "static" / "app.js"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]

HARNESS = """<!doctype html><html><head><meta charset="utf-8">
<link rel="stylesheet" href="style.css"><link rel="stylesheet" href="uPlot.min.css">
<script src="app.js"></script><script src="uPlot.iife.min.js"></script></head>
<body><svg id="a" class="plot" style="width:600px;height:200px"></svg><svg id="b" class="plot" style="width:600px;height:200px"></svg>
<div id="c"></div><div id="d"></div></body></html>"""

MEASURE = """([n, repeats]) => {
  const t0 = 1.8e9, rows = [];
  for (let i = 0; i < n; i++) rows.push([t0 + 5 * i, 2 + Math.sin(i / 40), 2 + Math.cos(i / 50), 900 + 80 * Math.sin(i / 30), 880 + 60 * Math.cos(i / 45)]);
  const own = [], lib = [];
  for (let r = 0; r < repeats; r++) {
    let began = performance.now();
    plot(document.getElementById("a"), rows, [{col: 1, name: "written", cls: "written"}, {col: 2, name: "uploaded", cls: "uploaded"}], "samples/s", 2);
    plot(document.getElementById("b"), rows, [{col: 3, name: "written", cls: "written"}, {col: 4, name: "uploaded", cls: "uploaded"}], "tokens/s", 0);
    document.body.getBoundingClientRect();
    own.push(performance.now() - began);
    began = performance.now();
    for (const [id, a, b] of [["c", 1, 2], ["d", 3, 4]]) {
      const el = document.getElementById(id);
      el.replaceChildren();
      const data = [rows.map(x => x[0]), rows.map(x => x[a]), rows.map(x => x[b])];
      new uPlot({width: 600, height: 200, series: [{}, {label: "written", stroke: "#8250df"}, {label: "uploaded", stroke: "#1a7f37"}]}, data, el);
    }
    document.body.getBoundingClientRect();
    lib.push(performance.now() - began);
  }
  return [own, lib];
}"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uplot", type=Path, required=True, help="uPlot's dist/uPlot.iife.min.js")
    parser.add_argument("--points", default="720,5000")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "index.html").write_text(HARNESS)
        (folder / "app.js").write_text(APP.read_text().replace("connect();", ""))
        (folder / "style.css").write_text((APP.parent / "style.css").read_text())
        (folder / "uPlot.iife.min.js").write_bytes(args.uplot.read_bytes())
        css = args.uplot.parent / "uPlot.min.css"
        (folder / "uPlot.min.css").write_bytes(css.read_bytes() if css.exists() else b"")
        results = {}
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            page = browser.new_page()
            page.goto((folder / "index.html").as_uri())
            for points in map(int, args.points.split(",")):
                own, lib = page.evaluate(MEASURE, [points, args.repeats])
                results[points] = {
                    "own_svg_ms": round(statistics.median(own), 2),
                    "uplot_ms": round(statistics.median(lib), 2),
                }
            browser.close()
    print(
        json.dumps(
            {
                "bench": "plot",
                "repeats": args.repeats,
                "bytes": {"own_svg": len(APP.read_bytes()), "uplot": args.uplot.stat().st_size},
                "median_ms_per_draw_of_both_plots": results,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
