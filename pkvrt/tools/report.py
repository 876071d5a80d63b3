"""Turn a directory of results JSON files into a Markdown report, CSV appendices and PNG plots.

``pkvrt report RESULTS_DIR --out DIR`` reads every ``*.json`` directly in RESULTS_DIR (each must
be a pkvrt results file, ``{"meta": {...}, "rows": [...]}``; a malformed one is an error naming
it) and writes ``DIR/report.md``: a short header (what it is, the command that regenerates it, its
contents), then the seed paper's tables:

- Table 1, isolated kernels (benches/isolated.py): case, engine, µs, GB/s, fraction of the
  4.2 TB/s read floor, ratio against the case's baseline (FlashInfer's fastest correct decode
  path in the same file, marked "(baseline)");
- Table 2, serving (``pkvrt bench serving``): per trace and engine the selected route, CUDA and
  wall decode-token throughput ratios against the file's baseline row (mean ± sample std over
  seeds), and max / mean errors; then every FlashInfer path the baseline probe timed;
- Table 3, absolute serving throughput and ms per step; Table 4, structural counters;
- Table 5, hardware counters from ``kind: ncu`` files (benches/ncu_table5.sh);
- Table 6, coverage map: per isolated case and serving trace the best pkvrt engine, its ratio
  against FlashInfer and a verdict (CUDA-event and wall ratios separately);
- Table 7, split sensitivity of the ``calibration-sweeps`` files: time per split relative to
  the best split of each (case, engine);
- from the ``.steps.json`` files, per experiment (the case without its seed: trace, B, G, L, and
  ``-fp8`` for an FP8 KV cache): the engine protocol's read-floor fractions and per-step ratios,
  the throughput ratio by context length, and the adaptive engine's route map;
- whole-model (``kind: model-decode``) and tensor-parallel (``kind: tp-decode``) decode;
- the served models' shapes (``kind: model-shapes``), the drop-in wrapper (``kind: dropin``) and
  rows that share pages (``kind: shared-pages``): pkvrt/measure/coverage_results.py;
- every other file as its rows, and the list of the files read.

A table longer than 40 rows is summarised in report.md, with every row in a CSV appendix beside
it (``DIR/appendix-*.csv``, linked from the
summary); each experiment's per-step records with their ratios go to
``DIR/appendix-steps-<experiment>.csv``. The plots (``ratio_vs_context.png``, ``route_map.png``,
``steps_<engine>.png``, one panel per experiment) are drawn from the same numbers as the table
each follows. They need matplotlib (``pip install 'pkvrt[plots]'``); without it the command
fails before writing anything, so that a committed report keeps its plots, unless
``--no-plots`` asks for the tables only. One line per stage goes to stderr while it runs.

Ratios are only ever formed between rows of one file, and a (case, engine) measured in several
files counts once, from the newest file (``meta.date``).
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pkvrt.measure import coverage_results
from pkvrt.measure.model_results import KIND as MODEL_KIND, model_decode_table
from pkvrt.measure.tp_results import KIND as TP_KIND, tp_decode_table
# The names below are this module's public interface as well (benches, tests and bench.py use
# them from here); they live in report_data, report_tables and report_plots.
from pkvrt.tools.report_data import (  # noqa: F401
    FASTER, FLOOR_BYTES_PER_US, FLOOR_GBPS, NCU, NEAR_BEST, NUMERIC, SERVING_TIMES, SLOWER,
    STEP_KEYS, SWEEPS, baseline_text, bin_label, context_bin, engine_protocol_rows,
    engine_step_points, file_kind, fmt_pm, isolated_baseline, isolated_coverage,
    kv_element_bytes, load_dir, paired_steps, ratio_by_context, route_map_cells, serving_coverage,
    serving_groups, split_groups, split_sweeps, step_floor_us, step_records, trace_key, validate)
from pkvrt.tools.report_plots import plot_ratio_vs_context, plot_route_map, plot_step_ratios  # noqa: F401
from pkvrt.tools.report_tables import (  # noqa: F401
    COUNTERS, FP8_ERRORS_NOTE, NCU_COLUMNS, NO_COVERAGE, NO_SWEEPS, Table, baseline_probe_grid,
    baseline_probe_table, context_grid, context_summary_grid, context_table, counters_grid,
    counters_table, coverage_grid, coverage_table, engine_protocol_grid, engine_protocol_table,
    fmt_err, generic_grid, isolated_grids, isolated_table, md_table, ncu_engine, ncu_grid,
    ncu_table, neutral, raw_grid, route_map_grid, route_map_summary_grid, route_map_table,
    serving_grid, serving_table, split_grid, split_summary_grid, throughput_grid, throughput_table,
    verdict)

NO_MATPLOTLIB = ("the plots need matplotlib, which is not installed: pip install 'pkvrt[plots]' "
                 "(or pass --no-plots to write the tables only; nothing was written)")
PLOTS_OFF = "Plots not drawn (pkvrt report --no-plots)."
NO_STEPS = "No per-step records (.steps.json files) to plot."
MAX_ROWS = 40        # a longer table is summarised in report.md, every row in a CSV appendix
OTHER_COLUMNS = 12   # an other file with more columns than this goes to a CSV appendix whole
HANDLED = {"isolated", "serving", "serving-steps", "plan", NCU, MODEL_KIND, TP_KIND, *coverage_results.KINDS}

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def stderr_progress(message: str) -> None:
    """One progress line on stderr: ``pkvrt report: <message>``."""
    print(f"pkvrt report: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- outputs

def _file_stem(text: str) -> str:
    """A name safe in a file name and a Markdown link: runs of other characters become "-"."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "x"


