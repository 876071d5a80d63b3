"""Device-side workqueue planning equals the host planner, and runs inside a CUDA graph."""

import attrs
import numpy as np
import pytest
import torch

from pkvrt import reference
from pkvrt.launch import ops
from pkvrt.policy import planner
from pkvrt.policy.calibration import find_calibration
from pkvrt.policy.registry import load_routes
from paged import make_batch, rel_err

pytestmark = pytest.mark.gpu
H_KV, MAX_ROWS = 8, 64
DEV = "cuda"   # (a CPU dry run of this file's logic sets it to "cpu" with emulated kernels)


def _buffers(max_rows, capacity):
    i32 = dict(device=DEV, dtype=torch.int32)
    return dict(tasks=torch.full((capacity, 5), -7, **i32), num_tasks=torch.zeros(1, **i32),
                split_offsets=torch.zeros(max_rows + 1, **i32), num_splits=torch.zeros(max_rows, **i32),
                status=torch.zeros(1, **i32))


def _assert_same_plan(a: dict, b: dict) -> None:
    """Two planning launches' buffers hold the same plan: status, task count, splits, offsets
    and every task."""
    for key in ("status", "num_tasks", "num_splits", "split_offsets"):
        assert torch.equal(a[key], b[key]), key
    n = a["num_tasks"].item()
    assert torch.equal(a["tasks"][:n], b["tasks"][:n])


