"""The route registry: ``routes.toml`` loaded once into frozen, validated attrs classes.

routes.toml is the routing policy (which routes exist, their gates, split bounds and promotion
margins); a performance engineer edits it and reruns, with no code change. The file documents
every key itself. Every table and key is checked on load, and the first problem raises
:class:`RoutesError` naming the file, the table and the key, e.g.::

    routes.toml: [routes.pkv_bucket.splits] min: 0 is not positive; expected an integer >= 1
"""

from __future__ import annotations

import bisect
import hashlib
import math
import pathlib
import re

import attrs

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from pkvrt._buildspec import FAMILIES, GROUP_SIZES, TILE_TOKENS
from pkvrt._paths import CHECKOUT, PACKAGE

# Route kind -> the kernel family that implements it (None: FlashInfer brings its own kernel).
KIND_KERNELS = {"flashinfer": None, "bucket": "split_decode",
                "workqueue": "workqueue_decode", "fused": "fused_decode"}
DEVICE_PLANNED = ("workqueue", "fused")   # route kinds whose plans the planning kernel builds
BUCKETINGS = ("exact", "coarse")
ROUTE_KEYS = ("kind", "kernel", "enabled", "ablation", "margin", "gates", "splits",
              "bucketing", "coarse_lengths", "kv_dtypes")
# K/V dtype (torch's name) -> bytes per element. The K/V bytes a step reads scale with it.
KV_DTYPES = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
# kv_dtypes of a route without the key: every kernel family of pkvrt and FlashInfer's decode read
# fp16, bf16 and float8_e4m3fn K/V.
DEFAULT_KV_DTYPES = {"flashinfer": ("float16", "bfloat16", "float8_e4m3fn")}
PKV_KV_DTYPES = ("float16", "bfloat16", "float8_e4m3fn")
GATE_KEYS = ("group_sizes", "min_context", "min_active", "max_active")
_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
_REQUIRED = object()


def kv_dtype_name(dtype) -> str:
    """routes.toml's name of a K/V dtype: ``torch.float16`` or ``"float16"`` -> ``"float16"``.

    Raises ValueError for a dtype that is not a K/V dtype (:data:`KV_DTYPES`)."""
    name = str(dtype).removeprefix("torch.")
    if name not in KV_DTYPES:
        raise ValueError(f"KV dtype {dtype!r}: expected one of {', '.join(KV_DTYPES)}")
    return name


class RoutesError(ValueError):
    """routes.toml is missing or wrong: ``"<path>: [<table>] <key>: <problem>; expected <what>"``."""


@attrs.frozen
class SplitBounds:
    """Allowed split counts per (row, KV head): 1 if ``min == 1``, plus every multiple of
    ``multiple_of`` in ``[min, max]`` (min 4, max 16, multiple_of 4 -> 4, 8, 12, 16)."""

    min: int
    max: int
    multiple_of: int

    def candidates(self) -> tuple[int, ...]:
        """Every allowed split count, ascending."""
        ones = (1,) if self.min == 1 else ()
        first = max(self.min, 2)
        first += -first % self.multiple_of  # round up to a multiple
        return ones + tuple(range(first, self.max + 1, self.multiple_of))

    def clamp(self, s: int) -> int:
        """Nearest allowed split count to ``s``; a tie goes to the smaller (6 in 4, 8 -> 4)."""
        cands = self.candidates()
        i = bisect.bisect_left(cands, s)
        if i == 0:
            return cands[0]
        if i == len(cands):
            return cands[-1]
        lo, hi = cands[i - 1], cands[i]
        return lo if s - lo <= hi - s else hi


@attrs.frozen
class Gates:
    """When a PersistentKV route may be considered for a step at all."""

    group_sizes: tuple[int, ...]  # calibrated G = H_q / H_kv
    min_context: int  # the step's longest seq_len must be >= this (tokens)
    min_active: int  # active rows in the step, inclusive bounds
    max_active: int


@attrs.frozen
class BoundaryRule:
    """At exactly ``active`` rows a PersistentKV route needs ``margin`` (the paper's B4 rule)
    unless ``allow`` (the ablation flag) is set; ``margin = inf`` forbids it there outright."""

    active: int
    margin: float
    allow: bool