def _link(name: str) -> str:
    return f"[{name}]({name})"


@dataclass
class Outputs:
    """What a report writes beside report.md, gathered while its sections are composed:
    ``appendices`` (file name -> :class:`Table`, written as CSV) and ``plots`` (file name ->
    a function drawing it into the path it is given); ``draw`` False leaves the plots out."""

    draw: bool = True
    appendices: dict = field(default_factory=dict)
    plots: dict = field(default_factory=dict)

    def appendix(self, stem: str, table: Table) -> str:
        """Keep ``table`` for ``appendix-<stem>.csv`` (a unique name); returns the file name."""
        base = f"appendix-{_file_stem(stem)}"
        name, n = f"{base}.csv", 1
        while name in self.appendices:
            n += 1
            name = f"{base}-{n}.csv"
        self.appendices[name] = table
        return name

    def plot(self, name: str, draw: Callable[[Path], None]) -> str:
        """Keep a plot to draw; returns its Markdown image link ("" when plots are off)."""
        self.plots[name] = draw
        return f"![{name}]({name})" if self.draw else ""


def place(table: Table, out: Outputs, stem: str, limit: int = MAX_ROWS, summary: Table | None = None,
          what: str = "") -> str:
    """A table's Markdown in report.md: the whole table when it has at most ``limit`` rows;
    else a line linking the CSV appendix that holds every row, then ``summary`` (``what`` says
    what it shows) or, without one, the first ``limit`` rows. The summary is cut to ``limit``
    rows too, so that report.md stays bounded."""
    if len(table) <= limit:
        return table.markdown()
    name = out.appendix(stem, table)
    shown = summary if summary is not None else table
    cut = f" (its first {limit} of {len(shown)} rows)" if len(shown) > limit else ""
    lead = (f"{len(table)} rows, all in {_link(name)}; below, " +
            (f"{what}{cut}." if summary is not None else f"the first {limit}."))
    return lead + "\n\n" + shown.markdown(shown.rows[:limit])


