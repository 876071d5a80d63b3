"""The ctypes mirrors of the kernels' parameter structs (pkvrt/launch/ops.py) have the fields of
the C structs in kernels/ in the same order and with matching types: a field added on one side
only would shift every later field the kernel reads (no compiler sees both)."""

import ctypes
import re

import pytest

from pkvrt import _paths
from pkvrt.launch import ops

_C_TYPES = {"int": ctypes.c_int, "unsigned": ctypes.c_uint, "float": ctypes.c_float, "double": ctypes.c_double,
            "long long": ctypes.c_longlong, "unsigned long long": ctypes.c_ulonglong}


def c_fields(source: str, struct: str) -> list[tuple[str, object]]:
    """(name, ctypes type) of every field of ``struct`` in a kernel source, in order; pointers
    of any type are c_void_p."""
    body = re.search(r"struct\s+" + struct + r"\s*\{(.*?)\n\};", source, re.S)
    assert body, f"struct {struct} not found"
    fields = []
    for line in body.group(1).splitlines():
        decl = line.split("//")[0].strip()
        if not decl:
            continue
        m = re.fullmatch(r"(?:const\s+)?(unsigned long long|long long|unsigned|int|float|double|void|char)"
                         r"((?:\s*\*?\s*\w+\s*,)*\s*\*?\s*\w+)\s*;", decl)
        assert m, f"struct {struct}: cannot read the declaration {decl!r}"
        base, names = m.groups()
        # C binds * to each declarator: in `int* a, b;` only a is a pointer
        for i, name in enumerate(names.split(",")):
            star = name.strip().startswith("*")
            name = name.strip().lstrip("*").strip()
            assert base in _C_TYPES or star, f"struct {struct}: no ctypes type for {base!r} {name}"
            fields.append((name, ctypes.c_void_p if star else _C_TYPES[base]))
    return fields


@pytest.mark.parametrize("struct, source", [("DecodeParams", "decode_common.cuh"),
                                            ("MergeParams", "merge.cu"),
                                            ("SegmentParams", "merge.cu"),
                                            ("PlanParams", "plan_workqueue.cu"),
                                            ("FindSharedParams", "find_shared.cu")])
def test_ctypes_mirror_matches_the_kernel_struct(struct, source):
    text = (_paths.CHECKOUT / "kernels" / source).read_text()
    assert c_fields(text, struct) == list(getattr(ops, struct)._fields_)


def test_trace_buffer_width_matches_the_kernels():
    """ops.TRACE_MARKS (the width every timeline buffer is allocated and checked with) is the
    kernels' kTraceMarks, and every TraceMark index fits in it: a mark past the width would write
    into the next CTA's row."""
    text = (_paths.CHECKOUT / "kernels" / "decode_common.cuh").read_text()
    width = re.search(r"constexpr int kTraceMarks = (\d+);", text)
    marks = re.search(r"enum TraceMark \{([^}]*)\}", text)
    assert width and marks
    assert int(width.group(1)) == ops.TRACE_MARKS
    values = [int(v) for v in re.findall(r"=\s*(\d+)", marks.group(1))]
    assert sorted(values) == list(range(ops.TRACE_MARKS))


def test_the_reader_refuses_what_it_cannot_read():
    with pytest.raises(AssertionError, match="cannot read"):
        c_fields("struct S {\n  int a[4];\n};", "S")
    assert c_fields("struct S {\n  const int* a, *b;  // x\n  long long c;\n  int* d, e;\n"
                    "  unsigned long long f;\n};", "S") == [
        ("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("c", ctypes.c_longlong),
        ("d", ctypes.c_void_p), ("e", ctypes.c_int), ("f", ctypes.c_ulonglong)]


@pytest.mark.parametrize("env, expected", [(None, 1), ("1", 1), ("0", 0)])
def test_merge_early_trigger_default_on_and_its_ablation_switch(env, expected):
    """kernels/merge.cu's early launch_dependents is on unless PKVRT_MERGE_TRIGGER=0 (read once
    per process, like PKVRT_PDL)."""
    import os
    import subprocess
    import sys

    e = {k: v for k, v in os.environ.items() if k != "PKVRT_MERGE_TRIGGER"}
    if env is not None:
        e["PKVRT_MERGE_TRIGGER"] = env
    out = subprocess.run([sys.executable, "-c", "from pkvrt.launch import ops; "
                          "print(ops._MERGE_EARLY_TRIGGER)"], env=e, capture_output=True,
                         text=True, check=True, cwd=_paths.CHECKOUT)
    assert out.stdout.strip() == str(expected)
