"""Request traces and the continuous-decode loop that turns them into decode steps.

A trace is a list of requests (arrival step, prompt length, decode length). It comes from one of
three places:

- a synthetic family (paper section 3.8), drawn from a NumPy ``Generator`` seeded by ``seed``;
- ``"mixed"``: the redistributable fixture ``pkvrt/_data/traces/mixed.csv`` (32 requests, written
  by :func:`mixed_fixture` with seed :data:`MIXED_SEED`; regenerate it with
  ``write_csv(mixed_fixture(), "pkvrt/_data/traces/mixed.csv")``);
- a CSV or JSON file (docs/traces.md says how to convert the public Azure and Mooncake traces).

File formats (what :func:`load_trace` accepts; docs/traces.md describes them with examples):

- CSV: a header line, then one request per line. Columns ``prompt_len`` and ``decode_len`` are
  required, ``arrival_step`` is optional (0 when absent); any column order. Any other column
  name is an error naming the file, the column and the accepted columns (a misspelt optional
  column would otherwise be silently absent); so is a column named twice. Blank lines are
  skipped.
- JSON: a list of objects, or an object ``{"requests": [...]}`` (its other keys are ignored but
  ``block_tokens``), each request object with the same keys and no others (JSON integers only),
  plus an optional ``hash_ids``: the prompt's prefix blocks as hashes, a list of integers >= 0
  (Mooncake's form: block ``j`` covers prompt tokens ``[j * block_tokens, (j + 1) *
  block_tokens)``, ``block_tokens`` 512 unless the object says otherwise; equal hashes at equal
  positions mean the same tokens, so prefix caching gives those blocks the same pages:
  :func:`pkvrt.measure.pagetable.build_layout`).

Values must be integers: lengths >= 1, arrival_step >= 0. Request ids are the 0-based position
in the file; a trace's ids are always ``0..n-1`` so that they index page-table rows.

The decode loop (paper section 3.6) is :func:`decode_steps`; see its docstring for the rules.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Iterator

import attrs
import numpy as np

from pkvrt._paths import PACKAGE

FAMILIES = ("bucketed", "homogeneous", "bimodal", "uniform", "zipf", "parallel", "sysprompt")

# Shared by every synthetic family: decode lengths are uniform integers in this range, so that a
# 32-request B8 run lasts about 32 * 80 / 8 = 320 steps (short on a GPU, long enough to average).
DECODE_RANGE = (32, 128)
# uniform and zipf draw prompt lengths over this range (1K..64K tokens).
BROAD_RANGE = (1024, 65536)
BUCKETED_LENGTHS = (8192, 16384, 32768, 65536)
HOMOGENEOUS_LENGTH = 32768
BIMODAL_LONG = (30720, 34816)   # ~32K
BIMODAL_SHORT = (1024, 4096)    # ~1K-4K
ZIPF_EXPONENT = 1.0             # P(class k) ~ k^-s over 63 classes of 1K tokens
# Families whose requests share prompt prefixes (pages shared by prefix caching, build_layout):
BLOCK_TOKENS = 512              # tokens per prefix-hash block (Mooncake's block size)
PARALLEL_SAMPLES = 8            # parallel: requests (samples) per prompt
PARALLEL_RANGE = (2048, 32768)  # parallel: prompt lengths
SYSTEM_PROMPT_TOKENS = 4096     # sysprompt: the system prompt every request starts with
SYSTEM_USER_RANGE = (256, 4096)  # sysprompt: each request's own tokens after it
_GROUP_HASH = 1 << 20           # hash ids of group g's blocks: g * _GROUP_HASH + block

MIXED_SEED = 20260620
FIXTURE_DIR = PACKAGE / "_data" / "traces"
_INT32_MAX = 2**31 - 1
_FIELDS = ("arrival_step", "prompt_len", "decode_len")
_JSON_KEYS = (*_FIELDS, "hash_ids")
_REQUIRED = ("prompt_len", "decode_len")
_ACCEPTED = "prompt_len, decode_len (required), arrival_step (optional)"
_INT_RE = re.compile(r"[+-]?[0-9]+")


class TraceError(ValueError):
    """A trace file is malformed. Names the file, the 1-based line (header = line 1) and field.

    Attributes ``file``, ``line`` and ``field`` hold the parts (``field`` may be ``None`` when the
    whole line or file is at fault).
    """

    def __init__(self, file, line: int, field: str | None, expected: str):
        self.file, self.line, self.field, self.expected = str(file), line, field, expected
        where = f"{self.file}, line {line}" + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {expected}")

    def __reduce__(self):
        return (TraceError, (self.file, self.line, self.field, self.expected))


def _check_prefix(_inst, _attr, value):
    for j, h in enumerate(value):
        if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or h < 0:
            raise ValueError(f"Request.prefix[{j}]: expected an integer hash >= 0, got {h!r}")


def _positive(name: str, minimum: int):
    def check(_inst, _attr, value):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not (
                minimum <= value <= _INT32_MAX):
            raise ValueError(f"Request.{name}: expected an integer in [{minimum}, 2**31-1], "
                             f"got {value!r}")
    return check


@attrs.frozen
class Request:
    """One request: it arrives at ``arrival_step``, holds ``prompt_len`` tokens of KV, and then
    generates ``decode_len`` tokens, one per decode step. ``prefix``: hashes of the prompt's
    blocks of ``Trace.block_tokens`` tokens (equal hashes at equal positions: the same tokens)."""

    rid: int = attrs.field(validator=_positive("rid", 0))
    arrival_step: int = attrs.field(validator=_positive("arrival_step", 0))
    prompt_len: int = attrs.field(validator=_positive("prompt_len", 1))
    decode_len: int = attrs.field(validator=_positive("decode_len", 1))
    # hashes of the prompt's prefix blocks (Trace.block_tokens tokens each), () when unknown
    prefix: tuple = attrs.field(default=(), converter=tuple, validator=_check_prefix)


def _check_requests(_inst, _attr, requests):
    if len(requests) == 0:
        raise ValueError("Trace.requests: expected at least one request, got none")
    for i, r in enumerate(requests):
        if not isinstance(r, Request) or r.rid != i:
            raise ValueError(f"Trace.requests[{i}]: expected a Request with rid={i}, got {r!r}")
        if r.prompt_len + r.decode_len > _INT32_MAX:
            raise ValueError(f"Trace.requests[{i}]: expected prompt_len + decode_len <= 2**31-1, "
                             f"got {r!r}")


@attrs.frozen
class Trace:
    """A named, ordered set of requests. ``seed`` is None for file traces; ``source`` says where
    it came from (``synthetic:<family>`` or the file path); ``block_tokens`` is the block size
    of the requests' prefix hashes."""

    name: str
    requests: tuple[Request, ...] = attrs.field(converter=tuple, validator=_check_requests)
    seed: int | None
    source: str
    block_tokens: int = attrs.field(default=BLOCK_TOKENS, validator=_positive("block_tokens", 1))

    def __len__(self) -> int:
        return len(self.requests)

    def column(self, field: str) -> np.ndarray:
        """int64 [num_requests]: one field of every request, in rid order."""
        return np.array([getattr(r, field) for r in self.requests], dtype=np.int64)