def write_csv(path: Path, table: Table) -> None:
    """``table`` as a CSV file: its header, then its rows."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(table.header)
        w.writerows(table.rows)


# --------------------------------------------------------------------------- sections

@dataclass
class Context:
    """A report's inputs and the per-step numbers that several sections share."""

    files: list
    out: Outputs
    by_ctx: list
    cells: list
    engine_rows: list
    steps: dict

    @classmethod
    def of(cls, files, out: Outputs) -> "Context":
        return cls(files, out, ratio_by_context(files), route_map_cells(files),
                   engine_protocol_rows(files), step_records(files))


def isolated_summary(table: Table) -> Table:
    """Table 1 of one file cut to its pkvrt rows and each case's baseline row."""
    rows = [r for r in table.rows if r[1].startswith("pkvrt") or r[1].endswith("(baseline)")]
    return Table(table.header, rows, table.align, table.notes)


def isolated_section(c: Context) -> str:
    parts = [f"{title}\n\n" + place(t, c.out, f"table-1-{Path(path).stem}", MAX_ROWS,
                                      isolated_summary(t), "the pkvrt rows and each case's baseline")
             for path, title, t in isolated_grids(c.files)]
    return "\n\n".join(parts)


def _grid_section(grid: Callable, stem: str) -> Callable[[Context], str]:
    def section(c: Context) -> str:
        t = grid(c.files)
        return place(t, c.out, stem, MAX_ROWS) if t.rows else ""
    return section


def coverage_section(c: Context) -> str:
    t = coverage_grid(c.files)
    return place(t, c.out, "coverage", MAX_ROWS) if t.rows else NO_COVERAGE


def split_section(c: Context) -> str:
    sweeps = split_sweeps(c.files)
    t = split_grid(sweeps)
    if not t.rows:
        return NO_SWEEPS
    return place(t, c.out, "split-sensitivity", MAX_ROWS, split_summary_grid(sweeps),
                 "per file and engine, a summary over its cases (the best split of each case is "
                 "marked \"best\" in the CSV)")


def engine_protocol_section(c: Context) -> str:
    if not c.engine_rows:
        return ""
    parts = [place(engine_protocol_grid(c.engine_rows), c.out, "engine-protocol", MAX_ROWS)]
    for engine in dict.fromkeys(r["engine"] for r in c.engine_rows):
        pts = engine_step_points(c.files, engine)
        if pts:
            parts.append(c.out.plot(f"steps_{engine}.png",
                                    lambda path, pts=pts, engine=engine: plot_step_ratios(pts, engine, path)))
    return "\n\n".join(p for p in parts if p)


def _step_appendices(c: Context) -> str:
    """Write each experiment's per-step records; returns the line linking them."""
    names = []
    for exp, records in c.steps.items():
        cols = tuple(records[0])
        name = c.out.appendix(f"steps-{exp}", Table(cols, [tuple(r[k] for k in cols) for r in records]))
        names.append(f"[{exp}]({name})")
    return "Every per-step record with its ratios, per experiment: " + ", ".join(names) + "."


def context_section(c: Context) -> str:
    if not c.by_ctx:
        return ""
    table = place(context_grid(c.by_ctx), c.out, "ratio-by-context", MAX_ROWS,
                  context_summary_grid(c.by_ctx), "one row per experiment and engine, the context "
                  "bins side by side")
    plot = c.out.plot("ratio_vs_context.png", lambda path: plot_ratio_vs_context(c.by_ctx, path))
    return "\n\n".join(p for p in (_step_appendices(c), table, plot) if p)


def route_map_section(c: Context) -> str:
    if not c.cells:
        return ""
    table = place(route_map_grid(c.cells), c.out, "route-map", MAX_ROWS,
                  route_map_summary_grid(c.cells), "one row per experiment and route")
    plot = c.out.plot("route_map.png", lambda path: plot_route_map(c.cells, path))
    return "\n\n".join(p for p in (table, plot) if p)


def model_section(c: Context) -> str:
    return neutral(model_decode_table(c.files))


def tp_section(c: Context) -> str:
    return neutral(tp_decode_table(c.files))


