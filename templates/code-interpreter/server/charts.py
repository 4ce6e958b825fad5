"""A matplotlib figure's data as the chart e2b-code-interpreter's ``Result.chart`` reads.

Runs inside each kernel: ``register(shell)`` adds an IPython display formatter for the
MIME type ``e2b/chart`` (the one E2B's own template sends) that turns a Figure into a
plain dict, so a figure shown by ``plt.show()`` or left as a cell's value comes back with
its PNG and its chart; kernels.py puts that dict in the result's ``chart`` field.

The shapes are those of the SDK's charts.py (2.11.5): every chart has ``type``, ``title``,
``elements``; the 2D ones ``x_label``, ``y_label``, ``x_unit``, ``y_unit`` (a unit is
what a label holds in parentheses or brackets: "Time (s)"); line and scatter charts
``x_ticks``, ``x_tick_labels``, ``x_scale`` and the same for y, and elements of
``{"label", "points": [[x, y], ...]}``; bar elements ``{"label", "group", "value"}``; pie
``{"label", "angle", "radius"}``; box and whisker ``{"label", "min", "first_quartile",
"median", "third_quartile", "max", "outliers"}``. A figure of several axes is a
``superchart`` whose elements are their charts. What the artists of an axes are decides
its type, as in E2B's extractor (github.com/e2b-dev/code-interpreter,
chart_data_extractor): lines only, scatter collections only, wedges only, rectangles only,
box patches with their lines; anything else is ``unknown`` (a title, no elements).

A figure is the user's and may be huge: extraction stops past MAX_CHART_VALUES values
(points, ticks, bars, wedges), MAX_CHART_TEXT_CHARS characters of text or MAX_SUBCHARTS
axes, and such a figure gets no chart (its PNG still travels). Nothing here raises into
the user's cell: a figure we cannot read gets no chart. Stdlib only at import, so a
kernel that never plots never imports matplotlib for us.
"""

from __future__ import annotations

import datetime
import math
import numbers
import re
import sys
from typing import Any

MIME = "e2b/chart"
#: Most values (a point counts 2, a tick 1, a bar, wedge or box 1) in one figure's chart:
#: its JSON stays under about a megabyte.
MAX_CHART_VALUES = 50_000
#: Most characters of titles, labels and tick labels in one figure's chart.
MAX_CHART_TEXT_CHARS = 64 * 1024
#: Most axes a figure's superchart describes.
MAX_SUBCHARTS = 16

_UNIT_RE = re.compile(r"\s\((.*?)\)|\[(.*?)\]")
_NO_LINE = ("None", "none", "", " ")
_SCALES = ("linear", "log", "symlog", "logit", "function", "functionlog", "asinh")

Chart = dict[str, Any]


class _TooBig(Exception):
    """The figure holds more than a chart may carry."""


class _Budget:
    def __init__(self) -> None:
        self.values = MAX_CHART_VALUES
        self.chars = MAX_CHART_TEXT_CHARS

    def take(self, values: int) -> None:
        self.values -= values
        if self.values < 0:
            raise _TooBig

    def text(self, value: object) -> str:
        text = str(value)
        self.chars -= len(text)
        if self.chars < 0:
            raise _TooBig
        return text


def figure_chart(figure: Any) -> Chart | None:
    """The chart of a matplotlib Figure, or None (no axes, past a bound, unreadable)."""
    try:
        return _figure(figure, _Budget())
    except Exception:  # _TooBig, or a figure our reading does not understand
        return None


def register(shell: Any) -> None:
    """Add the ``e2b/chart`` formatter to an IPython shell (None: not in IPython)."""
    if shell is None:
        return
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class ChartFormatter(BaseFormatter):  # type: ignore[misc]
        format_type = Unicode(MIME)
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict,)

        def __call__(self, obj: Any) -> Any:
            # Not a type printer: IPython's select_figure_formats pops Figure from every
            # formatter when the inline backend starts. Looked up in sys.modules, as a
            # Figure exists only once the user's code imported matplotlib.
            module = sys.modules.get("matplotlib.figure")
            if self.enabled and module is not None and isinstance(obj, module.Figure):
                return figure_chart(obj)
            return super().__call__(obj)

    shell.display_formatter.formatters[MIME] = ChartFormatter(parent=shell.display_formatter)


def _figure(figure: Any, budget: _Budget) -> Chart | None:
    axes = list(figure.get_axes())
    if not axes:
        return None
    if len(axes) == 1:
        return _axes_chart(axes[0], budget)
    if len(axes) > MAX_SUBCHARTS:
        raise _TooBig
    # get_suptitle() is matplotlib 3.8's; Debian 12 has 3.6.
    suptitle = getattr(figure, "_suptitle", None)
    title = suptitle.get_text() if suptitle is not None else ""
    return {
        "type": "superchart",
        "title": budget.text(title) if title else None,
        "elements": [_axes_chart(ax, budget) for ax in axes],
    }


