"""``pkvrt``: the command line. ``pkvrt <command> --help`` describes each command.

Every command lives in a module with ``add_arguments(parser)`` and ``run(args) -> int``; this
file only wires them up. ``routes`` is defined here, ``doctor`` in pkvrt/tools/doctor.py, and
``plan``, ``bench``, ``calibrate``, ``report`` in their own modules, imported when the parser is
built; a command whose module is absent from this build is left out. A ValueError or OSError
from a command (every pkvrt error class, e.g. RoutesError, subclasses ValueError) prints
``pkvrt: error: <message>`` on stderr and exits 2; ``--traceback`` shows the traceback instead.
A warning prints one line, ``pkvrt: warning: <message>`` (only here: library users keep Python's
format). A closed stdout (``pkvrt plan | head``) ends the command quietly with status 0.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import sys
import warnings

import pkvrt
from pkvrt._buildspec import HEAD_DIMS, PAGE_SIZES
from pkvrt.policy import registry

# Subcommand -> module, in the order `pkvrt --help` lists them.
COMMANDS = {
    "routes": __name__,
    "plan": "pkvrt.tools.plan_cmd",
    "bench": "pkvrt.tools.bench",
    "calibrate": "pkvrt.tools.calibrate",
    "report": "pkvrt.tools.report",
    "doctor": "pkvrt.tools.doctor",
}


def _optional_module(name: str):
    """The module, or None if exactly that module does not exist (any other error propagates,
    including a missing module that it imports)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pkvrt", description="Paged-KV decode-attention runtime: routes, plans, benches.")
    parser.add_argument("--version", action="version",
                        version=f"pkvrt {getattr(pkvrt, '__version__', 'unknown')}")
    parser.add_argument("--traceback", action="store_true",
                        help="on an error show the Python traceback instead of one line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, modname in COMMANDS.items():
        module = sys.modules[__name__] if modname == __name__ else _optional_module(modname)
        if module is None:
            continue
        doc = (module.__doc__ or "").strip()
        if name == "routes":
            doc = _routes_doc
        p = sub.add_parser(name, help=doc.splitlines()[0] if doc else None, description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``pkvrt`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    argv = _bench_mode(list(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, argparse printed it)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            rc = int(args._run(args) or 0)
            sys.stdout.flush()          # a closed stdout shows up here, not at interpreter exit
            return rc
        except BrokenPipeError:
            _stdout_to_devnull()
            return 0
        except (ValueError, OSError) as e:
            if args.traceback:
                raise
            print(f"pkvrt: error: {e}", file=sys.stderr)
            return 2


def _bench_mode(argv: list[str]) -> list[str]:
    """``pkvrt bench [OPTIONS]`` -> ``pkvrt bench serving [OPTIONS]`` (pkvrt/tools/bench.py's rule)."""
    i = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)  # the COMMAND
    if i is None or argv[i] != "bench":
        return argv
    bench = _optional_module(COMMANDS["bench"])
    return argv if bench is None else [*argv[:i + 1], *bench.default_mode(argv[i + 1:])]


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` while a command runs: ``pkvrt: warning: <message>`` on one line
    (the message's own ``pkvrt: `` prefix dropped), no file, line number or source line."""
    text = str(message).removeprefix("pkvrt: ")
    print(f"pkvrt: warning: {text}", file=file or sys.stderr)


def _stdout_to_devnull() -> None:
    """After a BrokenPipeError: point stdout at devnull so that the flush at exit cannot fail
    again (https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout has no file descriptor (captured in-process)
        pass


# ---- pkvrt routes --------------------------------------------------------------------------

_routes_doc = """Show the route registry (routes.toml) as a table.

With --active, --context and --group it also says, per route, whether a step of that shape
passes the route's gates (or why not) and the promotion margin the route would have to clear."""


def _int_at_least(text: str, least: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value}: expected {expected}")
    return value


def positive_int(text: str) -> int:
    """argparse type: a positive integer (shared by the subcommands)."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (a seed)."""
    return _int_at_least(text, 0, "a non-negative integer")


def add_shape_arguments(parser: argparse.ArgumentParser):
    """The attention-shape options every subcommand shares (seed shape as defaults)."""
    shape = parser.add_argument_group("shape")
    shape.add_argument("--num-qo-heads", type=positive_int, default=32, metavar="H",
                       help="query heads H_q (default: 32)")
    shape.add_argument("--num-kv-heads", type=positive_int, default=8, metavar="H",
                       help="K/V heads H_kv; H_q / H_kv is the group size (default: 8)")
    shape.add_argument("--head-dim", type=positive_int, default=128, metavar="D",
                       help=f"head dimension, one of {', '.join(map(str, HEAD_DIMS))} (default: 128)")
    shape.add_argument("--page-size", type=positive_int, default=16, metavar="P",
                       help=f"tokens per KV page, a power of two <= {max(PAGE_SIZES)} (default: 16)")
    return shape


SHAPE_FLAGS = {"num_qo_heads": "--num-qo-heads", "num_kv_heads": "--num-kv-heads",
               "head_dim": "--head-dim", "page_size": "--page-size"}


def check_shape_arguments(args: argparse.Namespace, dtype=None) -> None:
    """Refuse the shapes the Runtime refuses, by its own rule (``pkvrt.runtime.check_shape``),
    naming the flags: "Runtime: page_size=3: expected a power of two <= 64" becomes
    "--page-size 3: expected a power of two <= 64". ``dtype``: a torch dtype (default fp16)."""
    import torch

    from pkvrt.runtime import check_shape

    try:
        check_shape(args.num_qo_heads, args.num_kv_heads, args.head_dim, args.page_size,
                    dtype or torch.float16)
    except ValueError as e:
        names = "|".join(SHAPE_FLAGS)      # page_size=3 -> --page-size 3, head_dim -> --head-dim
        text = re.sub(rf"\b({names})(=?)", lambda m: SHAPE_FLAGS[m[1]] + (" " if m[2] else ""),
                      str(e).removeprefix("Runtime: "))
        raise ValueError(text) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``pkvrt routes``."""
    parser.add_argument("--routes", metavar="PATH",
                        help=f"routes.toml to show (default: {registry.default_routes_path()})")
    shape = parser.add_argument_group("explain one step (give all three)")
    shape.add_argument("--active", type=positive_int, metavar="N", help="active rows")
    shape.add_argument("--context", type=positive_int, metavar="TOKENS",
                       help="longest context in the step (tokens)")
    shape.add_argument("--group", type=positive_int, metavar="G", help="group size H_q / H_kv")


def run(args: argparse.Namespace) -> int:
    """``pkvrt routes``: print the registry, and the verdict per route for one step if asked."""
    shape = {"--active": args.active, "--context": args.context, "--group": args.group}
    given = [flag for flag, v in shape.items() if v is not None]
    if given and len(given) != len(shape):
        raise ValueError(f"routes: --active, --context and --group go together; "
                         f"got only {', '.join(given)}")
    reg = registry.load_routes(args.routes)
    print(format_registry(reg))
    if given:
        print()
        print(format_step(reg, active=args.active, max_context=args.context, group=args.group))
    return 0


def format_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Left-aligned columns separated by two spaces."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in [header, *rows])


def _splits_text(s: registry.SplitBounds | None) -> str:
    """min 1, max 64, multiple_of 4 -> "1, 4..64 step 4"; every count (multiple_of 1) -> "1..64"."""
    if s is None:
        return "-"
    c = s.candidates()
    if len(c) > 1 and s.multiple_of == 1:
        return f"{c[0]}..{c[-1]}"
    ones, rest = ("1",) if c[0] == 1 else (), [x for x in c if x > 1]
    span = (f"{rest[0]}..{rest[-1]} step {s.multiple_of}" if len(rest) > 1
            else str(rest[0]) if rest else None)
    return ", ".join([*ones, *([span] if span else [])])


def _state(r: registry.Route) -> str:
    if r.kind == "flashinfer":
        return "baseline"
    return ", ".join(["enabled" if r.enabled else "disabled", *(["ablation"] if r.ablation else [])])


def _device_planning(reg: registry.Registry, r: registry.Route) -> str:
    """The steps device planning runs ``r`` on ("every step", "rows > 1", "rows <= 1",
    "G >= 5, rows > 1", "G < 5, rows > 1"), or "-"."""
    try:
        main = reg.device_planning_route().name
    except KeyError:                    # no workqueue or fused route: no device planning
        return "-"
    small, large = reg.device_small, reg.device_large_group
    more = f"rows > {small[0]}" if small else ""
    roles = [(f"rows <= {small[0]}", small[1])] if small else []
    short = reg.device_large_group_min_window
    if large:
        unless = f", no window < {short} tokens" if short else ""
        roles.append((", ".join(filter(None, (f"G >= {large[0]}{unless}", more))), large[1]))
    rest = (f"G < {large[0]}" + (f" or a window < {short} tokens" if short else "")) if large else ""
    roles.append((", ".join(filter(None, (rest, more))) or "every step", main))
    return "; ".join(text for text, name in roles if name == r.name) or "-"


def _device_planning_note(reg: registry.Registry) -> str:
    """What the "device planning" column means, and which table of routes.toml sets it."""
    where = ("[device_planning] in routes.toml" if reg.device_route is not None else
             "no [device_planning] table: the first non-ablation workqueue or fused route")
    return (f"device planning (lengths on the GPU) and engine-captured steps run the routes "
            f"of the column 'device planning' ({where}), with no host routing: the gates, margins "
            "and the ablation flag are the host router's\n"
            "ablation: the host router never picks the route on its own; it runs there only when "
            "forced by name (Runtime.plan(force=...), pkvrt bench --engines ROUTE)")


def format_registry(reg: registry.Registry) -> str:
    """The registry as an aligned text table plus the boundary rule, path and sha256."""
    rows = []
    for r in reg.routes:
        base = r.kind == "flashinfer"
        g = r.gates
        bucketing = r.bucketing if r.kind == "bucket" else "-"
        if r.coarse_lengths:
            bucketing += f" (coarse: {', '.join(map(str, r.coarse_lengths))})"
        rows.append((r.name, r.kind, r.kernel or "-", _state(r), _device_planning(reg, r),
                     "-" if base else ",".join(map(str, g.group_sizes)),
                     "-" if base else str(g.min_context),
                     "-" if base else f"{g.min_active}..{g.max_active}",
                     _splits_text(r.splits), "-" if base else f"{r.margin:.2f}", bucketing))
    table = format_table(("route", "kind", "kernel", "state", "device planning", "groups",
                          "min context", "active", "splits", "margin", "bucketing"), rows)
    b = reg.boundary
    rule = ("forbidden" if math.isinf(b.margin) else f"needs margin >= {b.margin:.2f}")
    rule = (f"boundary: at exactly {b.active} active rows PersistentKV {rule}"
            + (" (allow = true: rule off, routes keep their own margin)" if b.allow else ""))
    ht = reg.host_time
    host = ("host time: not weighed ([host_time] absent)" if ht is None else
            "host time: not weighed ([host_time] enabled = false)" if not ht.enabled else
            f"host time: weighed in the Runtime's default mode (the calibration's host_time); a step "
            f"FlashInfer runs host-bound needs min context {ht.min_context} instead of the routes' own")
    m = reg.sharing_margin
    share = ("sharing: SharedPagesRuntime never shares a host-lengths step ([sharing] margin = inf)"
             if math.isinf(m) else
             f"sharing: SharedPagesRuntime shares a host-lengths step when its predicted plain time "
             f"is at least {m:.2f}x its shared time ([sharing] margin)")
    dm = reg.sharing_device_margin
    share += ("; on device lengths " + ("never" if math.isinf(dm) else f"at {dm:g}x")
              + f" ([sharing] device_margin); a chunk decodes {reg.sharing_chunk_heads} query heads "
              f"per KV head together ([sharing] chunk_heads)")
    if reg.sharing_model_cut_rows is not None:
        share += (f"; the chunk decode is cut by the time model (options.shared_chunk_cut, default "
                  f"\"time_model\") for chunk decodes of at most "
                  f"{reg.sharing_model_cut_rows} chunks, the partition the rest ([sharing] model_cut_rows)")
    cm = reg.sharing_model_cut_margin
    if cm != 1.0:
        share += ("; the time model's cut never ([sharing] model_cut_margin = inf)" if math.isinf(cm)
                  else f"; the time model's cut only where it predicts the partition's at least "
                       f"{cm:g}x its own ([sharing] model_cut_margin)")
    return (f"{table}\n\n{rule}\n{host}\n{share}\n{_device_planning_note(reg)}\n"
            f"file: {reg.path}\nsha256: {reg.sha256}")


def _device_planning_step(reg: registry.Registry, r: registry.Route, active: int, group: int) -> str:
    """"; device planning runs it at N rows" where device planning runs ``r`` on this step."""
    try:
        runs = reg.device_planning_route(active, group).name == r.name
    except KeyError:
        return ""
    if not runs:
        return ""
    return f"; device planning runs it at {active} row{'s' * (active > 1)} (no gates there)"


def format_step(reg: registry.Registry, *, active: int, max_context: int, group: int) -> str:
    """Per route: the margin it would need and "eligible" or its refusal reasons."""
    rows = []
    for r in reg.routes:
        why = r.refusals(group_size=group, max_context=max_context, active=active)
        margin = reg.margin_for(r, active)
        if r.kind == "flashinfer":
            margin_text, verdict = "-", "baseline (always eligible)"
        else:
            margin_text = ("forbidden (boundary)" if margin is None else f"{margin:.2f}"
                           + (" (boundary)" if margin != r.margin else ""))
            verdict = ("refused: " + "; ".join(why) if why else
                       "eligible (ablation: the host router runs it only when forced)"
                       if r.ablation else "eligible")
            verdict += _device_planning_step(reg, r, active, group)
        rows.append((r.name, margin_text, verdict))
    head = f"step: {active} active rows, longest context {max_context} tokens, group size {group}"
    return head + "\n" + format_table(("route", "margin", "verdict"), rows)


if __name__ == "__main__":
    sys.exit(main())