def model_shapes_section(c: Context) -> str:
    return neutral(coverage_results.model_shapes_table(c.files))


def dropin_section(c: Context) -> str:
    return neutral(coverage_results.dropin_table(c.files))


def shared_pages_section(c: Context) -> str:
    return neutral(coverage_results.shared_pages_table(c.files))


def generate_section(c: Context) -> str:
    return neutral(coverage_results.generate_table(c.files))


def _other_file(path, doc, out: Outputs) -> tuple[tuple, str]:
    """The overview row of one other file, and its table when it is shown in report.md ("")."""
    name, grid = Path(path).name, generic_grid(doc)
    small = len(grid) <= MAX_ROWS and len(grid.header) <= OTHER_COLUMNS
    where = "below" if small else _link(out.appendix(f"file-{Path(path).stem}", raw_grid(doc)))
    row = (name, file_kind(doc), len(grid), len(grid.header), where)
    return row, (f"### {name}\n\n" + (grid.markdown() if grid.rows else "(no rows)")) if small else ""


def other_section(c: Context) -> str:
    others = [(p, d) for p, d in c.files if file_kind(d) not in HANDLED]
    if not others:
        return ""
    rows, shown = zip(*(_other_file(p, d, c.out) for p, d in others))
    overview = Table(("File", "Kind", "Rows", "Columns", "Shown"), list(rows), "llrrl")
    intro = (f"Files of a kind without a table of its own, as their rows: up to {MAX_ROWS} rows "
             f"and {OTHER_COLUMNS} columns below, larger ones in a CSV appendix each.")
    return "\n\n".join([intro, overview.markdown(), *(s for s in shown if s)])


def _short_commit(commit: str) -> str:
    return re.sub(r"^([0-9a-f]{7})[0-9a-f]{33}", r"\1", commit)


def _span_text(values: list[str]) -> str:
    vals = sorted(v for v in values if v)
    if not vals:
        return "-"
    return vals[0] if vals[0] == vals[-1] else f"{vals[0]} to {vals[-1]}"


def files_grid(files) -> Table:
    """One row per results file read: its kind, GPU, date, commit and number of rows."""
    rows = [(Path(p).name, file_kind(d), d["meta"].get("gpu") or "-", d["meta"].get("date") or "-",
             _short_commit(str(d["meta"].get("pkvrt_commit") or "-")), len(d["rows"])) for p, d in files]
    return Table(("File", "Kind", "GPU", "Date", "Commit", "Rows"), rows, "lllllr")


def files_by_kind_grid(files) -> Table:
    """The files read, one row per kind: the files, their GPUs, dates and commits."""
    by: dict[str, list[tuple[str, dict]]] = collections.OrderedDict()
    for path, doc in files:
        by.setdefault(file_kind(doc), []).append((Path(path).name, doc["meta"]))
    rows = []
    for kind, entries in by.items():
        metas = [m for _, m in entries]
        commits = dict.fromkeys(_short_commit(str(m.get("pkvrt_commit") or "-")) for m in metas)
        rows.append((kind, len(entries), ", ".join(n for n, _ in entries),
                     ", ".join(dict.fromkeys(str(m.get("gpu") or "-") for m in metas)),
                     _span_text([str(m.get("date") or "")[:10] for m in metas]), ", ".join(commits)))
    return Table(("Kind", "Count", "Files", "GPU", "Dates", "Commits"), rows, "lrllll")


def files_section(c: Context) -> str:
    return place(files_grid(c.files), c.out, "files", MAX_ROWS, files_by_kind_grid(c.files),
                 "one row per kind")


