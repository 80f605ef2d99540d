"""A step's timeline as one self-contained HTML file: the ``StepView`` data as JSON and the small script that draws
it as SVG (``timeline.js``, inlined). No network access, no library: the file opens anywhere, offline."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

from fsdp_planner.fmt import finite
from fsdp_planner.report.step_view import BarKind, StepView, thin_curve
from fsdp_planner.userfiles import WRITTEN_BY, write_atomic

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="generator" content="{generator}">
<title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 16px 20px; color: #222; }}
h1 {{ font-size: 17px; margin: 0 0 4px; overflow-wrap: anywhere; }}
p.hint {{ color: #666; font-size: 12px; margin: 0 0 8px; }}
#legend {{ font-size: 12px; margin: 6px 0 10px; }}
#legend .key {{ margin-right: 16px; white-space: nowrap; display: inline-block; }}
#legend i {{ display: inline-block; width: 14px; height: 10px; margin-right: 5px; vertical-align: middle; }}
#legend i.line {{ height: 0; width: 22px; }}
#timeline {{ width: 100%; user-select: none; cursor: grab; }}
#tip {{ position: absolute; display: none; pointer-events: none; background: #fff; border: 1px solid #999;
        padding: 5px 8px; font-size: 12px; box-shadow: 0 2px 6px rgba(0,0,0,.2); max-width: 480px; }}
</style>
</head>
<body>
<h1>{title}</h1>
<p class="hint">Hover a bar for its group and times; scroll to zoom, drag to pan, double-click to reset.</p>
<div id="legend"></div>
<div id="timeline"></div>
<div id="tip"></div>
<script type="application/json" id="timeline-data">{data}</script>
<script>
{script}
</script>
</body>
</html>
"""


def page_data(views: Sequence[StepView]) -> dict[str, Any]:
    """What the script draws: bars as [start, end, kind, name] with names listed once per plan."""
    kinds = list(BarKind)
    out_views = []
    used: set[BarKind] = set()
    for v in views:
        names: dict[str, int] = {}
        lanes = []
        for lane in v.lanes:
            bars = []
            for b in lane.bars:
                bars.append([b.start, b.end, kinds.index(b.kind), names.setdefault(b.name, len(names))])
                used.add(b.kind)
            lanes.append({"name": lane.name, "bars": bars})
        t, b = thin_curve(v.memory_times, v.memory_bytes)
        out_views.append({"summary": v.summary(), "lanes": lanes, "names": list(names),
                          "memory": {"t": t.tolist(), "b": [round(x) for x in b.tolist()]},
                          "capacity": v.capacity, "reserved": v.report.reserved_memory,
                          "peak": v.report.peak_memory, "gpu": v.gpu})
    return {"end": max(v.report.step_time for v in views), "views": out_views,
            "kinds": [{"key": k.value, "label": k.label, "color": k.color} for k in kinds],
            "used": [k.value for k in kinds if k in used]}


# What JSON may hold in a string but a <script> element may not: "</script" ends it, "<!--" with "<script" makes
# the parser skip the real end tag, "&" starts nothing here but is escaped for an HTML reader that thinks it does.
_SCRIPT_UNSAFE = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"}


def script_json(data: Any) -> str:
    """``data`` as JSON for a ``<script type="application/json">`` element: the one escaping rule for the page's
    data. ``<``, ``>`` and ``&`` are escaped in strings (the only place JSON has them), U+2028/2029 and everything
    else outside ASCII by ``ensure_ascii``, and a number that is not finite (a NaN in a cluster file) is null, since
    JSON has no NaN and ``JSON.parse`` would refuse the page's data."""
    text = json.dumps(finite(data), separators=(",", ":"), allow_nan=False, ensure_ascii=True)
    return text.translate(str.maketrans(_SCRIPT_UNSAFE))


def render_html(views: Sequence[StepView], title: str) -> str:
    script = files("fsdp_planner.report").joinpath("timeline.js").read_text(encoding="utf-8")
    return _PAGE.format(title=html.escape(title), generator=WRITTEN_BY, data=script_json(page_data(views)),
                        script=script)


def write_html(views: Sequence[StepView], path: Path, title: str) -> None:
    write_atomic(path, render_html(views, title))