@attrs.frozen
class HostTimeRule:
    """``[host_time]``: weigh each route's host time (the calibration's ``host_time``) in the
    step's prediction, where the Runtime runs in the mode it was measured in. ``min_context``
    replaces ``[gates] min_context`` for a step FlashInfer would run host-bound (its predicted
    host time over its predicted device time): the context gate is a device-time gate."""

    enabled: bool
    min_context: int


@attrs.frozen
class Route:
    """One ``[routes.<name>]`` table, with defaults from ``[gates]`` and ``[promotion]`` applied."""

    name: str
    kind: str  # "flashinfer" | "bucket" | "workqueue" | "fused"
    kernel: str | None  # a pkvrt._buildspec.FAMILIES key; None only for flashinfer
    enabled: bool
    ablation: bool  # never picked by the router unless forced by name
    margin: float  # promotion margin over the baseline (1.0 for the baseline itself)
    gates: Gates
    splits: SplitBounds | None  # None only for flashinfer
    bucketing: str  # "exact" | "coarse" for bucket routes; "none" for the others
    coarse_lengths: tuple[int, ...]  # bucket lengths (tokens) of the coarse mode
    kv_dtypes: tuple[str, ...] = PKV_KV_DTYPES  # K/V dtypes it serves (KV_DTYPES names)

    def refusals(self, *, group_size: int, max_context: int, active: int,
                 kv_dtype: str = "float16") -> tuple[str, ...]:
        """Why this route may not run a step: () when its gates admit it, else one sentence per
        failed gate. ``kv_dtype``: the K/V dtype's name (:func:`kv_dtype_name`). The flashinfer
        baseline is never refused (the Router refuses a K/V dtype it does not serve up front)."""
        if self.kind == "flashinfer":
            return ()
        g, out = self.gates, []
        if not self.enabled:
            out.append("disabled in routes.toml")
        if kv_dtype not in self.kv_dtypes:
            out.append(f"KV dtype {kv_dtype} is not served (kv_dtypes = {list(self.kv_dtypes)})")
        if group_size not in g.group_sizes:
            out.append(f"group size {group_size} is not calibrated "
                       f"(gates.group_sizes = {list(g.group_sizes)})")
        if max_context < g.min_context:
            out.append(f"longest context {max_context} tokens is below "
                       f"gates.min_context = {g.min_context}")
        if active < g.min_active:
            out.append(f"active count {active} is below gates.min_active = {g.min_active}")
        if active > g.max_active:
            out.append(f"active count {active} is above gates.max_active = {g.max_active}")
        return tuple(out)