SECTIONS: list[tuple[str, Callable[[Context], str]]] = [
    (f"Table 1: isolated decode attention (best split per engine; fraction of the "
     f"{FLOOR_GBPS / 1e3:g} TB/s read floor)", isolated_section),
    ("Table 2: serving throughput against the baseline (mean ± std over seeds)",
     _grid_section(serving_grid, "serving")),
    ("Baseline probe: every FlashInfer decode path per serving run",
     _grid_section(baseline_probe_grid, "baseline-probe")),
    ("Table 3: absolute serving throughput (mean ± std over seeds; the -mlp cases are the "
     "model-level proxy)", _grid_section(throughput_grid, "throughput")),
    ("Table 4: structural counters, mean per step", _grid_section(counters_grid, "counters")),
    ("Table 5: hardware counters (Nsight Compute)", _grid_section(ncu_grid, "ncu")),
    ("Table 6: coverage map (from the measured results)", coverage_section),
    ("Table 7: split sensitivity (calibration seed sweeps)", split_section),
    (f"Engine protocol: fraction of the read floor (KV bytes at {FLOOR_GBPS / 1e3:g} TB/s) and "
     "per-step ratios", engine_protocol_section),
    ("Throughput ratio by longest context (per-step records, per experiment)", context_section),
    ("Route map of the adaptive engine (per-step records, per experiment)", route_map_section),
    ("Whole-model decode (Llama-3-8B shape, one CUDA graph per step): ms/step, tokens/s, "
     "attention share", model_section),
    ("Tensor-parallel decode (Llama-3-8B shape, TP ranks, one CUDA graph per rank and step): "
     "ms/step, tokens/s, scaling efficiency, attention and all-reduce shares", tp_section),
    ("Served models' shapes in the engine protocol (the whole step in one graph) against "
     "FlashInfer's fastest correct path per layer kind", model_shapes_section),
    ("The drop-in wrapper called as engines call FlashInfer's (CUDA-graph mode)", dropin_section),
    ("Rows that share pages: each row reading its pages, and each shared run read once per "
     "chunk of rows", shared_pages_section),
    ("A real checkpoint generating text with its decode attention through each decoder "
     "(greedy tokens against SDPA's)", generate_section),
    ("Other results", other_section),
    ("Results files read", files_section),
]


def compose(c: Context, progress: Progress = _quiet) -> list[tuple[str, str]]:
    """(title, Markdown body) of every section with something to show, in report order; one
    progress line per section."""
    out = []
    for i, (title, section) in enumerate(SECTIONS, 1):
        progress(f"section {i}/{len(SECTIONS)}: {title.split(' (')[0]}")
        body = section(c)
        if body:
            out.append((title, body))
    return out


# --------------------------------------------------------------------------- header

def anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to "-"."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def header(files, sections: list[tuple[str, str]], *, source: str, command: str,
           notes: list[str]) -> str:
    """The report's opening: what it is, how to regenerate it, its contents."""
    gpus = ", ".join(dict.fromkeys(str(d["meta"].get("gpu")) for _, d in files if d["meta"].get("gpu")))
    dates = _span_text([str(d["meta"].get("date") or "")[:10] for _, d in files])
    what = (f"The tables and plots of the {len(files)} pkvrt results files (`*.json`) in `{source}`"
            + (f", measured on {gpus}" if gpus else "") + (f", {dates}" if dates != "-" else "")
            + ". Ratios are only formed between rows of one file, and a (case, engine) measured in "
            f"several files counts once, from the newest. A table longer than {MAX_ROWS} rows is "
            "summarised here, with every row in a CSV appendix beside this file; each plot follows "
            "the table it illustrates.")
    toc = "\n".join(f"- [{title.split(' (')[0]}](#{anchor(title)})" for title, _ in sections)
    return "\n\n".join(["# pkvrt results report", what, f"Regenerate: `{command}`", *notes,
                        "Contents:", toc])


# --------------------------------------------------------------------------- the report

def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _note(c: Context, draw: bool) -> str:
    if not c.by_ctx and not c.cells:
        return NO_STEPS
    return "" if draw else PLOTS_OFF