def _axes_chart(ax: Any, budget: _Budget) -> Chart:
    kind = _kind(ax)
    if kind in ("line", "scatter"):
        chart = _point_chart(ax, kind, budget)
    elif kind == "bar":
        chart = _bar_chart(ax, budget)
    elif kind == "pie":
        chart = _base(ax, "pie", budget) | {"elements": _wedges(ax, budget)}
    elif kind == "box_and_whisker":
        chart = _box_chart(ax, budget)
    else:
        chart = _base(ax, "unknown", budget)
    return chart


def _kind(ax: Any) -> str:
    """The chart type its artists make (texts and reference lines do not count)."""
    from matplotlib.collections import PathCollection
    from matplotlib.patches import PathPatch, Rectangle, Wedge

    if getattr(ax, "name", "rectilinear") != "rectilinear":
        return "unknown"  # polar, 3D: no axes of the SDK's shapes
    lines = [line for line in ax.lines if _is_data(ax, line)]
    others = [*ax.collections, *ax.patches, *ax.images, *ax.tables, *ax.artists]
    if not others:
        return "line"
    if all(isinstance(p, PathPatch) for p in ax.patches) and ax.patches and not ax.collections:
        return "box_and_whisker" if not [*ax.images, *ax.tables, *ax.artists] else "unknown"
    if lines:
        return "unknown"
    for kind, cls in (("scatter", PathCollection), ("pie", Wedge), ("bar", Rectangle)):
        if all(isinstance(artist, cls) for artist in others):
            return kind
    return "unknown"


def _is_data(ax: Any, line: Any) -> bool:
    """A line drawn in data coordinates (axhline, axvline and the like are not)."""
    return bool(line.get_transform() == ax.transData)


def _base(ax: Any, kind: str, budget: _Budget) -> Chart:
    title = ax.get_title() or ax.get_title("left") or ax.get_title("right")
    return {"type": kind, "title": budget.text(title) if title else None, "elements": []}


def _base_2d(ax: Any, kind: str, budget: _Budget, *, swap: bool = False) -> Chart:
    chart = _base(ax, kind, budget)
    x_label, y_label = ax.get_xlabel() or None, ax.get_ylabel() or None
    if swap:  # horizontal bars or boxes: x names the categories, as E2B's charts do
        x_label, y_label = y_label, x_label
    for axis, label in (("x", x_label), ("y", y_label)):
        chart[f"{axis}_label"] = budget.text(label) if label else None
        chart[f"{axis}_unit"] = _unit(label)
    return chart


def _unit(label: str | None) -> str | None:
    match = _UNIT_RE.search(label) if label else None
    return (match.group(1) or match.group(2)) if match else None


def _point_chart(ax: Any, kind: str, budget: _Budget) -> Chart:
    chart = _base_2d(ax, kind, budget)
    for name, axis, scale in (("x", ax.xaxis, ax.get_xscale()), ("y", ax.yaxis, ax.get_yscale())):
        ticks = list(axis.get_majorticklocs())
        budget.take(2 * len(ticks))
        labels = axis.get_major_formatter().format_ticks(ticks)
        chart[f"{name}_ticks"] = [_tick(axis, tick) for tick in ticks]
        chart[f"{name}_tick_labels"] = [budget.text(label) for label in labels]
        chart[f"{name}_scale"] = _scale(axis, scale)
    if kind == "line":
        series = [
            (line.get_label(), line.get_xdata(), line.get_ydata())
            for line in ax.lines
            if _is_data(ax, line)
        ]
        default = "Line"
    else:
        series = [(c.get_label(), *_columns(c.get_offsets())) for c in ax.collections]
        default = "Series"
    chart["elements"] = [
        {"label": _series_label(label, default, index, budget), "points": _points(xs, ys, budget)}
        for index, (label, xs, ys) in enumerate(series)
    ]
    return chart


def _columns(offsets: Any) -> tuple[Any, Any]:
    if len(offsets) == 0:
        return [], []
    return offsets[:, 0], offsets[:, 1]


def _points(xs: Any, ys: Any, budget: _Budget) -> list[list[Any]]:
    count = min(len(xs), len(ys))
    budget.take(2 * count)  # before reading them: a huge series costs nothing more
    return [[_value(xs[i]), _value(ys[i])] for i in range(count)]


def _series_label(label: object, default: str, index: int, budget: _Budget) -> str:
    text = str(label)
    return f"{default} {index}" if not text or text.startswith("_") else budget.text(text)


def _tick(axis: Any, tick: float) -> Any:
    if _converter_module(axis) == "matplotlib.dates":
        from matplotlib.dates import num2date

        return num2date(tick).isoformat()
    return _value(tick)


def _scale(axis: Any, scale: str) -> str:
    module = _converter_module(axis)
    if module == "matplotlib.dates":
        return "datetime"
    if module == "matplotlib.category":
        return "categorical"
    return scale if scale in _SCALES else "unknown"


def _converter_module(axis: Any) -> str:
    converter = axis.get_converter() if hasattr(axis, "get_converter") else axis.converter
    return type(converter).__module__ if converter is not None else ""