def _from_columns(name, arrival, prompt, decode, seed, source, prefixes=None,
                  block_tokens: int = BLOCK_TOKENS) -> Trace:
    prefixes = prefixes if prefixes is not None else [()] * len(prompt)
    reqs = (Request(i, int(a), int(p), int(d), tuple(int(h) for h in f))
            for i, (a, p, d, f) in enumerate(zip(arrival, prompt, decode, prefixes)))
    return Trace(name=name, requests=tuple(reqs), seed=seed, source=source,
                 block_tokens=block_tokens)


def _blocks(tokens: int) -> int:
    return -(-int(tokens) // BLOCK_TOKENS)


# --------------------------------------------------------------------------- synthetic families

def synthetic(family: str, *, num_requests: int, seed: int,
              decode_range: tuple[int, int] = DECODE_RANGE) -> Trace:
    """Draw a synthetic trace of ``family`` (paper section 3.8). All requests arrive at step 0, so
    the decode loop keeps ``max_active`` slots full until the queue drains.

    Prompt lengths (tokens), by family:

    - ``bucketed``: cycles 8192, 16384, 32768, 65536 by request id (rid 5 -> 16384).
    - ``homogeneous``: 32768 for every request.
    - ``bimodal``: in every block of four consecutive requests one is long, uniform in
      [30720, 34816] (~32K), at a random position, and three are short, uniform in [1024, 4096].
    - ``uniform``: uniform in [1024, 65536].
    - ``zipf``: heavy-tailed over [1024, 65536]: a 1K class ``k`` in 1..63 with P(k) ~ 1/k
      (Zipf, s=1: P(k=1) = 1/H_63 = 0.21, P(k >= 16) = 0.30), then uniform in
      [1024*k, 1024*(k+1)].
    - ``parallel``: parallel sampling, n = 8: requests 8g .. 8g+7 are 8 samples of one prompt,
      uniform in [2048, 32768] per group; their prefix hashes are the group's blocks, so prefix
      caching gives the 8 rows the prompt's pages.
    - ``sysprompt``: every request starts with the same 4096-token system prompt (8 blocks of
      shared hashes), then its own tokens, uniform in [256, 4096].

    Decode lengths are uniform integers in ``decode_range`` (default [32, 128]) for every family.

    Parameters
    ----------
    family : one of :data:`FAMILIES`.
    num_requests : number of requests (>= 1).
    seed : seeds ``np.random.default_rng``; the same (family, num_requests, seed) gives the same
        trace.
    decode_range : inclusive (low, high) decode lengths.
    """
    if family not in FAMILIES:
        raise ValueError(f"synthetic(family={family!r}): expected one of {FAMILIES}")
    if isinstance(num_requests, bool) or not isinstance(num_requests, (int, np.integer)) \
            or num_requests < 1:
        raise ValueError(f"synthetic(num_requests={num_requests!r}): expected an integer >= 1")
    lo, hi = decode_range
    if not 1 <= lo <= hi:
        raise ValueError(f"synthetic(decode_range={decode_range!r}): expected 1 <= low <= high")
    rng = np.random.default_rng(seed)
    n = int(num_requests)
    if family == "bucketed":
        prompt = np.resize(np.array(BUCKETED_LENGTHS), n)
    elif family == "homogeneous":
        prompt = np.full(n, HOMOGENEOUS_LENGTH)
    elif family == "bimodal":
        blocks = -(-n // 4)
        long_pos = rng.integers(0, 4, size=blocks)              # position of the long one
        is_long = (np.arange(blocks * 4) % 4 == np.repeat(long_pos, 4))[:n]
        long_len = rng.integers(BIMODAL_LONG[0], BIMODAL_LONG[1], size=n, endpoint=True)
        short_len = rng.integers(BIMODAL_SHORT[0], BIMODAL_SHORT[1], size=n, endpoint=True)
        prompt = np.where(is_long, long_len, short_len)
    elif family == "uniform":
        prompt = rng.integers(BROAD_RANGE[0], BROAD_RANGE[1], size=n, endpoint=True)
    elif family == "zipf":
        k = np.arange(1, BROAD_RANGE[1] // 1024)                 # classes 1..63
        p = k ** -ZIPF_EXPONENT
        cls = rng.choice(k, size=n, p=p / p.sum())
        prompt = cls * 1024 + rng.integers(0, 1024, size=n, endpoint=True)
    elif family == "parallel":
        group = np.arange(n) // PARALLEL_SAMPLES
        per_group = rng.integers(PARALLEL_RANGE[0], PARALLEL_RANGE[1], size=group[-1] + 1, endpoint=True)
        prompt = per_group[group]
    else:  # sysprompt
        prompt = SYSTEM_PROMPT_TOKENS + rng.integers(*SYSTEM_USER_RANGE, size=n, endpoint=True)
    decode = rng.integers(lo, hi, size=n, endpoint=True)
    return _from_columns(family, np.zeros(n, np.int64), prompt, decode, int(seed),
                         f"synthetic:{family}", _synthetic_prefixes(family, prompt))


def _synthetic_prefixes(family: str, prompt: np.ndarray) -> list[tuple[int, ...]] | None:
    """The prefix hashes of a sharing family's requests (None for the others): ``parallel``'s
    group g hashes its blocks g * 2^20 + j; ``sysprompt``'s system blocks hash 0..7 for every
    request, the rest of request r's blocks (r + 1) * 2^20 + j."""
    if family == "parallel":
        return [tuple((r // PARALLEL_SAMPLES) * _GROUP_HASH + j for j in range(_blocks(p)))
                for r, p in enumerate(prompt)]
    if family == "sysprompt":
        shared = SYSTEM_PROMPT_TOKENS // BLOCK_TOKENS
        return [tuple(range(shared)) + tuple((r + 1) * _GROUP_HASH + j for j in range(shared, _blocks(p)))
                for r, p in enumerate(prompt)]
    return None


def mixed_fixture(seed: int = MIXED_SEED) -> Trace:
    """The generator of the shipped ``mixed.csv`` fixture: 32 requests with staggered arrivals.

    Prompt lengths: a quarter long, uniform in [16384, 49152]; a quarter medium, uniform in
    [4096, 16383]; half short, uniform in [256, 4095] (kinds shuffled). Decode lengths uniform in
    [32, 128]. The first 8 requests arrive at step 0, each later one 0..16 steps (mean 8) after
    the previous: with mean decode 80, Little's law gives 80 / 8 = 10 requests in the system on
    average, so max_active=8 stays mostly full and a queue forms at times.
    """
    rng = np.random.default_rng(seed)
    n = 32
    kind = rng.permutation(np.repeat([0, 1, 2, 2], n // 4))     # 0 long, 1 medium, 2 short
    bounds = np.array([[16384, 49152], [4096, 16383], [256, 4095]])
    lo, hi = bounds[kind, 0], bounds[kind, 1]
    prompt = lo + rng.integers(0, hi - lo, endpoint=True)
    decode = rng.integers(32, 128, size=n, endpoint=True)
    gaps = np.concatenate([np.zeros(8, np.int64), rng.integers(0, 16, size=n - 8, endpoint=True)])
    return _from_columns("mixed", np.cumsum(gaps), prompt, decode, int(seed), "synthetic:mixed")


# --------------------------------------------------------------------------- files

def write_csv(trace: Trace, path) -> None:
    """Write ``trace`` as CSV with header ``arrival_step,prompt_len,decode_len``. A trace whose
    requests carry prefix hashes is refused (CSV holds none: :func:`write_json`)."""
    if any(r.prefix for r in trace.requests):
        raise ValueError(f"write_csv: trace {trace.name!r} carries prefix hashes, which CSV does "
                         "not hold; use write_json")
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(_FIELDS)
        for r in trace.requests:
            w.writerow((r.arrival_step, r.prompt_len, r.decode_len))


def write_json(trace: Trace, path) -> None:
    """Write ``trace`` as JSON: ``{"block_tokens": ..., "requests": [...]}``, each request with
    its ``hash_ids`` when it has prefix hashes (what :func:`load_trace` reads back)."""
    reqs = []
    for r in trace.requests:
        obj = {"arrival_step": r.arrival_step, "prompt_len": r.prompt_len, "decode_len": r.decode_len}
        if r.prefix:
            obj["hash_ids"] = list(r.prefix)
        reqs.append(obj)
    with open(path, "w") as f:
        json.dump({"block_tokens": trace.block_tokens, "requests": reqs}, f)
        f.write("\n")


def _parse_int(path, line: int, field: str, raw, *, from_json: bool) -> int:
    minimum = 0 if field == "arrival_step" else 1
    expected = f"expected an integer in [{minimum}, 2**31-1]"
    if from_json:
        ok = isinstance(raw, int) and not isinstance(raw, bool)
        value = raw if ok else None
    else:
        text = raw.strip()
        value = int(text) if _INT_RE.fullmatch(text) else None
    if value is None:
        raise TraceError(path, line, field, f"{expected}, got {raw!r}")
    if value < minimum:
        what = "a length must be positive" if minimum else "an arrival step cannot be negative"
        raise TraceError(path, line, field, f"{expected} ({what}), got {value}")
    if value > _INT32_MAX:
        raise TraceError(path, line, field, f"{expected} (int32), got {value}")
    return value


def _row(path, line: int, values: dict[str, int]) -> tuple[int, int, int]:
    """(arrival_step, prompt_len, decode_len); the final seq_len must fit int32."""
    if values["prompt_len"] + values["decode_len"] > _INT32_MAX:
        raise TraceError(path, line, "decode_len", "expected prompt_len + decode_len <= 2**31-1 "
                         "(the last step's seq_len is int32)")
    return values.get("arrival_step", 0), values["prompt_len"], values["decode_len"]


def _load_csv(path: Path, text: str) -> list[tuple[int, int, int]]:
    reader = csv.reader(text.splitlines())
    header = next(reader, None)
    if header is None or not any(h.strip() for h in header):
        raise TraceError(path, 1, None, "expected a header line with columns prompt_len,"
                         "decode_len[,arrival_step], got an empty file")
    names = [h.strip() for h in header]
    for i, name in enumerate(names):
        if not name:
            raise TraceError(path, 1, None, f"column {i + 1} of the header has no name (a "
                             f"trailing comma?); the accepted columns are {_ACCEPTED}")
        if name not in _FIELDS:
            raise TraceError(path, 1, name, f"unknown column; the accepted columns are "
                             f"{_ACCEPTED}")
        if names.count(name) > 1:
            raise TraceError(path, 1, name, "expected each column once, got it "
                             f"{names.count(name)} times")
    for name in _REQUIRED:
        if name not in names:
            raise TraceError(path, 1, name, f"expected a column named {name!r} in the header, "
                             f"got columns {names}")
    cols = {f: names.index(f) for f in _FIELDS if f in names}
    rows = []
    for record in reader:
        line = reader.line_num
        if not any(c.strip() for c in record):
            continue
        values = {}
        for field, col in cols.items():
            if col >= len(record):
                raise TraceError(path, line, field, f"expected {len(names)} comma-separated "
                                 f"values, got {len(record)} (no value for this column)")
            values[field] = _parse_int(path, line, field, record[col], from_json=False)
        rows.append(_row(path, line, values))
    if not rows:
        raise TraceError(path, 2, None, "expected at least one request line after the header, "
                         "got none")
    return rows


def _json_elements(text: str) -> list[tuple[object, int]]:
    """(value, 1-based line where it starts) for each element of the top-level request list."""
    dec = json.JSONDecoder()
    ws = " \t\n\r"

    def skip(i):
        while i < len(text) and text[i] in ws:
            i += 1
        return i

    def line_of(i):
        return text.count("\n", 0, i) + 1

    def array_at(i):
        out, i = [], skip(i + 1)
        if text[i] == "]":
            return out
        while True:
            value, end = dec.raw_decode(text, i)
            out.append((value, line_of(i)))
            i = skip(end)
            if text[i] == "]":
                return out
            i = skip(i + 1)                                      # past the ','

    i = skip(0)
    if text[i] == "[":
        return array_at(i)
    found = None                                                 # json.loads keeps the last
    i = skip(i + 1)                                              # inside the top-level object
    while text[i] != "}":
        key, end = dec.raw_decode(text, i)
        i = skip(skip(end) + 1)                                  # past the ':'
        if key == "requests":
            found = i
        _, end = dec.raw_decode(text, i)
        i = skip(end)
        if text[i] == ",":
            i = skip(i + 1)
    return array_at(found)


def _load_json(path: Path, text: str) -> tuple[list, list, int]:
    """(rows, prefixes, block_tokens) of a JSON trace."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(path, e.lineno, None, f"expected valid JSON: {e.msg} "
                         f"(column {e.colno})") from None
    if isinstance(doc, dict):
        if not isinstance(doc.get("requests"), list):
            raise TraceError(path, 1, "requests", "expected a list of request objects under "
                             f"key 'requests', got keys {sorted(doc)}")
    elif not isinstance(doc, list):
        raise TraceError(path, 1, None, "expected a JSON list of request objects or "
                         f'{{"requests": [...]}}, got {type(doc).__name__}')
    block = BLOCK_TOKENS
    if isinstance(doc, dict) and "block_tokens" in doc:
        block = doc["block_tokens"]
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= _INT32_MAX:
            raise TraceError(path, 1, "block_tokens", f"expected an integer >= 1, got {block!r}")
    elements = _json_elements(text)
    if not elements:
        raise TraceError(path, 1, "requests", "expected at least one request, got an empty list")
    rows, prefixes = [], []
    for obj, line in elements:
        if not isinstance(obj, dict):
            raise TraceError(path, line, None, f"expected a request object, got {obj!r}")
        for name in obj:
            if name not in _JSON_KEYS:
                raise TraceError(path, line, name, f"unknown key; the accepted keys are "
                                 f"{_ACCEPTED}, hash_ids (optional)")
        for name in _REQUIRED:
            if name not in obj:
                raise TraceError(path, line, name, f"expected key {name!r} in the request "
                                 f"object, got keys {sorted(obj)}")
        values = {f: _parse_int(path, line, f, obj[f], from_json=True)
                  for f in _FIELDS if f in obj}
        rows.append(_row(path, line, values))
        hashes = obj.get("hash_ids", [])
        if not isinstance(hashes, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0
                                               for h in hashes):
            raise TraceError(path, line, "hash_ids", f"expected a list of integers >= 0, got {hashes!r}")
        prefixes.append(tuple(hashes))
    return rows, prefixes, block


def load_trace(path) -> Trace:
    """Load a CSV (``.csv`` or anything not ``.json``) or JSON (``.json``) trace file.

    See the module docstring for the formats. Raises :class:`TraceError` naming the file, line
    and field for a missing or unknown column/key, a non-integer, a length < 1, a negative
    arrival step, an empty file, or malformed JSON; ``FileNotFoundError`` if the file does not
    exist.
    """
    path = Path(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TraceError(path, raw.count(b"\n", 0, e.start) + 1, None,
                         f"expected UTF-8 text, got byte 0x{raw[e.start]:02x}") from None
    prefixes, block = None, BLOCK_TOKENS
    if path.suffix.lower() == ".json":
        rows, prefixes, block = _load_json(path, text)
    else:
        rows = _load_csv(path, text)
    arrival, prompt, decode = zip(*rows)
    return _from_columns(path.stem, arrival, prompt, decode, None, str(path), prefixes, block)


def resolve_trace(spec: str, *, num_requests: int | None = None, seed: int) -> Trace:
    """Turn a ``--trace`` value into a trace.

    ``spec`` is a family name (drawn with ``num_requests``, default 32, and ``seed``), ``"mixed"``
    (the shipped fixture), or a path to a CSV/JSON file. For the fixture and files ``seed`` is not
    used and ``num_requests``, when given, keeps the first ``num_requests`` requests.
    """
    if spec in FAMILIES:
        return synthetic(spec, num_requests=32 if num_requests is None else num_requests,
                         seed=seed)
    path = FIXTURE_DIR / "mixed.csv" if spec == "mixed" else Path(spec)
    if not path.is_file():
        raise ValueError(f"--trace {spec!r}: expected a family {FAMILIES}, 'mixed', or an "
                         f"existing .csv/.json file; no file at {path}")
    trace = load_trace(path)
    if spec == "mixed":
        trace = attrs.evolve(trace, name="mixed")
    if num_requests is not None:
        if num_requests < 1:
            raise ValueError(f"num_requests={num_requests}: expected >= 1")
        trace = attrs.evolve(trace, requests=trace.requests[:num_requests])
    return trace


# --------------------------------------------------------------------------- decode loop

@attrs.frozen(eq=False)
class Step:
    """One decode step of the continuous-decode loop.

    ``index`` counts emitted steps from 0; ``clock`` is the step on the trace's arrival axis
    (equal to ``index`` until an idle gap is skipped). ``rids``: int32 [B] active request ids in
    admission order; ``seq_lens``: int32 [B] their KV lengths this step, new token included.
    """

    index: int
    rids: np.ndarray
    seq_lens: np.ndarray
    clock: int = 0


def decode_steps(trace: Trace, *, max_active: int) -> Iterator[Step]:
    """Run continuous decode over ``trace`` (paper section 3.6), yielding one :class:`Step` each.

    Rules: at the start of step ``clock``, requests with ``arrival_step <= clock`` are admitted
    in arrival order (ties by rid) while fewer than ``max_active`` are active. An active request
    that has generated ``g`` tokens has ``seq_len = prompt_len + g + 1`` (its new token
    included); every active request generates one token per step and leaves after
    ``decode_len`` steps. When nothing is active the clock jumps to the next arrival (idle gaps
    are skipped). Example: prompt 100, decode 3, arriving at step 5 -> seq_lens 101, 102, 103 at
    clocks 5, 6, 7.
    """
    if isinstance(max_active, bool) or not isinstance(max_active, (int, np.integer)) \
            or max_active < 1:
        raise ValueError(f"decode_steps(max_active={max_active!r}): expected an integer >= 1")
    arrival = trace.column("arrival_step")
    prompt = trace.column("prompt_len")
    decode = trace.column("decode_len")
    order = np.lexsort((np.arange(len(arrival)), arrival))     # arrival order, ties by rid
    nxt = 0                                                       # next request in `order`
    active = np.zeros(0, np.int64)                                # rids, admission order
    generated = np.zeros(0, np.int64)
    clock = index = 0
    while nxt < len(order) or len(active):
        if not len(active) and arrival[order[nxt]] > clock:
            clock = int(arrival[order[nxt]])                      # skip the idle gap
        free = max_active - len(active)
        take = 0
        while take < free and nxt + take < len(order) and arrival[order[nxt + take]] <= clock:
            take += 1
        if take:
            active = np.concatenate([active, order[nxt:nxt + take]])
            generated = np.concatenate([generated, np.zeros(take, np.int64)])
            nxt += take
        seq = prompt[active] + generated + 1
        yield Step(index=index, rids=active.astype(np.int32), seq_lens=seq.astype(np.int32),
                   clock=clock)
        generated = generated + 1
        keep = generated < decode[active]
        active, generated = active[keep], generated[keep]
        clock += 1
        index += 1
