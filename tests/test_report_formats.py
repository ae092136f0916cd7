"""`sweep report --format md|csv|html` and `--out DIR`: every format shows the Report's own
numbers (nothing refitted), and the PNGs really show points, fits, bands and extrapolations."""

from __future__ import annotations

import base64
import csv
import io
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from analysis.report import plots
from analysis.report.build import Report, ReportOptions, build_report
from analysis.report.render import CSV_FIXED, render_csv, render_html, render_markdown, to_json_dict
from launcher.cli import cli
from conftest import paper_sweep
from store import Store

ROOT = Path(__file__).resolve().parents[1]
COMPUTE = np.linspace(0, 16000, 41)  # GPU-hours; the first eval is at compute 0
OPTIONS = ReportOptions(n_boot=30, fit_until=8000, predict_at=16000)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Two of Table 1's configurations (two seeds each) and one collapsing run."""
    url = f"sqlite:///{tmp_path_factory.mktemp('formats') / 'sweeps.db'}"
    store = Store(url)
    paper_sweep(store, COMPUTE, ("scalerl", "scout"), rng_seed=3, collapse_tail=10)
    store.close()
    return url


@pytest.fixture(scope="module")
def report(db: str) -> Report:
    store = Store(db)
    try:
        return build_report(store, "paper", OPTIONS)
    finally:
        store.close()


