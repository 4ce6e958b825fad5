"""The code interpreter's chart extraction (templates/code-interpreter/server/charts.py).

Figures are drawn by Debian's python3 with its python3-matplotlib (what the guest runs,
scripts/setup.sh installs it on the host too), their charts decoded by the real
e2b-code-interpreter SDK's models in .venv-e2b, from the same ``result`` line the server
sends. The server's own test (test_code_interpreter_server.py) checks that a kernel's
figure carries its chart over HTTP.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from tests.e2b_sdk import run_e2b
from tests.unit.test_code_interpreter_server import GUEST_PYTHON, SERVER_DIR, server_module

CHARTS = server_module("charts")

# Each figure: the code that draws it on a fresh pyplot figure ``fig`` with axes ``ax``.
FIGURES = {
    "line": """
ax.plot([1, 2, 3], [4, 5, 6], label="speed")
ax.plot([1, 2, 3], [1, float("nan"), 3])
ax.axhline(5)  # a reference line, not data
ax.set_title("Speed"); ax.set_xlabel("Time (s)"); ax.set_ylabel("v [m/s]")
""",
    "scatter": """
ax.scatter([1, 2], [3, 4], label="pts"); ax.set_xscale("log")
""",
    "bar": """
ax.bar(["a", "b", "c"], [1, 2, 3], label="2023"); ax.bar(["a", "b", "c"], [2, 3, 4])
ax.set_xlabel("Shop"); ax.set_ylabel("Sales (USD)")
""",
    "barh": """
ax.barh(["a", "b"], [5, 6]); ax.set_xlabel("Sales (USD)"); ax.set_ylabel("Shop")
""",
    "pie": """
ax.pie([1, 1, 2], labels=["x", "y", "z"]); ax.set_title("Share")
""",
    "box": """
ax.boxplot([[1, 2, 3, 4, 5, 20], [2, 3, 4, 5, 6]], patch_artist=True, labels=["A", "B"])
""",
    "super": """
fig.clf(); left, right = fig.subplots(1, 2); left.plot([1, 2]); right.pie([1, 2])
fig.suptitle("Both")
""",
    "dates": """
import datetime
ax.plot([datetime.date(2024, 1, 1), datetime.date(2024, 1, 3)], [1, 2])
""",
    "categories": """
ax.plot(["mon", "tue"], [1, 2])
""",
    "image": """
ax.imshow([[1, 2], [3, 4]])
""",
    "empty figure": """
fig.clf()
""",
    "unreadable": """
ax.plot([1, 2]); ax.get_title = None  # reading it fails: no chart, no error
""",
    # Without ticks, a line's points are all its values: exactly the bound, then one more.
    "at the bound": f"""