def _device_plan(seq, bufs, splits, cal, split_pin=None):
    seq_dev = torch.zeros(MAX_ROWS, dtype=torch.int32, device=DEV)
    seq_dev[: len(seq)] = torch.as_tensor(seq, dtype=torch.int32)
    rows = torch.tensor([len(seq)], dtype=torch.int32, device=DEV)
    cand = torch.tensor(splits.candidates(), dtype=torch.int32, device=DEV)
    ops.plan_workqueue_device(seq_dev, rows, bufs["tasks"], bufs["num_tasks"], bufs["split_offsets"],
                              bufs["num_splits"], bufs["status"], cand, num_kv_heads=H_KV,
                              min_split_tiles=-(-cal.splits.min_split_tokens // 32),
                              split_pin=split_pin, **planner.device_plan_targets(cal))
    return seq_dev, rows, cand


@pytest.mark.parametrize("seed", range(8))
def test_a_split_pin_replaces_the_candidates(seed):
    """split_pin (a count written on the GPU, read after the wait: find_shared's time-model cut
    of a chunk decode) > 0: the plan is the partition's with that one count
    (planner.balanced_partition(longest_splits=)); 0: the candidates' plan, as without it."""
    rng = np.random.default_rng(seed)
    b = int(rng.integers(1, 9))
    seq = rng.integers(1, 40000, b).astype(np.int32)
    splits = load_routes().route("pkv_workqueue").splits
    cal = find_calibration(torch.cuda.get_device_name())
    tiles = -(-int(seq.max()) // 32)
    counts = planner.partition_candidates(tiles, splits, -(-cal.splits.min_split_tokens // 32)).tolist()
    plain = _buffers(MAX_ROWS, MAX_ROWS * H_KV * 64)
    _device_plan(seq, plain, splits, cal)
    for s in [0] + counts[:: max(1, len(counts) // 4)]:
        bufs = _buffers(MAX_ROWS, MAX_ROWS * H_KV * 64)
        _device_plan(seq, bufs, splits, cal, split_pin=torch.tensor([s], dtype=torch.int32, device=DEV))
        torch.cuda.synchronize()
        assert bufs["status"].item() == 0
        if s == 0:
            _assert_same_plan(bufs, plain)
            continue
        want = planner.balanced_partition(seq.astype(np.int64), num_kv_heads=H_KV, splits=splits,
                                          cal=cal, longest_splits=s)
        np.testing.assert_array_equal(bufs["num_splits"].cpu().numpy()[:b], want.num_splits, err_msg=str(s))


@pytest.mark.parametrize("free_slots", [None, 8, 40, "room32", "room264"],
                         ids=["file", "free8", "free40", "room32", "room264"])
@pytest.mark.parametrize("seed", range(24))
def test_device_plan_equals_host_plan(seed, free_slots):
    """The balanced partition on random batches: uniform lengths, short rows, one long row among
    short ones (the ragged steps where it matters), equal rows; with the calibration's
    splits.merge_free_slots and with others (the cut that fills its last wave set aside), and
    with room charges (splits.wave_room_slots / wave_room_tiles / wave_room_chunk_tiles: 32 / 48 /
    8, 264 / 12.5 / any chunk)."""
    rng = np.random.default_rng(seed)
    b = int(rng.integers(1, MAX_ROWS + 1))
    kind = seed % 4
    if kind == 0:
        seq = rng.integers(1, 70000, b)
    elif kind == 1:
        seq = rng.integers(1, 3000, b)
    elif kind == 2:
        seq = rng.permutation(np.r_[rng.integers(20000, 131073, 1), rng.integers(1, 4096, b - 1)])
    else:
        seq = np.full(b, int(rng.integers(1, 140000)))
    _assert_device_plan_equals_host(seq.astype(np.int32), free_slots)


@pytest.mark.parametrize("free_slots", [None, 0, 8], ids=["file", "free0", "free8"])
@pytest.mark.parametrize("length", [1, 700, 1600, 8192, 8193, 32768, 131072])
def test_device_plan_equals_host_plan_for_one_row(length, free_slots):
    """One row: the partition's candidates and costs agree on both sides."""
    _assert_device_plan_equals_host(np.array([length], dtype=np.int32), free_slots)


def _assert_device_plan_equals_host(seq, free_slots=None):
    b = len(seq)
    splits = load_routes().route("pkv_workqueue").splits
    cal = find_calibration(torch.cuda.get_device_name())
    if isinstance(free_slots, str):   # a room charge: "room<slots>"
        slots = int(free_slots[4:])
        cal = attrs.evolve(cal, splits=attrs.evolve(cal.splits, wave_room_slots=slots,
                                                    wave_room_tiles=48.0 if slots == 32 else 12.5,
                                                    wave_room_chunk_tiles=8 if slots == 32 else 1 << 20))
    elif free_slots is not None:
        cal = attrs.evolve(cal, splits=attrs.evolve(cal.splits, merge_free_slots=free_slots))
    host = planner.plan_workqueue(seq, num_kv_heads=H_KV, num_qo_heads=32, head_dim=128,
                                  dtype_bytes=2, splits=splits, cal=cal)
    bufs = _buffers(MAX_ROWS, MAX_ROWS * H_KV * 64)
    _device_plan(seq, bufs, splits, cal)
    torch.cuda.synchronize()
    assert bufs["status"].item() == 0
    np.testing.assert_array_equal(bufs["num_splits"].cpu().numpy()[:b], host.num_splits)
    np.testing.assert_array_equal(bufs["split_offsets"].cpu().numpy()[: b + 1], host.split_offsets)
    n = bufs["num_tasks"].item()
    # The same tasks in the same order (longest tasks first: the order the GPU starts them in).
    np.testing.assert_array_equal(bufs["tasks"].cpu().numpy()[:n], host.tasks)


def test_plan_decode_merge_in_one_graph_with_changing_lengths():
    lens = [40000, 3000, 17, 9000]
    batch = make_batch(lens, seed=11, device=DEV)
    splits = load_routes().route("pkv_workqueue").splits
    cal = find_calibration(torch.cuda.get_device_name())
    bufs = _buffers(MAX_ROWS, MAX_ROWS * H_KV * 64)
    slots = MAX_ROWS * 64
    part_a = torch.empty(slots, 32, 128, device=DEV)
    part_ml = torch.empty(slots, 32, 2, device=DEV)
    out = torch.empty_like(batch.q)
    seq_dev = torch.zeros(MAX_ROWS, dtype=torch.int32, device=DEV)
    rows = torch.tensor([len(lens)], dtype=torch.int32, device=DEV)
    cand = torch.tensor(splits.candidates(), dtype=torch.int32, device=DEV)
    bt = torch.zeros(MAX_ROWS, batch.block_tables.shape[1], dtype=torch.int32, device=DEV)
    bt[: len(lens)] = batch.block_tables

    def step():
        ops.plan_workqueue_device(seq_dev, rows, bufs["tasks"], bufs["num_tasks"], bufs["split_offsets"],
                                  bufs["num_splits"], bufs["status"], cand, num_kv_heads=H_KV,
                                  min_split_tiles=-(-cal.splits.min_split_tokens // 32),
                                  **planner.device_plan_targets(cal))
        ops.workqueue_decode(batch.q, batch.k_cache, batch.v_cache, seq_dev, bt, bufs["tasks"],
                             bufs["num_tasks"], bufs["split_offsets"], out, part_a, part_ml)
        ops.merge(part_a, part_ml, bufs["split_offsets"][: len(lens) + 1], out, skip_single=True)

    seq_dev[: len(lens)] = batch.seq_lens
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for shrink in (0, 5, 1000, 16999):  # lengths change between replays, no host planning
        new = [max(1, n - shrink) for n in lens]
        seq_dev[: len(lens)] = torch.tensor(new, dtype=torch.int32)
        batch.seq_lens.copy_(seq_dev[: len(lens)])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.seq_lens,
                                         batch.block_tables)
        assert rel_err(out, ref) < 2e-3


def test_device_plan_flags_lengths_outside_the_block_table():
    """Rows with a negative seq_len or one beyond max_seq_len get no split and set status bit 1;
    a row of length 0 (an engine's padding) gets no split and no flag; the others still get
    their splits."""
    seq = np.array([4000, -1, 700, 4097, 33, 0], dtype=np.int32)
    splits = load_routes().route("pkv_workqueue").splits
    cal = find_calibration(torch.cuda.get_device_name())
    bufs = _buffers(MAX_ROWS, MAX_ROWS * H_KV * 64)
    seq_dev = torch.zeros(MAX_ROWS, dtype=torch.int32, device=DEV)
    seq_dev[: len(seq)] = torch.as_tensor(seq)
    rows = torch.tensor([len(seq)], dtype=torch.int32, device=DEV)
    cand = torch.tensor(splits.candidates(), dtype=torch.int32, device=DEV)
    max_len = torch.tensor([4096], dtype=torch.int32, device=DEV)
    ops.plan_workqueue_device(seq_dev, rows, bufs["tasks"], bufs["num_tasks"], bufs["split_offsets"],
                              bufs["num_splits"], bufs["status"], cand, num_kv_heads=H_KV,
                              min_split_tiles=-(-cal.splits.min_split_tokens // 32),
                              **planner.device_plan_targets(cal),
                              max_seq_len=max_len)
    torch.cuda.synchronize()
    assert bufs["status"].item() == 2
    got = bufs["num_splits"].cpu().numpy()[: len(seq)]
    assert got[1] == 0 and got[3] == 0 and got[5] == 0 and (got[[0, 2, 4]] > 0).all()
    n = bufs["num_tasks"].item()
    assert not np.isin(bufs["tasks"].cpu().numpy()[:n, 0], [1, 3, 5]).any()


@pytest.mark.parametrize("seed", range(6))
def test_direct_mode_plans_what_the_copied_inputs_plan(seed):
    """Direct mode (rows, max_seq as integers; the kernel copies the step's lengths and the
    block-table entries they use from the caller's tensors): the same tasks, offsets and status
    as planning over inputs copied into the buffers first, the lengths and used entries copied
    (nothing past a row's last used page written), page ids still checked."""
    rng = np.random.default_rng(seed)
    b, page, width = int(rng.integers(1, MAX_ROWS + 1)), 16, 300
    seq = rng.integers(1, width * page + 1, b).astype(np.int32)
    if seed % 2:
        seq[0] = width * page + 7                              # a bad length
    num_pages = 5000
    src_bt = torch.as_tensor(rng.integers(0, num_pages, (b, width + 11)), dtype=torch.int32).to(DEV)
    if seed % 3 == 0 and b > 1:
        src_bt[b - 1, 0] = num_pages + 2                       # a bad page id
    splits = load_routes().route("pkv_workqueue").splits
    cal = find_calibration(torch.cuda.get_device_name())
    i32 = dict(dtype=torch.int32, device=DEV)
    cand = torch.tensor(splits.candidates(), **i32)
    n_pages = torch.tensor([num_pages], **i32)
    kw = dict(num_kv_heads=H_KV, min_split_tiles=-(-cal.splits.min_split_tokens // 32),
              num_pages=n_pages, page_size=page, **planner.device_plan_targets(cal))
    results = []
    for direct in (False, True):
        bufs = _buffers(MAX_ROWS, MAX_ROWS * H_KV * 64)
        seq_dev = torch.full((MAX_ROWS,), -3, **i32)
        bt = torch.full((MAX_ROWS, width), -9, **i32)
        rows = torch.tensor([b], **i32)
        max_len = torch.tensor([width * page], **i32)
        if direct:
            extra = dict(src_seq_lens=torch.as_tensor(seq).to(DEV), src_block_tables=src_bt, rows=b,
                         max_seq=width * page)
        else:
            seq_dev[:b] = torch.as_tensor(seq)
            bt[:b] = src_bt[:, :width]
            extra = {}
        ops.plan_workqueue_device(seq_dev, rows if not direct else torch.zeros(1, **i32), bufs["tasks"],
                                  bufs["num_tasks"], bufs["split_offsets"], bufs["num_splits"],
                                  bufs["status"], cand, max_seq_len=max_len if not direct else
                                  torch.zeros(1, **i32), block_tables=bt, **kw, **extra)
        torch.cuda.synchronize()
        results.append((bufs, seq_dev.cpu(), bt.cpu()))
    (copied, seq_c, _), (dbufs, seq_d, bt_d) = results
    _assert_same_plan(copied, dbufs)
    assert copied["status"].item() == (2 if seed % 2 else 0) | (4 if seed % 3 == 0 and b > 1 else 0)
    assert torch.equal(seq_d[:b], torch.as_tensor(seq)) and (seq_d[b:] == -3).all()
    for r in range(b):
        used = -(-int(seq[r]) // page) if seq[r] <= width * page else 0
        assert torch.equal(bt_d[r, :used], src_bt[r, :used].cpu()), r
        assert (bt_d[r, used:] == -9).all(), r


@pytest.mark.parametrize("seed", range(6))
def test_csr_direct_mode_plans_what_the_block_table_direct_mode_plans(seed):
    """CSR direct mode (FlashInfer's indptr / indices / last_page_len on the device, the drop-in
    wrapper's CUDA-graph plan): each row's length from its pages and last page, its pages from
    the indices at its offset; the same tasks, offsets, status, lengths and copied entries as
    block-table direct mode over the same step, with and without a window. Padding rows (no
    pages) are idle; a row with a last_page_len outside [1, page_size] or one ending past the
    indices is a bad length (bit 1, as -1 in the block-table run), with nothing read past the
    indices; a page id past the cache is bit 2 in both."""
    rng = np.random.default_rng(100 + seed)
    b, page = int(rng.integers(4, MAX_ROWS + 1)), (1, 16)[seed % 2]
    width, window = 300 // page * 16, (-1, 40, 700)[seed % 3]
    pages = rng.integers(1, width + 1, b)
    pages[rng.choice(b - 1, 2, replace=False)] = 0            # padding rows (vLLM's)
    pages[-1] = 0                                              # a trailing one too
    lpl = np.where(pages > 0, rng.integers(1, page + 1, b), int(rng.integers(0, 9))).astype(np.int32)
    num_pages = 5000
    ip = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    ind = rng.integers(0, num_pages, int(ip[-1]) + 13).astype(np.int32)
    seq = np.where(pages > 0, (pages - 1) * page + lpl, 0).astype(np.int32)
    bad, bad_id = [], seed % 3 == 1
    if seed >= 2:
        r = int(np.nonzero(pages > 0)[0][0])
        lpl[r] = page + 1 if seed % 2 else 0                  # a last page past the page size, or none
        bad.append(r)
    if seed >= 4:
        ind = ind[:int(ip[-1]) - 1]                           # the last rows end past the indices
        bad += [r for r in range(b) if ip[r + 1] > len(ind)]
    if bad_id:
        r = int(np.nonzero(pages > 0)[0][-1])
        if r not in bad:
            ind[int(ip[r + 1]) - 1] = num_pages + 3           # its last page: read by any window
    seq_bt = seq.copy()
    seq_bt[bad] = -1
    src_bt = torch.full((b, width + 3), -5, dtype=torch.int32)
    for r in range(b):
        got = ind[ip[r]:min(ip[r + 1], len(ind))]
        src_bt[r, :len(got)] = torch.as_tensor(got)
    splits = load_routes().route("pkv_workqueue").splits
    cal = find_calibration(torch.cuda.get_device_name())
    i32 = dict(dtype=torch.int32, device=DEV)
    cand = torch.tensor(splits.candidates(), **i32)
    kw = dict(num_kv_heads=H_KV, min_split_tiles=-(-cal.splits.min_split_tokens // 32),
              num_pages=torch.tensor([num_pages], **i32), page_size=page, rows=b,
              max_seq=width * page, window_left=window, **planner.device_plan_targets(cal))
    results = []
    for extra in (dict(src_seq_lens=torch.as_tensor(seq_bt).to(DEV), src_block_tables=src_bt.to(DEV)),
                  dict(src_indptr=torch.as_tensor(ip).to(DEV), src_last_page_len=torch.as_tensor(lpl).to(DEV),
                       src_block_tables=torch.as_tensor(ind).to(DEV))):
        bufs = _buffers(MAX_ROWS, MAX_ROWS * H_KV * 64)
        seq_dev = torch.full((MAX_ROWS,), -3, **i32)
        bt = torch.full((MAX_ROWS, width), -9, **i32)
        ops.plan_workqueue_device(seq_dev, torch.zeros(1, **i32), bufs["tasks"], bufs["num_tasks"],
                                  bufs["split_offsets"], bufs["num_splits"], bufs["status"], cand,
                                  max_seq_len=torch.zeros(1, **i32), block_tables=bt, **kw, **extra)
        torch.cuda.synchronize()
        results.append((bufs, seq_dev.cpu(), bt.cpu()))
    (want, seq_w, bt_w), (got, seq_g, bt_g) = results
    _assert_same_plan(want, got)
    assert got["status"].item() == (2 if bad else 0) | (4 if bad_id and bad_id_row_ok(bad, pages) else 0)
    assert torch.equal(seq_g, seq_w) and torch.equal(bt_g, bt_w)
    idle = [r for r in range(b) if pages[r] == 0 and ip[r] <= len(ind)]
    assert idle and (seq_g[idle] == 0).all() and (got["num_splits"][idle] == 0).all()


def bad_id_row_ok(bad, pages) -> bool:
    """Whether the row given a page id past the cache (the last row of pages) is not a bad length."""
    return int(np.nonzero(pages > 0)[0][-1]) not in bad
