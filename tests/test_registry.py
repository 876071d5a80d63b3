"""routes.toml and pkvrt/policy/registry.py: seed values, every validation error, gates, splits, margins."""

from __future__ import annotations

import hashlib
import pathlib

import attrs
import pytest
from hypothesis import given, strategies as st

from pkvrt.policy import registry
from pkvrt.policy.registry import Registry, RoutesError, SplitBounds, load_routes

REPO = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = REPO / "routes.toml"

# A small valid file; every error case below is one edit of it.
BASE = """\
[gates]
group_sizes = [4]
min_context = 16384
min_active = 1
max_active = 8

[promotion]
margin = 1.05

[promotion.boundary]
active = 4
margin = 1.5
allow = false

[routes.flashinfer]
kind = "flashinfer"

[routes.pkv_bucket]
kind = "bucket"
kernel = "split_decode"
bucketing = "exact"
coarse_lengths = [16384, 32768]

[routes.pkv_bucket.splits]
min = 4
max = 64
multiple_of = 4

[routes.pkv_workqueue]
kind = "workqueue"
kernel = "workqueue_decode"

[routes.pkv_workqueue.splits]
min = 1
max = 64
multiple_of = 4
"""


def write(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    p = tmp_path / "routes.toml"
    p.write_text(text)
    return p


def edit(old: str, new: str) -> str:
    assert old in BASE, f"test table is stale: {old!r} not in BASE"
    return BASE.replace(old, new, 1)


def test_base_is_valid(tmp_path):
    reg = load_routes(write(tmp_path, BASE))
    assert [r.name for r in reg.routes] == ["flashinfer", "pkv_bucket", "pkv_workqueue"]


def test_the_chunk_cut_bounds_of_sharing_and_their_defaults(tmp_path):
    """[sharing] model_cut_rows / model_cut_margin: absent table or keys, no row bound and a
    margin of 1.0 (any predicted gain); inf is allowed (never the model's cut); the shipped
    file's 4 and 1.10."""
    got = {}
    for name, table in (("none", ""), ("margin only", "[sharing]\nmargin = 1.1\n"),
                        ("set", "[sharing]\nmargin = 1.1\nmodel_cut_rows = 3\nmodel_cut_margin = inf\n")):
        path = tmp_path / f"{name}.toml"
        path.write_text(table + BASE)
        reg = load_routes(path)
        got[name] = (reg.sharing_model_cut_rows, reg.sharing_model_cut_margin)
    assert got == {"none": (None, 1.0), "margin only": (None, 1.0), "set": (3, float("inf"))}
    shipped = load_routes(None)
    assert (shipped.sharing_model_cut_rows, shipped.sharing_model_cut_margin) == (4, 1.10)


def test_device_planning_route_is_declared_or_the_first_non_ablation_one(tmp_path):
    assert load_routes(write(tmp_path, BASE)).device_planning_route().name == "pkv_workqueue"
    fused = BASE + '\n[routes.pkv_fused]\nkind = "fused"\nkernel = "fused_decode"\n' \
                   '\n[routes.pkv_fused.splits]\nmin = 1\nmax = 64\nmultiple_of = 4\n'
    named = fused.replace("[routes.flashinfer]", '[device_planning]\nroute = "pkv_fused"\n\n[routes.flashinfer]')
    reg = load_routes(write(tmp_path, named))
    assert reg.device_route == "pkv_fused" and reg.device_planning_route().kind == "fused"
    assert load_routes(SHIPPED).device_planning_route().name == "pkv_fused"
    for bad, why in (('"pkv_bucket"', "is not a workqueue or fused route of this file"),
                     ('"nope"', "is not a workqueue or fused route of this file"),
                     ("3", "is not a string")):
        with pytest.raises(RoutesError, match=rf"\[device_planning\] route: .*{why}; expected "
                                              r"the name of a workqueue or fused route \(pkv_workqueue, pkv_fused\)"):
            load_routes(write(tmp_path, named.replace('route = "pkv_fused"', f"route = {bad}")))
    with pytest.raises(RoutesError, match=r"\[device_planning\] rout: unknown key; expected one of route"):
        load_routes(write(tmp_path, named.replace('route = "pkv_fused"', 'rout = "pkv_fused"')))


def test_device_planning_small_route_serves_steps_of_few_rows(tmp_path):
    fused = BASE + '\n[routes.pkv_fused]\nkind = "fused"\nkernel = "fused_decode"\n' \
                   '\n[routes.pkv_fused.splits]\nmin = 1\nmax = 64\nmultiple_of = 4\n'
    table = '[device_planning]\nroute = "pkv_fused"\nsmall_rows = 2\nsmall_route = "pkv_workqueue"\n'
    named = fused.replace("[routes.flashinfer]", table + "\n[routes.flashinfer]")
    reg = load_routes(write(tmp_path, named))
    assert reg.device_small == (2, "pkv_workqueue")
    assert [reg.device_planning_route(rows).name for rows in (1, 2, 3, 8)] == \
        ["pkv_workqueue", "pkv_workqueue", "pkv_fused", "pkv_fused"]
    assert reg.device_planning_route().name == "pkv_fused"      # rows unknown: the main route
    shipped = load_routes(SHIPPED)
    assert shipped.device_planning_route(1).name == "pkv_workqueue"
    assert shipped.device_planning_route(2).name == "pkv_fused"
    # the pair goes together; the route must be a workqueue/fused route; rows an integer >= 1
    assert_refused(tmp_path, named, (
        ("small_rows = 2\n", "", r"\[device_planning\] small_rows: missing; expected small_rows next to small_route"),
        ('small_route = "pkv_workqueue"\n', "", r"\[device_planning\] small_route: missing; expected small_route next to small_rows"),
        ('small_route = "pkv_workqueue"', 'small_route = "pkv_bucket"', r"\[device_planning\] small_route: .*is not a workqueue or fused route"),
        ("small_rows = 2", "small_rows = 0", r"\[device_planning\] small_rows: 0"),
        ("small_rows = 2", "small_rows = true", r"\[device_planning\] small_rows: true is not an integer")))


def assert_refused(tmp_path, text: str, edits) -> None:
    """Each (from, to, message) edit of ``text`` is refused with that message."""
    for edit_from, edit_to, msg in edits:
        with pytest.raises(RoutesError, match=msg):
            load_routes(write(tmp_path, text.replace(edit_from, edit_to)))


def large_group_routes(extra: str = "") -> str:
    """BASE with a fused route and a [device_planning] table of small_rows 1 and large_group 5
    (both on pkv_workqueue), and ``extra`` lines in that table."""
    fused = BASE + '\n[routes.pkv_fused]\nkind = "fused"\nkernel = "fused_decode"\n' \
                   '\n[routes.pkv_fused.splits]\nmin = 1\nmax = 64\nmultiple_of = 4\n'
    table = ('[device_planning]\nroute = "pkv_fused"\nsmall_rows = 1\nsmall_route = "pkv_workqueue"\n'
             'large_group = 5\nlarge_group_route = "pkv_workqueue"\n' + extra)
    return fused.replace("[routes.flashinfer]", table + "\n[routes.flashinfer]")


def test_device_planning_large_group_route_serves_runtimes_of_large_groups(tmp_path):
    """large_group / large_group_route: a Runtime of G >= large_group runs that route on steps
    of more rows than small_rows (small_route still takes those); G unknown: the main route."""
    named = large_group_routes()
    reg = load_routes(write(tmp_path, named))
    assert reg.device_large_group == (5, "pkv_workqueue")
    assert [reg.device_planning_route(8, g).name for g in (1, 2, 4, 5, 7, 8, 16)] == \
        ["pkv_fused"] * 3 + ["pkv_workqueue"] * 4
    assert reg.device_planning_route(1, 2).name == "pkv_workqueue"   # small_rows first
    assert reg.device_planning_route(8).name == reg.device_planning_route().name == "pkv_fused"
    fused_large = named.replace('large_group_route = "pkv_workqueue"', 'large_group_route = "pkv_fused"')
    assert load_routes(write(tmp_path, fused_large)).device_planning_route(8, 16).name == "pkv_fused"
    shipped = load_routes(SHIPPED)
    assert [shipped.device_planning_route(8, g).name for g in (1, 4, 5, 8, 16)] == \
        ["pkv_fused", "pkv_fused", "pkv_workqueue", "pkv_workqueue", "pkv_workqueue"]
    assert_refused(tmp_path, named, (
        ("large_group = 5\n", "", r"\[device_planning\] large_group: missing; expected large_group next to large_group_route"),
        ('large_group_route = "pkv_workqueue"\n', "", r"\[device_planning\] large_group_route: missing; expected large_group_route next to large_group"),
        ('large_group_route = "pkv_workqueue"', 'large_group_route = "flashinfer"', r"\[device_planning\] large_group_route: .*is not a workqueue or fused route"),
        ("large_group = 5", "large_group = 0", r"\[device_planning\] large_group: 0"),
        ("large_group = 5", 'large_group = "5"', r"\[device_planning\] large_group: .*is not an integer")))


def test_a_short_window_keeps_the_main_route_at_large_groups(tmp_path):
    """large_group_min_window: a Runtime whose sliding window (window_left + 1 tokens) is shorter
    runs the main route at any G; a window at least that long, or none, follows large_group; the
    key bounds that rule, so it needs it, and is an integer >= 1."""
    named = large_group_routes("large_group_min_window = 300\n")
    reg = load_routes(write(tmp_path, named))
    assert reg.device_large_group_min_window == 300
    route = {w: reg.device_planning_route(8, 8, w).name for w in (1, 129, 299, 300, 4096, None)}
    assert route == {1: "pkv_fused", 129: "pkv_fused", 299: "pkv_fused", 300: "pkv_workqueue",
                     4096: "pkv_workqueue", None: "pkv_workqueue"}
    assert reg.device_planning_route(8, 4, 4096).name == "pkv_fused"        # G below large_group
    assert reg.device_planning_route(1, 8, 129).name == "pkv_workqueue"     # small_rows first
    without = load_routes(write(tmp_path, named.replace("large_group_min_window = 300\n", "")))
    assert without.device_large_group_min_window is None
    assert without.device_planning_route(8, 8, 129).name == "pkv_workqueue"
    shipped = load_routes(SHIPPED)
    assert shipped.device_large_group_min_window == 512
    assert shipped.device_planning_route(8, 8, 128).name == "pkv_fused"     # gpt-oss's local layers
    assert shipped.device_planning_route(8, 8, None).name == "pkv_workqueue"
    assert shipped.device_planning_route(8, 2, 4096).name == "pkv_fused"    # Gemma-2's (G 2)
    alone = named.replace("large_group = 5\n", "").replace('large_group_route = "pkv_workqueue"\n', "")
    with pytest.raises(RoutesError, match=r"\[device_planning\] large_group_min_window: without "
                                          r"large_group; expected large_group and large_group_route"):
        load_routes(write(tmp_path, alone))
    assert_refused(tmp_path, named, (
        ("large_group_min_window = 300", "large_group_min_window = 0", r"large_group_min_window: 0"),
        ("large_group_min_window = 300", "large_group_min_window = 1.5",
         r"large_group_min_window: .*is not an integer"),
        ("large_group_min_window = 300", "large_group_min_windows = 300", r"large_group_min_windows")))


def test_shipped_routes_have_the_seed_values():
    reg = load_routes(SHIPPED)
    assert [r.name for r in reg.routes] == ["flashinfer", "pkv_bucket", "pkv_workqueue", "pkv_fused"]
    assert reg.baseline.name == "flashinfer" and reg.baseline.kernel is None
    assert reg.baseline.splits is None
    assert reg.boundary == registry.BoundaryRule(active=4, margin=1.5, allow=False)
    seed_gates = registry.Gates(group_sizes=(4,), min_context=16384, min_active=1, max_active=8)
    bucket, wq, fused = (reg.route(n) for n in ("pkv_bucket", "pkv_workqueue", "pkv_fused"))
    assert (bucket.kind, bucket.kernel, bucket.bucketing) == ("bucket", "split_decode", "exact")
    assert bucket.coarse_lengths and all(c % 32 == 0 for c in bucket.coarse_lengths)
    assert bucket.splits == SplitBounds(min=4, max=64, multiple_of=4)
    assert (wq.kind, wq.kernel) == ("workqueue", "workqueue_decode")
    assert wq.splits == SplitBounds(min=1, max=64, multiple_of=4)
    assert (fused.kind, fused.kernel, fused.ablation) == ("fused", "fused_decode", True)
    assert fused.splits == SplitBounds(min=1, max=64, multiple_of=1)   # device planning: any count
    assert reg.device_planning_route() is fused
    for r in (bucket, wq, fused):
        assert r.enabled and r.margin == 1.05 and r.gates == seed_gates
    assert not bucket.ablation and not wq.ablation
    assert reg.sha256 == hashlib.sha256(SHIPPED.read_bytes()).hexdigest()
    assert pathlib.Path(reg.path) == SHIPPED


def test_default_path_is_the_checkout_file():
    assert registry.default_routes_path() == SHIPPED
    assert load_routes().sha256 == load_routes(SHIPPED).sha256


def test_shipped_file_documents_every_key():
    text = SHIPPED.read_text()
    for key in (*registry.ROUTE_KEYS, *registry.GATE_KEYS, *registry.KIND_KERNELS,
                "multiple_of", "allow", "boundary"):
        assert key in text, key


# (case id, file text, substrings the message must contain besides the path)
ERRORS = [
    ("syntax", edit("min_context = 16384", "min_context = "),
     ["[gates] min_context", "TOML syntax error at line 3"]),
    ("syntax-end-of-file", BASE + "x = [1, 2\n", ["TOML syntax error at line", "expected valid TOML"]),
    ("duplicate-route", BASE + '\n[routes.pkv_bucket]\nkind = "bucket"\n',
     ["[routes.pkv_bucket]", f"declared twice at line {BASE.count(chr(10)) + 2}", "duplicate route"]),
    ("duplicate-key", edit("min_active = 1", "min_active = 1\nmin_active = 2"),
     ["[gates] min_active", "line 5"]),
    ("unknown-top-key", "foo = 1\n" + BASE, ["[top level] foo: unknown key",
                                              "gates, promotion, host_time, device_planning, sharing, routes"]),
    ("sharing-margin-below-one", "[sharing]\nmargin = 0.9\n" + BASE,
     ["[sharing] margin: 0.9 is not a promotion margin", "expected a number >= 1.0 or inf"]),
    ("sharing-margin-not-a-number", '[sharing]\nmargin = "1.1"\n' + BASE, ['[sharing] margin: "1.1" is not a number']),
    ("sharing-missing-margin", "[sharing]\n" + BASE, ["[sharing] margin", "missing"]),
    ("sharing-device-margin-below-one", "[sharing]\nmargin = 1.1\ndevice_margin = 0.5\n" + BASE,
     ["[sharing] device_margin: 0.5 is not a promotion margin", "expected a number >= 1.0 or inf"]),
    ("sharing-unknown-key", "[sharing]\nmargin = 1.1\ngain = 2\n" + BASE, ["[sharing] gain: unknown key", "margin"]),
    ("sharing-chunk-heads-one", "[sharing]\nmargin = 1.1\nchunk_heads = 1\n" + BASE,
     ["[sharing] chunk_heads: 1 is outside 2..64", "expected an integer in 2..64"]),
    ("sharing-chunk-heads-too-many", "[sharing]\nmargin = 1.1\nchunk_heads = 128\n" + BASE,
     ["[sharing] chunk_heads: 128 is outside 2..64"]),
    ("sharing-chunk-heads-float", "[sharing]\nmargin = 1.1\nchunk_heads = 16.0\n" + BASE,
     ["[sharing] chunk_heads: 16.0 is not an integer"]),
    ("sharing-chunk-heads-zero", "[sharing]\nmargin = 1.1\nchunk_heads = 0\n" + BASE,
     ["[sharing] chunk_heads: 0 is outside 2..64"]),
    ("sharing-chunk-heads-bool", "[sharing]\nmargin = 1.1\nchunk_heads = true\n" + BASE,
     ["[sharing] chunk_heads: true is not an integer"]),
    ("sharing-model-cut-rows-zero", "[sharing]\nmargin = 1.1\nmodel_cut_rows = 0\n" + BASE,
     ["[sharing] model_cut_rows: 0 is not positive", "expected an integer >= 1"]),
    ("sharing-model-cut-rows-float", "[sharing]\nmargin = 1.1\nmodel_cut_rows = 4.5\n" + BASE,
     ["[sharing] model_cut_rows: 4.5 is not an integer"]),
    ("sharing-model-cut-margin-below-one", "[sharing]\nmargin = 1.1\nmodel_cut_margin = 0.9\n" + BASE,
     ["[sharing] model_cut_margin: 0.9 is not a promotion margin", "expected a number >= 1.0 or inf"]),
    ("sharing-model-cut-row-typo", "[sharing]\nmargin = 1.1\nmodel_cut_row = 4\n" + BASE,
     ["[sharing] model_cut_row: unknown key"]),
    ("unknown-gate-key", edit("min_active = 1", "min_active = 1\nmin_ctx = 3"),
     ["[gates] min_ctx: unknown key", "group_sizes"]),
    ("unknown-route-key", edit('bucketing = "exact"', 'bucketing = "exact"\nsplitz = 4'),
     ["[routes.pkv_bucket] splitz: unknown key"]),
    ("unknown-splits-key", edit("min = 4", "min = 4\nstep = 4"),
     ["[routes.pkv_bucket.splits] step: unknown key", "multiple_of"]),
    ("unknown-boundary-key", edit("allow = false", "allow = false\nrows = 4"),
     ["[promotion.boundary] rows: unknown key"]),
    ("unknown-route-gate-key", BASE + "\n[routes.pkv_workqueue.gates]\nmax_rows = 4\n",
     ["[routes.pkv_workqueue.gates] max_rows: unknown key"]),
    ("bool-is-not-int", edit("min_context = 16384", "min_context = true"),
     ["[gates] min_context: true is not an integer", "expected an integer >= 1"]),
    ("string-is-not-int", edit("max_active = 8", 'max_active = "8"'),
     ['[gates] max_active: "8" is not an integer']),
    ("float-is-not-int", edit("min = 4", "min = 4.0"),
     ["[routes.pkv_bucket.splits] min: 4.0 is not an integer"]),
    ("bool-in-array", edit("group_sizes = [4]", "group_sizes = [true]"),
     ["[gates] group_sizes: [true] has true, not a positive integer"]),
    ("not-an-array", edit("group_sizes = [4]", "group_sizes = 4"),
     ["[gates] group_sizes: 4 is not an array", "non-empty array"]),
    ("empty-array", edit("group_sizes = [4]", "group_sizes = []"), ["[gates] group_sizes: [] is empty"]),
    ("empty-coarse", edit("coarse_lengths = [16384, 32768]", "coarse_lengths = []"),
     ["[routes.pkv_bucket] coarse_lengths: [] is empty"]),
    ("inverted-active", edit("min_active = 1", "min_active = 9"),
     ["[gates] max_active: 8 is below min_active = 9 (inverted range)"]),
    ("inverted-splits", edit("min = 4\nmax = 64", "min = 8\nmax = 4"),
     ["[routes.pkv_bucket.splits] max: 4 is below min = 8", "expected max >= min"]),
    ("zero-context", edit("min_context = 16384", "min_context = 0"),
     ["[gates] min_context: 0 is not positive"]),
    ("negative-split", edit("min = 4", "min = -4"), ["[routes.pkv_bucket.splits] min: -4 is not positive"]),
    ("zero-multiple", edit("multiple_of = 4", "multiple_of = 0"),
     ["[routes.pkv_bucket.splits] multiple_of: 0 is not positive"]),
    ("negative-coarse", edit("[16384, 32768]", "[16384, -32]"),
     ["[routes.pkv_bucket] coarse_lengths: [16384, -32] has -32, not a positive integer"]),
    ("margin-below-one", edit("margin = 1.05", "margin = 0.95"),
     ["[promotion] margin: 0.95 is not a promotion margin", "expected a number >= 1.0"]),
    ("route-margin-below-one", edit('kernel = "workqueue_decode"', 'kernel = "workqueue_decode"\nmargin = 0.5'),
     ["[routes.pkv_workqueue] margin: 0.5"]),
    ("route-margin-inf", edit('kernel = "workqueue_decode"', 'kernel = "workqueue_decode"\nmargin = inf'),
     ["[routes.pkv_workqueue] margin: inf is not a promotion margin"]),
    ("boundary-margin-nan", edit("margin = 1.5", "margin = nan"),
     ["[promotion.boundary] margin: nan", "or inf"]),
    ("margin-is-string", edit("margin = 1.05", 'margin = "1.05"'), ['[promotion] margin: "1.05" is not a number']),
    ("margin-is-bool", edit("margin = 1.05", "margin = true"), ["[promotion] margin: true is not a number"]),
    ("allow-is-int", edit("allow = false", "allow = 0"), ["[promotion.boundary] allow: 0 is not a boolean"]),
    ("unknown-kind", edit('kind = "bucket"', 'kind = "turbo"'),
     ['[routes.pkv_bucket] kind: "turbo" is unknown', '"flashinfer", "bucket", "workqueue", "fused"']),
    ("unknown-kernel", edit('kernel = "split_decode"', 'kernel = "flash_decode"'),
     ['[routes.pkv_bucket] kernel: "flash_decode" is unknown', '"split_decode"', '"merge"']),
    ("kernel-kind-mismatch", edit('kernel = "split_decode"', 'kernel = "merge"'),
     ['[routes.pkv_bucket] kernel: "merge" does not implement kind "bucket"', 'expected "split_decode"']),
    ("no-baseline", edit('[routes.flashinfer]\nkind = "flashinfer"\n', ""),
     ['[routes] kind: no routes have kind "flashinfer"; expected exactly one baseline']),
    ("two-baselines", BASE + '\n[routes.fi_tc]\nkind = "flashinfer"\n',
     ["[routes] kind: 2 routes have kind \"flashinfer\" ['flashinfer', 'fi_tc']"]),
    ("missing-kind", edit('kind = "workqueue"\n', ""), ["[routes.pkv_workqueue] kind: missing"]),
    ("missing-kernel", edit('kernel = "workqueue_decode"\n', ""),
     ['[routes.pkv_workqueue] kernel: missing; expected kernel = "workqueue_decode" for kind']),
    ("missing-splits", edit("[routes.pkv_workqueue.splits]\nmin = 1\nmax = 64\nmultiple_of = 4\n", ""),
     ["[routes.pkv_workqueue] splits: missing", "a [routes.pkv_workqueue.splits] table"]),
    ("missing-gate-key", edit("min_context = 16384\n", ""), ["[gates] min_context: missing"]),
    ("missing-boundary", edit("[promotion.boundary]\nactive = 4\nmargin = 1.5\nallow = false\n", ""),
     ["[promotion] boundary: missing"]),
    ("missing-routes", BASE[: BASE.index("[routes.flashinfer]")], ["[top level] routes: missing"]),
    ("empty-routes", BASE[: BASE.index("[routes.flashinfer]")] + "[routes]\n", ["[top level] routes: empty"]),
    ("route-not-a-table", BASE.replace("[routes.flashinfer]", "[routes]\nextra = 1\n[routes.flashinfer]"),
     ["[routes] extra: 1 is not a table"]),
    ("bad-route-name", edit("[routes.pkv_bucket]", "[routes.PKV-bucket]").replace(
        "[routes.pkv_bucket.splits]", "[routes.PKV-bucket.splits]"),
     ["[routes] PKV-bucket: not a valid route name"]),
    ("uncompiled-group", edit("group_sizes = [4]", "group_sizes = [65, 4]"),
     ["[gates] group_sizes: 65 has no kernel", "64]"]),
    ("split-max-not-multiple", edit("min = 4\nmax = 64", "min = 4\nmax = 62"),
     ["[routes.pkv_bucket.splits] max: 62 is not a multiple of multiple_of = 4"]),
    ("coarse-not-ascending", edit("[16384, 32768]", "[32768, 16384]"),
     ["[routes.pkv_bucket] coarse_lengths: [32768, 16384] is not strictly ascending"]),
    ("coarse-not-tile-multiple", edit("[16384, 32768]", "[16384, 32770]"),
     ["coarse_lengths", "ascending multiples of 32 tokens"]),
    ("coarse-without-lengths", edit('bucketing = "exact"\ncoarse_lengths = [16384, 32768]', 'bucketing = "coarse"'),
     ['[routes.pkv_bucket] coarse_lengths: missing with bucketing = "coarse"']),
    ("unknown-bucketing", edit('bucketing = "exact"', 'bucketing = "fuzzy"'),
     ['[routes.pkv_bucket] bucketing: "fuzzy" is unknown', '"exact", "coarse"']),
    ("bucketing-on-workqueue", edit('kernel = "workqueue_decode"', 'kernel = "workqueue_decode"\nbucketing = "exact"'),
     ['[routes.pkv_workqueue] bucketing: not used by kind "workqueue"']),
    ("splits-on-baseline", edit('kind = "flashinfer"', 'kind = "flashinfer"\nsplits = {min = 1, max = 4, multiple_of = 1}'),
     ['[routes.flashinfer] splits: not used by kind "flashinfer"']),
    ("baseline-disabled", edit('kind = "flashinfer"', 'kind = "flashinfer"\nenabled = false'),
     ["[routes.flashinfer] enabled: the baseline cannot be disabled"]),
    ("gates-not-a-table", "gates = 3\n" + BASE[BASE.index("[promotion]"):],
     ["[top level] gates: 3 is not a table", "a [gates] table"]),
]


@pytest.mark.parametrize("text, substrings", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_each_error_names_file_table_and_key(tmp_path, text, substrings):
    path = write(tmp_path, text)
    with pytest.raises(RoutesError) as info:
        load_routes(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: "), msg
    assert "; expected " in msg, msg
    for s in substrings:
        assert s in msg, f"{s!r} not in {msg!r}"


def test_missing_file(tmp_path):
    with pytest.raises(RoutesError, match=r"nope\.toml: file not found; expected a routes\.toml"):
        load_routes(tmp_path / "nope.toml")


def test_not_utf8(tmp_path):
    p = tmp_path / "routes.toml"
    p.write_bytes(BASE.encode() + b"# \xff\n")
    with pytest.raises(RoutesError, match="is not UTF-8"):
        load_routes(p)


def test_routes_error_is_a_value_error():
    assert issubclass(RoutesError, ValueError)  # the CLI's catch-all relies on it


# ---- gates --------------------------------------------------------------------------------

SEED = load_routes(SHIPPED)
OK = dict(group_size=4, max_context=32768, active=8)


@pytest.mark.parametrize("name", ["pkv_bucket", "pkv_workqueue", "pkv_fused"])
@pytest.mark.parametrize("change, expected", [
    ({}, ()),
    ({"group_size": 8}, ("group size 8 is not calibrated (gates.group_sizes = [4])",)),
    ({"group_size": 1}, ("group size 1 is not calibrated (gates.group_sizes = [4])",)),
    ({"max_context": 16383}, ("longest context 16383 tokens is below gates.min_context = 16384",)),
    ({"max_context": 16384}, ()),
    ({"active": 9}, ("active count 9 is above gates.max_active = 8",)),
    ({"active": 0}, ("active count 0 is below gates.min_active = 1",)),
    ({"active": 1}, ()),
    ({"group_size": 2, "max_context": 100},
     ("group size 2 is not calibrated (gates.group_sizes = [4])",
      "longest context 100 tokens is below gates.min_context = 16384")),
])
def test_refusals_per_gate(name, change, expected):
    assert SEED.route(name).refusals(**{**OK, **change}) == expected


def test_baseline_is_never_refused():
    assert SEED.baseline.refusals(group_size=8, max_context=1, active=1000) == ()


def test_disabled_route_says_so():
    r = attrs.evolve(SEED.route("pkv_workqueue"), enabled=False)
    assert r.refusals(**OK) == ("disabled in routes.toml",)
    assert r.refusals(**{**OK, "group_size": 8})[0] == "disabled in routes.toml"


def test_route_gate_override_and_global_edit(tmp_path):
    text = SHIPPED.read_text()
    text = text.replace("min_context = 16384", "min_context = 8192")
    text += "\n[routes.pkv_workqueue.gates]\nmax_active = 32\ngroup_sizes = [4, 8]\n"
    reg = load_routes(write(tmp_path, text))
    wq, bucket = reg.route("pkv_workqueue"), reg.route("pkv_bucket")
    assert wq.gates == registry.Gates(group_sizes=(4, 8), min_context=8192, min_active=1, max_active=32)
    assert bucket.gates.min_context == 8192 and bucket.gates.max_active == 8
    step = dict(group_size=8, max_context=9000, active=16)
    assert wq.refusals(**step) == ()
    assert len(bucket.refusals(**step)) == 2  # G=8 and 16 active; 9000 tokens now passes
    assert reg.sha256 != SEED.sha256


# ---- split bounds -------------------------------------------------------------------------

@pytest.mark.parametrize("bounds, candidates", [
    ((4, 64, 4), tuple(range(4, 65, 4))),
    ((1, 64, 4), (1,) + tuple(range(4, 65, 4))),
    ((1, 1, 4), (1,)),
    ((1, 3, 1), (1, 2, 3)),
    ((2, 6, 2), (2, 4, 6)),
    ((8, 8, 8), (8,)),
])
def test_candidates(bounds, candidates):
    assert SplitBounds(*bounds).candidates() == candidates


@pytest.mark.parametrize("bounds, s, clamped", [
    ((4, 64, 4), 0, 4), ((4, 64, 4), 6, 4), ((4, 64, 4), 7, 8), ((4, 64, 4), 30, 28),
    ((4, 64, 4), 1000, 64), ((1, 64, 4), 2, 1), ((1, 64, 4), 3, 4), ((1, 64, 4), 1, 1),
    ((1, 64, 4), 20, 20),
])
def test_clamp(bounds, s, clamped):
    assert SplitBounds(*bounds).clamp(s) == clamped


@st.composite
def split_bounds(draw):
    mult = draw(st.integers(1, 8))
    lo = draw(st.sampled_from([1, mult * draw(st.integers(1, 8))]))
    hi = max(lo, mult * draw(st.integers(1, 16)))
    return SplitBounds(min=lo, max=hi, multiple_of=mult)


@given(split_bounds(), st.integers(-10, 200))
def test_candidates_and_clamp_properties(b, s):
    c = b.candidates()
    assert c and list(c) == sorted(set(c))
    assert all(b.min <= x <= b.max for x in c)
    assert all(x % b.multiple_of == 0 for x in c if x > 1)
    assert (1 in c) == (b.min == 1)
    got = b.clamp(s)
    assert got in c
    best = min(abs(x - s) for x in c)
    assert abs(got - s) == best and got == min(x for x in c if abs(x - s) == best)


@given(split_bounds())
def test_validated_bounds_have_their_candidates(tmp_path_factory, b):
    # a file with these bounds loads, and the loaded bounds give the same candidates
    text = edit("min = 1\nmax = 64\nmultiple_of = 4", f"min = {b.min}\nmax = {b.max}\nmultiple_of = {b.multiple_of}")
    reg = load_routes(write(tmp_path_factory.mktemp("b"), text))
    assert reg.route("pkv_workqueue").splits.candidates() == b.candidates()


# ---- margins ------------------------------------------------------------------------------

@pytest.mark.parametrize("active, margin", [(1, 1.05), (2, 1.05), (4, 1.5), (5, 1.05), (8, 1.05)])
def test_margin_for_seed(active, margin):
    for name in ("pkv_bucket", "pkv_workqueue", "pkv_fused"):
        assert SEED.margin_for(SEED.route(name), active) == margin
    assert SEED.margin_for(SEED.baseline, active) == 1.0


def _with(tmp_path, old, new) -> Registry:
    text = SHIPPED.read_text()
    assert old in text
    return load_routes(write(tmp_path, text.replace(old, new, 1)))


def test_allow_flag_drops_the_boundary_rule(tmp_path):
    reg = _with(tmp_path, "allow = false", "allow = true")
    assert reg.boundary.allow
    assert reg.margin_for(reg.route("pkv_workqueue"), 4) == 1.05


def test_infinite_boundary_margin_forbids(tmp_path):
    reg = _with(tmp_path, "margin = 1.50", "margin = inf")
    assert reg.margin_for(reg.route("pkv_workqueue"), 4) is None
    assert reg.margin_for(reg.route("pkv_workqueue"), 8) == 1.05


def test_route_margin_above_boundary_wins(tmp_path):
    reg = _with(tmp_path, 'kernel = "workqueue_decode"', 'kernel = "workqueue_decode"\nmargin = 2')
    wq = reg.route("pkv_workqueue")
    assert wq.margin == 2.0 and reg.route("pkv_bucket").margin == 1.05
    assert reg.margin_for(wq, 4) == 2.0 and reg.margin_for(wq, 8) == 2.0


def test_boundary_moves_with_the_file(tmp_path):
    reg = _with(tmp_path, "active = 4", "active = 2")
    wq = reg.route("pkv_workqueue")
    assert reg.margin_for(wq, 2) == 1.5 and reg.margin_for(wq, 4) == 1.05


def test_default_margin_edit(tmp_path):
    reg = _with(tmp_path, "margin = 1.05", "margin = 1.2")
    assert {r.margin for r in reg.routes if r.kind != "flashinfer"} == {1.2}
    assert reg.margin_for(reg.route("pkv_bucket"), 4) == 1.5


def test_route_lookup():
    assert SEED.route("pkv_fused").kind == "fused"
    with pytest.raises(KeyError, match="known routes: flashinfer, pkv_bucket, pkv_workqueue, pkv_fused"):
        SEED.route("pkv_turbo")


def test_disabled_in_file(tmp_path):
    reg = _with(tmp_path, 'kernel = "split_decode"', 'kernel = "split_decode"\nenabled = false')
    assert reg.route("pkv_bucket").refusals(**OK) == ("disabled in routes.toml",)
    assert reg.route("pkv_workqueue").refusals(**OK) == ()


def test_coarse_mode(tmp_path):
    reg = _with(tmp_path, 'bucketing = "exact"', 'bucketing = "coarse"')
    b = reg.route("pkv_bucket")
    assert b.bucketing == "coarse" and b.coarse_lengths == SEED.route("pkv_bucket").coarse_lengths