ax.plot(range({CHARTS.MAX_CHART_VALUES // 2}), range({CHARTS.MAX_CHART_VALUES // 2}))
ax.set_xticks([]); ax.set_yticks([])
""",
    "past the bound": f"""
ax.plot(range({CHARTS.MAX_CHART_VALUES // 2 + 1}), range({CHARTS.MAX_CHART_VALUES // 2 + 1}))
ax.set_xticks([]); ax.set_yticks([])
""",
    "too many axes": f"""
fig.clf(); fig.subplots(1, {CHARTS.MAX_SUBCHARTS + 1})
""",
    "too much text": f"""
ax.plot([1, 2]); ax.set_title("t" * {CHARTS.MAX_CHART_TEXT_CHARS + 1})
""",
}

_DRAW = """
import json, sys
sys.path.insert(0, {server!r})
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import charts

out = {{}}
for name, code in json.loads(sys.stdin.read()).items():
    fig, ax = plt.subplots()
    exec(code, {{"fig": fig, "ax": ax, "plt": plt}})
    out[name] = charts.figure_chart(fig)
    plt.close(fig)
print(json.dumps(out, allow_nan=False))
"""

# Decoded by the SDK as it decodes the server's stream: one ``result`` line per chart.
_DECODE = """
from e2b_code_interpreter.models import Execution, parse_output

def describe(chart):
    if chart is None:
        return None
    out = {"class": type(chart).__name__, "type": chart.type.value, "title": chart.title}
    for name in ("x_label", "y_label", "x_unit", "y_unit", "x_tick_labels", "x_ticks"):
        if hasattr(chart, name):
            out[name] = getattr(chart, name)
    for name in ("x_scale", "y_scale"):
        if hasattr(chart, name):
            out[name] = getattr(chart, name).value
    out["elements"] = [
        describe(e) if hasattr(e, "type") else {k: v for k, v in vars(e).items()}
        for e in chart.elements
    ]
    return out

execution = Execution()
charts = _json.loads(SENT)
for chart in charts.values():
    parse_output(execution, _json.dumps({"type": "result", "chart": chart, "text": "fig"}))
report({name: describe(r.chart) for name, r in zip(charts, execution.results)})
"""


@pytest.fixture(scope="module")
def charts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each figure's chart as the server sends it, and as the SDK decodes it."""
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path_factory.mktemp("matplotlib"))}
    drawn = subprocess.run(
        [GUEST_PYTHON, "-c", _DRAW.format(server=str(SERVER_DIR))],
        input=json.dumps(FIGURES),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    sent = json.loads(drawn.stdout)
    sent_file = tmp_path_factory.mktemp("charts") / "sent.json"
    sent_file.write_text(drawn.stdout)
    # The SDK calls no server here: run_e2b's URL and key are never used.
    script = f"SENT = open({str(sent_file)!r}).read()\n" + _DECODE
    decoded = run_e2b(script, url="http://127.0.0.1:9", api_key="unused", timeout_s=120)
    return {"sent": sent, "decoded": decoded}


def test_a_line_chart_carries_its_title_labels_units_ticks_and_points(
    charts: dict[str, Any],
) -> None:
    line = charts["decoded"]["line"]
    assert (line["class"], line["type"], line["title"]) == ("LineChart", "line", "Speed")
    assert (line["x_label"], line["x_unit"]) == ("Time (s)", "s")
    assert (line["y_label"], line["y_unit"]) == ("v [m/s]", "m/s")
    assert line["x_scale"] == line["y_scale"] == "linear"
    assert len(line["x_ticks"]) == len(line["x_tick_labels"]) > 0
    assert "2.00" in line["x_tick_labels"]
    # The axhline is no series; a NaN is a gap (JSON has no NaN).
    # (The SDK's points are tuples; reported as JSON, lists.)
    assert line["elements"] == [
        {"label": "speed", "points": [[1.0, 4.0], [2.0, 5.0], [3.0, 6.0]]},
        {"label": "Line 1", "points": [[1.0, 1.0], [2.0, None], [3.0, 3.0]]},
    ]


def test_scatter_bar_pie_and_box_charts_decode_as_their_sdk_types(
    charts: dict[str, Any],
) -> None:
    decoded = charts["decoded"]
    scatter = decoded["scatter"]
    assert (scatter["class"], scatter["x_scale"]) == ("ScatterChart", "log")
    assert scatter["elements"] == [{"label": "pts", "points": [[1.0, 3.0], [2.0, 4.0]]}]
    bar = decoded["bar"]
    assert (bar["class"], bar["x_label"], bar["y_unit"]) == ("BarChart", "Shop", "USD")
    assert [(e["label"], e["group"], e["value"]) for e in bar["elements"]] == [
        ("a", "2023", 1.0), ("b", "2023", 2.0), ("c", "2023", 3.0),
        ("a", "Group 1", 2.0), ("b", "Group 1", 3.0), ("c", "Group 1", 4.0),
    ]  # fmt: skip
    # Horizontal bars: x still names the categories (their label and unit swap, as E2B's).
    barh = decoded["barh"]
    assert (barh["x_label"], barh["y_label"], barh["y_unit"]) == ("Shop", "Sales (USD)", "USD")
    assert [(e["label"], e["value"]) for e in barh["elements"]] == [("a", 5.0), ("b", 6.0)]
    pie = decoded["pie"]
    assert (pie["class"], pie["title"]) == ("PieChart", "Share")
    assert pie["elements"] == [
        {"label": "x", "angle": 90.0, "radius": 1.0},
        {"label": "y", "angle": 90.0, "radius": 1.0},
        {"label": "z", "angle": 180.0, "radius": 1.0},
    ]
    box = decoded["box"]
    assert box["class"] == "BoxAndWhiskerChart"
    assert box["elements"] == [
        {"label": "A", "min": 1.0, "first_quartile": 2.25, "median": 3.5,
         "third_quartile": 4.75, "max": 5.0, "outliers": [20.0]},
        {"label": "B", "min": 2.0, "first_quartile": 3.0, "median": 4.0,
         "third_quartile": 5.0, "max": 6.0, "outliers": []},
    ]  # fmt: skip


def test_a_figure_of_several_axes_is_a_superchart_of_their_charts(
    charts: dict[str, Any],
) -> None:
    chart = charts["decoded"]["super"]
    assert (chart["class"], chart["title"]) == ("SuperChart", "Both")
    assert [e["class"] for e in chart["elements"]] == ["LineChart", "PieChart"]


def test_dates_and_categories_are_their_scales_with_readable_values(
    charts: dict[str, Any],
) -> None:
    dates = charts["decoded"]["dates"]
    assert dates["x_scale"] == "datetime"
    assert dates["elements"][0]["points"] == [["2024-01-01", 1.0], ["2024-01-03", 2.0]]
    assert all(tick.startswith("2024-01-0") for tick in dates["x_ticks"])
    categories = charts["decoded"]["categories"]
    assert categories["x_scale"] == "categorical"
    assert categories["x_tick_labels"] == ["mon", "tue"]
    assert categories["elements"][0]["points"] == [["mon", 1.0], ["tue", 2.0]]


def test_what_is_no_known_chart_is_unknown_and_an_empty_figure_has_none(
    charts: dict[str, Any],
) -> None:
    image = charts["decoded"]["image"]
    assert (image["class"], image["type"], image["elements"]) == ("Chart", "unknown", [])
    assert charts["sent"]["empty figure"] is None


def test_negative_a_figure_past_a_bound_or_unreadable_gets_no_chart(
    charts: dict[str, Any],
) -> None:
    sent = charts["sent"]
    at_bound = sent["at the bound"]["elements"][0]["points"]
    assert len(at_bound) * 2 == CHARTS.MAX_CHART_VALUES
    for name in ("past the bound", "too many axes", "too much text", "unreadable"):
        assert sent[name] is None, name


def test_negative_the_budget_holds_at_its_exact_bounds() -> None:
    budget = CHARTS._Budget()
    budget.take(CHARTS.MAX_CHART_VALUES)
    with pytest.raises(CHARTS._TooBig):
        budget.take(1)
    budget = CHARTS._Budget()
    assert budget.text("x" * CHARTS.MAX_CHART_TEXT_CHARS)
    with pytest.raises(CHARTS._TooBig):
        budget.text("x")