def write_outputs(out_dir: Path, outputs: Outputs, progress: Progress = _quiet) -> list[str]:
    """Draw the plots (when ``outputs.draw``) and write the CSV appendices into ``out_dir``;
    returns the plot files drawn."""
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = []
    for name, draw in outputs.plots.items() if outputs.draw else ():
        progress(f"plot: {name}")
        draw(out_dir / name)
        drawn.append(name)
    for name, table in outputs.appendices.items():
        progress(f"appendix: {name} ({len(table)} rows)")
        write_csv(out_dir / name, table)
    return drawn


def build_report(files, out_dir: Path, *, plots: bool = True, source: str | None = None,
                 command: str | None = None, progress: Progress = _quiet) -> tuple[str, list[str]]:
    """The report's Markdown and the notes the command prints; writes its plots and CSV
    appendices into ``out_dir`` (not report.md itself).

    Parameters
    ----------
    files : list of (str, dict)
        The results files, as :func:`load_dir` returns them.
    out_dir : Path
        Where the plots and appendices go (created when needed).
    plots : bool
        Draw the plots and link them (False: tables only, no matplotlib needed).
    source, command : str, optional
        The results directory and the command that regenerates the report, as the header names
        them (default: the files' folder and ``pkvrt report <it> --out <out_dir>``).
    progress : callable, optional
        Called with one line per stage (each table, plot and appendix).

    Raises
    ------
    ValueError
        Before writing anything, when there are per-step records to plot, ``plots`` is True
        and matplotlib is not installed.
    """
    source = source or str(Path(files[0][0]).parent)
    command = command or f"pkvrt report {source} --out {out_dir}" + ("" if plots else " --no-plots")
    c = Context.of(files, Outputs(draw=plots))
    if plots and (c.by_ctx or c.cells) and not _have_matplotlib():
        raise ValueError(NO_MATPLOTLIB)
    sections = compose(c, progress)
    note = _note(c, plots)
    drawn = write_outputs(out_dir, c.out, progress)
    notes = [note] if note else []
    if drawn:
        notes.append("wrote plots: " + ", ".join(drawn))
    if c.out.appendices:
        notes.append(f"wrote {len(c.out.appendices)} CSV appendices (appendix-*.csv)")
    head = header(files, sections, source=source, command=command, notes=[note] if note else [])
    body = [f"## {title}\n\n{text}" for title, text in sections]
    return "\n\n".join([head, *body]) + "\n", notes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``pkvrt report``."""
    parser.add_argument("results_dir", metavar="RESULTS_DIR",
                        help="directory of results JSON files (pkvrt bench, benches/isolated.py); "
                             "its *.json files are read, not its subfolders")
    parser.add_argument("--out", metavar="DIR",
                        help="where report.md, its CSV appendices and the plots go (default: "
                             "RESULTS_DIR/report)")
    parser.add_argument("--no-plots", action="store_true",
                        help="write report.md with the tables only (no matplotlib needed); plot "
                             "files already in DIR are left as they are, without links")


def regenerate_command(args: argparse.Namespace) -> str:
    """The ``pkvrt report`` command line of ``args``, as the report's header shows it."""
    words = ["pkvrt", "report", args.results_dir] + (["--out", args.out] if args.out else []) \
        + (["--no-plots"] if args.no_plots else [])
    return " ".join(shlex.quote(str(w)) for w in words)


def run(args: argparse.Namespace) -> int:
    """``pkvrt report``: write DIR/report.md, its appendices and plots; returns 0."""
    files = load_dir(args.results_dir, progress=stderr_progress)
    out = Path(args.out) if args.out else Path(args.results_dir) / "report"
    text, notes = build_report(files, out, plots=not args.no_plots, source=args.results_dir,
                               command=regenerate_command(args), progress=stderr_progress)
    stderr_progress(f"writing {out / 'report.md'} ({text.count(chr(10))} lines)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text, encoding="utf-8")
    print(f"read {len(files)} results file(s) from {args.results_dir}")
    for n in notes:
        print(n)
    print(f"wrote {out / 'report.md'}")
    return 0