def _sweep(db: str, *args: str) -> str:
    result = CliRunner().invoke(cli, ["--db", db, "report", "paper", *args], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


# ---------------------------------------------------------------------------------------------
# md, csv, html contents


def test_markdown_tables_show_the_reports_numbers(report):
    md = render_markdown(report)
    rows = {line.split(" | ")[1]: line for line in md.splitlines() if re.match(r"\| (\d+|-) \| ", line)}
    assert set(rows) == {"scout", "scalerl", "collapse"}
    for c in report.configs:
        row = rows[c.axes["variant"]]
        assert f"| {c.rank or '-'} |" in row
        assert f"{c.fit.A:.3f} ({c.boot.A.lo:.3f}-{c.boot.A.hi:.3f})" in row
        assert f"{c.fit.B:.2f} ({c.boot.B.lo:.2f}-{c.boot.B.hi:.2f})" in row
        assert f"{c.extrapolation.predicted:.3f}" in row
    assert "collapsing" in rows["collapse"]
    assert "## Comparisons" in md and report.comparisons[0].rule in md
    effect = report.effects[0]
    assert f"| {effect.axis} | {effect.verdict} | {effect.max_delta_A:.3f} |" in md


def test_csv_has_one_row_per_configuration_with_the_reports_exact_numbers(report):
    reader = csv.DictReader(io.StringIO(render_csv(report)))
    assert reader.fieldnames == [*CSV_FIXED[:2], "variant", *CSV_FIXED[2:]]
    rows = list(reader)
    expected = to_json_dict(report)["runs"]
    assert len(rows) == len(expected) == 3
    for row, want in zip(rows, expected):
        assert row["variant"] == want["axes"]["variant"] and row["label"] == want["label"]
        assert row["rank"] == ("" if want["rank"] is None else str(want["rank"]))
        for name in ("A", "B", "Cmid", "R0", "r2", "sse"):
            assert float(row[name]) == want[name]
        for name in ("A", "B", "Cmid"):
            assert [float(row[f"{name}_lo"]), float(row[f"{name}_hi"])] == want["intervals"][name]
        assert int(row["n_points"]) == want["n_points"]
        assert row["seeds"].split(";") == [str(s) for s in want["seeds"]]
        assert row["run_ids"].split(";") == want["run_ids"]
        assert (row["flags"].split(";") if row["flags"] else []) == want["flags"]
        e = want["extrapolation"]
        assert float(row["predicted"]) == e["predicted"] and float(row["observed"]) == e["observed"]
        assert [float(row["predicted_lo"]), float(row["predicted_hi"])] == e["band"]
        assert row["within_band"] == str(e["within_band"]).lower()


def test_csv_leaves_unknown_numbers_empty_and_renames_a_clashing_axis(report):
    config = replace(report.configs[0], axes={"rank": 7}, boot=None, extrapolation=None)
    reader = csv.DictReader(io.StringIO(render_csv(replace(report, configs=(config,)))))
    (row,) = list(reader)
    assert row["axis:rank"] == "7" and row["rank"] == "1"
    assert row["A_lo"] == row["A_hi"] == row["predicted"] == row["within_band"] == ""


def test_html_is_one_self_contained_page_with_the_table_and_every_plot(report):
    rendered = plots.render_plots(report)
    page = render_html(report, rendered)
    assert page.startswith("<!DOCTYPE html>") and '<table id="fits">' in page
    for url in re.findall(r'(?:src|href)="([^"]*)"', page):
        assert url.startswith(("data:image/png;base64,", "#")), f"external URL {url:.40}"
    assert "<script" not in page and "<link" not in page and "url(" not in page and "@import" not in page
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == len(rendered) == len(report.configs) + 1  # + the axis `variant`
    assert [base64.b64decode(data) for data in images] == [p.png for p in rendered]
    for c in report.configs:
        assert f"{c.fit.A:.3f} ({c.boot.A.lo:.3f}-{c.boot.A.hi:.3f})" in page
    assert page.count('<tr class="flagged">') == 1 and '<table id="effects">' in page
    for href in re.findall(r'href="#([^"]+)"', page):
        assert f'id="{href}"' in page, f"the table links to a missing plot {href}"


# ---------------------------------------------------------------------------------------------
# the CLI and --out


@pytest.mark.parametrize(("fmt", "file_name"), [("md", "report.md"), ("csv", "report.csv"), ("json", "report.json"),
                                                ("html", "report.html"), ("table", None)])  # fmt: skip
def test_out_writes_the_plots_and_the_report_file(db, tmp_path, fmt, file_name):
    out = tmp_path / "out"
    output = _sweep(db, "--format", fmt, "--out", str(out), "--bootstrap", "20")
    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == [
        "axis-variant.png", "fit-001-variant=scout.png", "fit-002-variant=scalerl.png", "fit-003-variant=collapse.png"
    ]  # fmt: skip
    for png in pngs:
        assert png.read_bytes().startswith(PNG_SIGNATURE) and png.stat().st_size > 10_000
        image = imread(png)
        assert image.shape[:2] == (500, 800) and image[..., :3].std() > 0.05
    files = {p.name for p in out.iterdir()} - {p.name for p in pngs}
    assert files == ({file_name} if file_name else set())
    assert f"wrote {file_name + ' and ' if file_name else ''}4 plots into {out}" in output
    if fmt == "json":
        assert json.loads((out / "report.json").read_text())["sweep"] == "paper"
    if fmt == "table":
        assert "scout" in output and "Effects of each axis" in output


@pytest.mark.parametrize("fmt", ["md", "csv", "html"])
def test_without_out_the_report_goes_to_stdout(db, fmt):
    output = _sweep(db, "--format", fmt, "--bootstrap", "0")
    first = {"md": "# sweep paper", "csv": "rank,label,variant,", "html": "<!DOCTYPE html>"}[fmt]
    assert output.startswith(first) and "scout" in output


def test_the_cli_does_not_import_matplotlib_until_it_plots():
    code = "import sys, launcher.cli, analysis.report.render, analysis.report.plots; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------
# what the plots show


def _config(report: Report, variant: str):
    return next(c for c in report.configs if c.axes["variant"] == variant)


def _rgba(figure) -> np.ndarray:
    return imread(io.BytesIO(plots.to_png(figure)))


def _pixels(rgba: np.ndarray, color: str, alpha: float = 1.0) -> int:
    """Pixels showing `color` drawn at `alpha` over white."""
    target = 1.0 - alpha * (1.0 - np.asarray(to_rgb(color)))
    return int((np.abs(rgba[..., :3] - target) < 0.03).all(axis=-1).sum())


def test_a_configuration_plot_shows_each_seeds_points_the_fit_and_its_band(report):
    config = _config(report, "scalerl")
    figure = plots.config_figure(config, report.compute)
    ax = figure.axes[0]
    assert ax.get_xscale() == "log"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[:2] == [f"seed {c.seed} ({c.run})" for c in config.curves]
    seeds = [c for c in ax.collections if c.get_label().startswith("seed")]
    assert [len(s.get_offsets()) for s in seeds] == [len(COMPUTE) - 1] * 2  # compute 0 is drawn apart
    assert len({tuple(s.get_paths()[0].vertices.round(3).ravel()) for s in seeds}) == 2, "a marker per seed"
    (fit_line,) = [line for line in ax.get_lines() if line.get_label().startswith("fit: A=")]
    x, y = fit_line.get_data()
    np.testing.assert_allclose(y, config.fit.predict(x))
    band = next(c for c in ax.collections if c.get_label() == "95% band")
    band_y = band.get_paths()[0].vertices[:, 1]
    lo, hi = config.boot.band(x)
    assert band_y.min() == pytest.approx(lo.min(), abs=1e-9) and band_y.max() == pytest.approx(hi.max(), abs=1e-9)
    rgba = _rgba(figure)
    assert _pixels(rgba, plots.FIT_COLOR) > 150, "the fitted curve is drawn"
    assert _pixels(rgba, plots.FIT_COLOR, plots.BAND_ALPHA) > 500, "the band is drawn"
    for color in plots.SEED_COLORS[:2]:
        assert _pixels(rgba, color, plots.POINT_ALPHA) > 30, "each seed's points are drawn"


def test_the_extrapolation_is_solid_to_c1_dashed_beyond_with_prediction_and_observation(report):
    config = _config(report, "scout")
    e = config.extrapolation
    ax = plots.config_figure(config, report.compute).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    solid, dashed = lines["fit up to C1=8,000"], lines["its extrapolation"]
    assert solid.get_linestyle() == "-" and solid.get_xdata().max() == pytest.approx(e.fit_until)
    assert dashed.get_linestyle() == "--" and dashed.get_xdata().min() == pytest.approx(e.fit_until)
    assert dashed.get_xdata().max() >= e.predict_at
    observed = next(line for name, line in lines.items() if name.startswith("observed"))
    assert (observed.get_xdata()[0], observed.get_ydata()[0]) == (e.predict_at, pytest.approx(e.observed))
    (bar,) = ax.containers
    assert bar.lines[0].get_ydata()[0] == pytest.approx(e.predicted)
    segment = bar.lines[2][0].get_segments()[0]
    assert (segment[0][1], segment[1][1]) == (pytest.approx(e.band.lo), pytest.approx(e.band.hi))


def test_points_at_compute_zero_sit_on_the_left_edge_with_a_note(report):
    config = _config(report, "scalerl")
    ax = plots.config_figure(config, report.compute).axes[0]
    left = ax.get_xlim()[0]
    assert left == pytest.approx(COMPUTE[1] / 2)
    edge = [c for c in ax.collections if c.get_offsets().shape[0] == 1 and c.get_offsets()[0][0] == left]
    assert len(edge) == 2, "one step-0 point per seed, on the left edge"
    assert plots.ZERO_NOTE in [t.get_text() for t in ax.texts]


def test_flagged_fits_are_marked_on_their_plot_and_on_the_axis_plot(report):
    collapse = _config(report, "collapse")
    ax = plots.config_figure(collapse, report.compute).axes[0]
    assert "flagged: collapsing (not ranked)" in [t.get_text() for t in ax.texts]
    assert {s.get_edgecolor()[:3] for s in ax.spines.values()} == {to_rgb(plots.FLAG_COLOR)}
    clean = plots.config_figure(_config(report, "scout"), report.compute).axes[0]
    assert not any(t.get_text().startswith("flagged") for t in clean.texts)
    axis = plots.axis_figure(report, "variant").axes[0]
    styles = [line.get_linestyle() for line in axis.get_lines() if len(line.get_xdata())]
    assert sorted(styles) == ["-", "-", ":"]


def test_the_axis_plot_colours_every_configuration_by_its_value(report):
    ax = plots.axis_figure(report, "variant").axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["variant=scout", "variant=scalerl", "variant=collapse", "dotted: flagged fit"]
    curves = [line for line in ax.get_lines() if len(line.get_xdata())]
    assert len({line.get_color() for line in curves}) == 3
    assert "moves: asymptote" in ax.get_title(loc="left")
    assert plots.plot_axes(report) == ["variant"]


def test_plots_drawn_in_a_process_pool_are_those_drawn_in_turn(report):
    many = replace(report, configs=report.configs * 3)  # 9 configurations: above the pool's threshold
    serial, pooled = plots.render_plots(many, workers=1), plots.render_plots(many, workers=2)
    assert [p.name for p in pooled] == [p.name for p in serial] and len({p.name for p in pooled}) == 10
    assert [p.png for p in pooled] == [p.png for p in serial]