@attrs.frozen
class Registry:
    """A validated routes.toml."""

    path: str
    sha256: str  # hex digest of the file bytes (recorded in every results file)
    routes: tuple[Route, ...]  # file order
    boundary: BoundaryRule
    device_route: str | None = None  # [device_planning] route: what device planning runs
    # [device_planning] small_rows / small_route: steps of at most small_rows rows run small_route
    device_small: tuple[int, str] | None = None
    # [device_planning] large_group / large_group_route: Runtimes of group size G >= large_group
    # run large_group_route (on steps of more than small_rows rows)
    device_large_group: tuple[int, str] | None = None
    # [device_planning] large_group_min_window: a windowed Runtime whose window (window_left + 1
    # tokens) is shorter keeps `route` at any G (None: the key is absent, every window follows
    # large_group)
    device_large_group_min_window: int | None = None
    # [host_time] (None: the table is absent, host time is never weighed)
    host_time: HostTimeRule | None = None
    # [sharing] margin: SharedPagesRuntime shares a step (host lengths) only when the plain
    # step's predicted time over the shared one's is at least this (1.0 without the table);
    # device_margin: the same for its device-lengths rule (find_shared, on the GPU)
    sharing_margin: float = 1.0
    sharing_device_margin: float = 1.0
    # [sharing] chunk_heads: query heads per KV head that a chunk of rows sharing a run decodes
    # together (rows per chunk = chunk_heads // G, at most what the kernels serve; 16 without
    # the key). The chunk decode runs at group chunk_heads: its cuts and the rules' times use that
    # group's calibration constants (the nearest calibrated group's where the file has none)
    sharing_chunk_heads: int = 16
    # [sharing] model_cut_rows: RuntimeOptions(shared_chunk_cut="time_model") cuts a chunk decode
    # of at most this many chunks (rows of the chunk decode) at the time model's fastest split
    # count, one of more by the planning kernel's partition (None: the key is absent, no bound)
    sharing_model_cut_rows: int | None = None
    # [sharing] model_cut_margin: ... and only where the time model predicts the partition's cut
    # at least this many times its own (1.0 without the key: any predicted gain)
    sharing_model_cut_margin: float = 1.0

    def device_planning_route(self, rows: int | None = None, group: int | None = None,
                              window: int | None = None) -> Route:
        """The route ``Runtime(device_planning=True)`` runs when none is forced: for a step of
        ``rows`` rows at most ``[device_planning] small_rows``, ``small_route``; otherwise, for a
        Runtime of group size ``group`` >= ``large_group``, ``large_group_route``, unless its
        sliding window of ``window`` tokens (window_left + 1; None: no window) is shorter than
        ``large_group_min_window``; otherwise ``[device_planning] route`` if the file names one,
        else the first non-ablation workqueue or fused route (else the first of either kind).
        ``rows=None`` / ``group=None``: that rule left out (``device_planning_route()`` is the
        main route, what the calibration fits the partition on). Raises KeyError when the file
        has no such route."""
        if rows is not None and self.device_small is not None and rows <= self.device_small[0]:
            return self.route(self.device_small[1])
        short = self.device_large_group_min_window
        if group is not None and self.device_large_group is not None and group >= self.device_large_group[0] \
                and (window is None or short is None or window >= short):
            return self.route(self.device_large_group[1])
        if self.device_route is not None:
            return self.route(self.device_route)
        dp = [r for r in self.routes if r.kind in ("workqueue", "fused")]
        if not dp:
            raise KeyError(f"{self.path}: device planning needs a route of kind 'workqueue' or "
                           "'fused'; there is none")
        return ([r for r in dp if not r.ablation] or dp)[0]

    def route(self, name: str) -> Route:
        for r in self.routes:
            if r.name == name:
                return r
        raise KeyError(f"no route {name!r} in {self.path}; "
                       f"known routes: {', '.join(r.name for r in self.routes)}")

    @property
    def baseline(self) -> Route:
        return next(r for r in self.routes if r.kind == "flashinfer")

    def margin_for(self, route: Route, active: int) -> float | None:
        """Promotion margin ``route`` must clear over the baseline with ``active`` rows, or None
        when the boundary rule forbids promotion. Seed: 4 rows -> max(1.05, 1.50) = 1.50, or
        1.05 with ``allow = true``; 8 rows -> 1.05. The baseline itself needs 1.0."""
        if route.kind == "flashinfer":
            return 1.0
        b = self.boundary
        if active != b.active or b.allow:
            return route.margin
        return None if math.isinf(b.margin) else max(route.margin, b.margin)


def default_routes_path() -> pathlib.Path:
    """``<repo>/routes.toml`` in a checkout or editable install, else the installed copy."""
    repo = CHECKOUT / "routes.toml"
    return repo if repo.is_file() else PACKAGE / "_data" / "routes.toml"