def _value(value: Any) -> Any:
    """A JSON value of a data point: a finite number, a string, an ISO date; None for
    NaN and infinities (JSON has none)."""
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else None
    if isinstance(value, datetime.date):
        return value.isoformat()
    kind = type(value).__name__
    if kind == "datetime64":
        return str(value.astype("datetime64[s]"))
    if kind == "MaskedConstant":  # a masked point of a masked array: a gap
        return None
    return str(value)


def _bar_chart(ax: Any, budget: _Budget) -> Chart:
    from matplotlib.container import BarContainer

    containers = [c for c in ax.containers if isinstance(c, BarContainer)]
    budget.take(sum(len(c.patches) for c in containers))
    horizontal = (
        getattr(containers[0], "orientation", None) == "horizontal" if containers else False
    )
    chart = _base_2d(ax, "bar", budget, swap=horizontal)
    axis = ax.yaxis if horizontal else ax.xaxis
    names = _tick_names(axis, budget)
    for index, container in enumerate(containers):
        group = _series_label(container.get_label(), "Group", index, budget)
        for bar in container.patches:
            if horizontal:
                centre, value = bar.get_y() + bar.get_height() / 2, bar.get_width()
            else:
                centre, value = bar.get_x() + bar.get_width() / 2, bar.get_height()
            label = _name_at(names, centre, budget)
            chart["elements"].append({"label": label, "group": group, "value": _value(value)})
    return chart


def _tick_names(axis: Any, budget: _Budget) -> list[tuple[float, str]]:
    ticks = list(axis.get_majorticklocs())
    budget.take(len(ticks))
    labels = axis.get_major_formatter().format_ticks(ticks)
    return [(float(tick), budget.text(label)) for tick, label in zip(ticks, labels, strict=True)]


def _name_at(names: list[tuple[float, str]], position: float, budget: _Budget) -> str:
    """The tick label at ``position`` (a bar's or box's centre), else the number."""
    for tick, label in names:
        if math.isclose(tick, position, rel_tol=1e-9, abs_tol=1e-9):
            return label
    return budget.text(f"{position:g}")


def _wedges(ax: Any, budget: _Budget) -> list[dict[str, Any]]:
    budget.take(len(ax.patches))
    return [
        {
            "label": budget.text(wedge.get_label()),
            "angle": round(abs(wedge.theta2 - wedge.theta1), 6),
            "radius": _value(wedge.r),
        }
        for wedge in ax.patches
    ]


def _box_chart(ax: Any, budget: _Budget) -> Chart:
    """Boxes (``boxplot(patch_artist=True)``): a box patch spans the quartiles; a
    level line inside it is the median; a whisker runs from a quartile to min or max;
    fliers (markers, no line) are the outliers."""
    budget.take(len(ax.patches))
    spans = [_extent(patch.get_path().vertices) for patch in ax.patches]
    # Vertical boxes share their width; horizontal ones their height.
    horizontal = len({round(s[3] - s[2], 9) for s in spans}) == 1 and len(spans) > 1
    if horizontal:
        spans = [(y0, y1, x0, x1) for x0, x1, y0, y1 in spans]
    chart = _base_2d(ax, "box_and_whisker", budget, swap=horizontal)
    names = _tick_names(ax.yaxis if horizontal else ax.xaxis, budget)
    boxes = [
        {"span": span, "min": span[2], "max": span[3], "median": None, "outliers": []}
        for span in spans
    ]
    for line in ax.lines:
        budget.take(len(line.get_xdata()) + len(line.get_ydata()))  # before reading them
        xs, ys = [list(map(float, d)) for d in (line.get_xdata(), line.get_ydata())]
        if horizontal:
            xs, ys = ys, xs
        _place(boxes, line.get_linestyle() in _NO_LINE, xs, ys)
    for box in boxes:
        x0, x1, q1, q3 = box["span"]
        box.pop("span")
        box |= {"label": _name_at(names, (x0 + x1) / 2, budget)}
        box |= {"first_quartile": q1, "third_quartile": q3}
        chart["elements"].append(box)
    return chart


def _extent(vertices: Any) -> tuple[float, float, float, float]:
    xs, ys = [float(v[0]) for v in vertices], [float(v[1]) for v in vertices]
    return min(xs), max(xs), min(ys), max(ys)


def _place(boxes: list[dict[str, Any]], markers: bool, xs: list[float], ys: list[float]) -> None:
    """Give a box's line (median, whisker) or fliers to the box it lies over."""
    for box in boxes:
        x0, x1, q1, q3 = box["span"]
        if not xs or not all(x0 - 1e-9 <= x <= x1 + 1e-9 for x in xs):
            continue
        if markers:
            box["outliers"].extend(ys)
        elif len(ys) == 2 and math.isclose(ys[0], ys[1]) and q1 <= ys[0] <= q3:
            box["median"] = ys[0]
        elif len(ys) == 2 and math.isclose(xs[0], xs[1]):  # a whisker
            low, high = min(ys), max(ys)
            if math.isclose(high, q1) or high <= q1:
                box["min"] = low
            elif math.isclose(low, q3) or low >= q3:
                box["max"] = high
        return