def load_routes(path: str | pathlib.PathLike | None = None) -> Registry:
    """Read and validate a routes.toml once.

    Parameters
    ----------
    path : the file; None -> :func:`default_routes_path`.

    Returns
    -------
    Registry with every default applied and ``sha256`` of the file bytes.

    Raises
    ------
    RoutesError naming the file, table and key of the first problem (a missing file, a TOML
    syntax error with its line, an unknown key, a wrong type or a bad value).
    """
    p = pathlib.Path(path) if path is not None else default_routes_path()
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise RoutesError(f"{p}: file not found; expected a routes.toml "
                          f"(the default is {default_routes_path()})") from None
    except OSError as e:
        raise RoutesError(f"{p}: cannot read ({e.strerror}); expected a readable file") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RoutesError(f"{p}: byte {e.start} is not UTF-8; expected a UTF-8 TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise _syntax_error(str(p), raw.decode("utf-8"), str(e)) from None
    routes, boundary, device_route, device_small, (device_large, min_window), host_time, \
        (sharing_margin, sharing_device_margin, sharing_chunk_heads, sharing_model_cut_rows,
         sharing_model_cut_margin) = _parse(str(p), doc)
    return Registry(path=str(p.resolve()), sha256=hashlib.sha256(raw).hexdigest(),
                    routes=routes, boundary=boundary, device_route=device_route,
                    device_small=device_small, device_large_group=device_large,
                    device_large_group_min_window=min_window,
                    host_time=host_time, sharing_margin=sharing_margin,
                    sharing_device_margin=sharing_device_margin,
                    sharing_chunk_heads=sharing_chunk_heads,
                    sharing_model_cut_rows=sharing_model_cut_rows,
                    sharing_model_cut_margin=sharing_model_cut_margin)


def _syntax_error(path: str, text: str, msg: str) -> RoutesError:
    """A TOMLDecodeError as a RoutesError naming the line and the table it falls in."""
    lines = text.splitlines()
    m = re.search(r"\(at line (\d+), column \d+\)", msg)
    n = int(m.group(1)) if m else max(len(lines), 1)  # "(at end of document)"
    problem = msg[: m.start()].strip() if m else msg
    table, key = "top level", "(line)"
    for line in reversed(lines[:n]):
        h = re.match(r"\s*\[\[?\s*([\w.\-\" ]+?)\s*(\]\]?\s*(#.*)?)?$", line)  # "]" may be the error
        if h:
            table = re.sub(r"\s*\.\s*", ".", h.group(1))
            break
    here = lines[n - 1] if 0 < n <= len(lines) else ""
    if k := re.match(r"\s*([^=\[#\s][^=#]*?)\s*=", here):
        key = k.group(1)
    elif here.lstrip().startswith("["):
        key = "(table header)"
    if "twice" in problem:
        return RoutesError(f"{path}: [{table}] {key}: declared twice at line {n} (a duplicate "
                           f"route name?); expected each table and route name once")
    return RoutesError(f"{path}: [{table}] {key}: TOML syntax error at line {n}: {problem}; "
                       f"expected valid TOML")


def _show(v) -> str:
    """A value as it is written in TOML, for messages."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return f"[{', '.join(map(_show, v))}]"
    return "a table" if isinstance(v, dict) else repr(v)


def _fail(path: str, table: str, key: str, problem: str, expected: str):
    raise RoutesError(f"{path}: [{table}] {key}: {problem}; expected {expected}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # TOML true is not an integer


def _int_problem(v) -> str | None:
    return "is not an integer" if not _is_int(v) else "is not positive" if v < 1 else None


def _ints_problem(v) -> str | None:
    if not isinstance(v, list):
        return "is not an array"
    bad = [x for x in v if not _is_int(x) or x < 1]
    return "is empty" if not v else f"has {_show(bad[0])}, not a positive integer" if bad else None


class _Table:
    """One TOML table being read: rejects unknown keys, reads checked values, names what is wrong."""

    def __init__(self, path: str, name: str, data: dict, allowed: tuple[str, ...] | None):
        self.path, self.name, self.data = path, name, data
        for key in data if allowed is not None else ():
            if key not in allowed:
                self.fail(key, "unknown key", f"one of {', '.join(allowed)}")

    def fail(self, key: str, problem: str, expected: str):
        _fail(self.path, self.name, key, problem, expected)

    def get(self, key: str, expected: str, problem, default=_REQUIRED):
        """``key``'s value, or ``default`` if absent; ``problem(value)`` says what is wrong."""
        if key not in self.data:
            if default is _REQUIRED:
                self.fail(key, "missing", expected)
            return default
        v = self.data[key]
        if (why := problem(v)) is not None:
            self.fail(key, f"{_show(v)} {why}", expected)
        return v

    def table(self, key: str, allowed, *, required=True) -> _Table | None:
        name = key if self.name == "top level" else f"{self.name}.{key}"
        d = self.get(key, f"a [{name}] table", lambda v: None if isinstance(v, dict)
                     else "is not a table", _REQUIRED if required else None)
        return None if d is None else _Table(self.path, name, d, allowed)

    def integer(self, key: str, default=_REQUIRED) -> int:
        return self.get(key, "an integer >= 1", _int_problem, default)

    def integers(self, key: str, default=_REQUIRED) -> tuple[int, ...]:
        return tuple(self.get(key, "a non-empty array of integers >= 1", _ints_problem, default))

    def margin(self, key: str, default=_REQUIRED, *, allow_inf=False) -> float:
        def problem(v):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return "is not a number"
            if math.isnan(v) or v < 1.0 or (math.isinf(v) and not allow_inf):
                return "is not a promotion margin"
        expected = "a number >= 1.0" + (" or inf" if allow_inf else "")
        return float(self.get(key, expected, problem, default))

    def boolean(self, key: str, default=_REQUIRED) -> bool:
        return self.get(key, "true or false",
                        lambda v: None if isinstance(v, bool) else "is not a boolean", default)

    def choice(self, key: str, options: tuple[str, ...], default=_REQUIRED) -> str:
        return self.get(key, f"one of {', '.join(map(_show, options))}", lambda v: None
                        if v in options else "is unknown" if isinstance(v, str)
                        else "is not a string", default)


def _gates(t: _Table, base: Gates | None) -> Gates:
    """[gates] (every key required) or a route's override table (missing keys from ``base``)."""
    d = attrs.asdict(base, recurse=False) if base else dict.fromkeys(GATE_KEYS, _REQUIRED)
    sizes = t.integers("group_sizes", d["group_sizes"])
    for g in sizes:
        if g not in GROUP_SIZES:
            t.fail("group_sizes", f"{g} has no kernel", f"group sizes among {list(GROUP_SIZES)}")
    lo = t.integer("min_active", d["min_active"])
    hi = t.integer("max_active", d["max_active"])
    if lo > hi:
        t.fail("max_active", f"{hi} is below min_active = {lo} (inverted range)",
               "max_active >= min_active")
    return Gates(group_sizes=tuple(sorted(set(sizes))),
                 min_context=t.integer("min_context", d["min_context"]),
                 min_active=lo, max_active=hi)


def _splits(t: _Table) -> SplitBounds:
    lo, hi, mult = t.integer("min"), t.integer("max"), t.integer("multiple_of")
    if lo > hi:
        t.fail("max", f"{hi} is below min = {lo} (inverted range)", "max >= min")
    for key, v in (("min", lo), ("max", hi)):
        if v > 1 and v % mult:  # 1 is allowed (no split); every other count is a multiple
            t.fail(key, f"{v} is not a multiple of multiple_of = {mult}", f"1 or a multiple of {mult}")
    return SplitBounds(min=lo, max=hi, multiple_of=mult)


def _kv_dtypes(t: _Table, default: tuple[str, ...]) -> tuple[str, ...]:
    """A route's ``kv_dtypes``: a non-empty array of distinct :data:`KV_DTYPES` names."""
    def problem(v):
        if not isinstance(v, list):
            return "is not an array"
        if not v:
            return "is empty"
        bad = [x for x in v if not isinstance(x, str) or x not in KV_DTYPES]
        if bad:
            return f"has {_show(bad[0])}, not a KV dtype"
        return "lists a dtype twice" if len(set(v)) != len(v) else None
    return tuple(t.get("kv_dtypes", f"a non-empty array of distinct names among "
                       f"{', '.join(map(_show, KV_DTYPES))}", problem, default))


def _route(path: str, name: str, body, gates: Gates, margin: float) -> Route:
    if not _NAME.match(name):
        _fail(path, "routes", name, "not a valid route name", "lower_snake_case from a letter")
    if not isinstance(body, dict):
        _fail(path, "routes", name, f"{_show(body)} is not a table", f"a [routes.{name}] table")
    t = _Table(path, f"routes.{name}", body, ROUTE_KEYS)
    kind = t.choice("kind", tuple(KIND_KERNELS))
    want = KIND_KERNELS[kind]
    not_for = {"flashinfer": ("kernel", "ablation", "margin", "gates", "splits"),
               "bucket": ()}.get(kind, ())
    for key in not_for + (() if kind == "bucket" else ("bucketing", "coarse_lengths")):
        if key in body:
            t.fail(key, f'not used by kind "{kind}"', "no such key in this route")
    if kind == "flashinfer":
        if not t.boolean("enabled", True):
            t.fail("enabled", "the baseline cannot be disabled (it is every step's fallback)",
                   "true or no key")
        return Route(name=name, kind=kind, kernel=None, enabled=True, ablation=False,
                     margin=1.0, gates=gates, splits=None, bucketing="none", coarse_lengths=(),
                     kv_dtypes=_kv_dtypes(t, DEFAULT_KV_DTYPES["flashinfer"]))
    if "kernel" not in body:
        t.fail("kernel", "missing", f'kernel = "{want}" for kind "{kind}"')
    kernel = t.choice("kernel", tuple(FAMILIES))
    if kernel != want:
        t.fail("kernel", f'"{kernel}" does not implement kind "{kind}"', f'"{want}"')
    over = t.table("gates", GATE_KEYS, required=False)
    bucketing = t.choice("bucketing", BUCKETINGS, "exact") if kind == "bucket" else "none"
    coarse = t.integers("coarse_lengths", ())
    if any(a >= b for a, b in zip(coarse, coarse[1:])) or any(c % TILE_TOKENS for c in coarse):
        t.fail("coarse_lengths", f"{list(coarse)} is not strictly ascending multiples of "
               f"TILE_TOKENS", f"ascending multiples of {TILE_TOKENS} tokens")
    if bucketing == "coarse" and not coarse:
        t.fail("coarse_lengths", 'missing with bucketing = "coarse"', "the coarse bucket lengths")
    return Route(name=name, kind=kind, kernel=kernel, enabled=t.boolean("enabled", True),
                 ablation=t.boolean("ablation", False), margin=t.margin("margin", margin),
                 gates=_gates(over, gates) if over else gates,
                 splits=_splits(t.table("splits", ("min", "max", "multiple_of"))),
                 bucketing=bucketing, coarse_lengths=coarse, kv_dtypes=_kv_dtypes(t, PKV_KV_DTYPES))


def _parse(path: str, doc: dict) -> tuple:
    # (routes, boundary rule, [device_planning] route, (small_rows, small_route) or None,
    #  ((large_group, large_group_route) or None, large_group_min_window or None),
    #  host-time rule or None, (sharing margin, device margin, chunk heads, model cut rows or None,
    #  model cut margin))
    top = _Table(path, "top level", doc, ("gates", "promotion", "host_time", "device_planning",
                                          "sharing", "routes"))
    gates = _gates(top.table("gates", GATE_KEYS), None)
    promo = top.table("promotion", ("margin", "boundary"))
    margin = promo.margin("margin")
    b = promo.table("boundary", ("active", "margin", "allow"))
    boundary = BoundaryRule(active=b.integer("active"), margin=b.margin("margin", allow_inf=True),
                            allow=b.boolean("allow"))
    table = top.table("routes", None)
    if not table.data:
        top.fail("routes", "empty", "at least the flashinfer baseline route")
    routes = tuple(_route(path, n, body, gates, margin) for n, body in table.data.items())
    baselines = [r.name for r in routes if r.kind == "flashinfer"]
    if len(baselines) != 1:
        table.fail("kind", f'{len(baselines) or "no"} routes have kind "flashinfer" '
                   f'{baselines or ""}'.rstrip(), "exactly one baseline route")
    device_route = device_small = device_large = None
    min_window = None
    if (dp := top.table("device_planning", ("route", "small_rows", "small_route", "large_group",
                                            "large_group_route", "large_group_min_window"),
                        required=False)) is not None:
        names = [r.name for r in routes if r.kind in ("workqueue", "fused")]
        expected = f"the name of a workqueue or fused route ({', '.join(names) or 'none here'})"

        def problem(v):
            if not isinstance(v, str):
                return "is not a string"
            return None if v in names else "is not a workqueue or fused route of this file"

        device_route = dp.get("route", expected, problem)
        pairs = []
        for count, route_key in (("small_rows", "small_route"), ("large_group", "large_group_route")):
            given = [k for k in (count, route_key) if k in dp.data]
            if len(given) == 1:
                missing = ({count, route_key} - set(given)).pop()
                dp.fail(missing, "missing", f"{missing} next to {given[0]} (the two go together)")
            pairs.append((dp.integer(count), dp.get(route_key, expected, problem)) if given else None)
        device_small, device_large = pairs
        if "large_group_min_window" in dp.data:
            if device_large is None:
                dp.fail("large_group_min_window", "without large_group",
                        "large_group and large_group_route next to it (it bounds that rule)")
            min_window = dp.integer("large_group_min_window")
    host_time = None
    if (ht := top.table("host_time", ("enabled", "min_context"), required=False)) is not None:
        host_time = HostTimeRule(enabled=ht.boolean("enabled"), min_context=ht.integer("min_context"))
    sh = top.table("sharing", ("margin", "device_margin", "chunk_heads", "model_cut_rows",
                               "model_cut_margin"), required=False)
    sharing = (1.0, 1.0, 16, None, 1.0) if sh is None else (
        sh.margin("margin", allow_inf=True), sh.margin("device_margin", 1.0, allow_inf=True),
        sh.get("chunk_heads", "an integer in 2..64", lambda v: "is not an integer" if not _is_int(v)
               else None if 2 <= v <= 64 else "is outside 2..64", 16),
        sh.integer("model_cut_rows", None), sh.margin("model_cut_margin", 1.0, allow_inf=True))
    return routes, boundary, device_route, device_small, (device_large, min_window), host_time, sharing
