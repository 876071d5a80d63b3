"""The e4m3 (FP8 K/V) tensor-core tile of kernels/decode_common.cuh replayed on the CPU.

No GPU here runs the kernels, so the index math of the e4m3 path is checked by transcription:
the shared-memory swizzle (``e4m3_line_xor``, ``e4m3_swizzle``), the copy mapping of
``decode_range_tc``'s issue(), the per-thread offsets (``e4m3_frags``, ``e4m3_v1``), the Q
fragments (``q_frags_e4m3``), the K and V loads and byte pairing (``qk_e4m3``, ``pv_e4m3``), the
O^T store (``e4m3_o_elem``) and the sm_80/86 conversion (``e4m3x2_to_f16x2``), each written
below as the kernel writes it, run for all 32 lanes of a warp through an emulated
mma.m16n8k16 (the PTX ISA's fragment layout, the one the fp16 path relies on), and compared with
S = Q K^T and O = P V. Also: every shared-memory load of the path is free of bank conflicts
(each phase of 8 lanes for 16-byte accesses, 16 lanes for 8-byte ones, touches distinct banks).
Keep the functions here in sync with the kernel when either changes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

LANES = range(32)


# ----------------------------------------------------------------------------- the kernel's index math

def line_xor(d: int, line: int) -> int:                       # e4m3_line_xor<D>
    if d == 64:
        return (line & 3) << 1
    r = line >> 1 if d == 256 else line
    return (((r >> 1) & 3) << 1) ^ ((r & 1) << 2)


def swizzle(d: int, a: int) -> int:                           # e4m3_swizzle<D>
    return (a & ~0x70) | ((((a >> 4) & 7) ^ line_xor(d, a >> 7)) << 4)


def frags(d: int, grp: int, tig: int) -> dict:                 # e4m3_frags<D>
    eb = d // 8 if d < 128 else 16
    return dict(k=swizzle(d, grp * d + 16 * tig), v0=swizzle(d, 2 * tig * d + eb * grp))


def kload(f: dict, kb: int, nt: int, d: int) -> int:        # qk_e4m3's K load offset
    return (f["k"] ^ (64 * (kb & 1))) + 128 * (kb >> 1) + 8 * d * nt


def v1(d: int, f: dict) -> int:                                # e4m3_v1<D>
    return (f["v0"] ^ 64) + (d if d >= 128 else 0)


def o_elem(d: int, mt: int, r: int) -> int:                    # e4m3_o_elem<D>
    blk = min(d, 128)
    eb = blk // 8
    return blk * (mt // (eb // 2)) + eb * (r & 7) + 2 * (mt % (eb // 2)) + (r >> 3)


def byte_perm(x: int, y: int, sel: int) -> int:               # __byte_perm
    src = x | (y << 32)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def words(buf: np.ndarray, off: int, n: int) -> list[int]:    # an n-byte shared-memory load
    return [int.from_bytes(buf[off + 4 * i: off + 4 * i + 4].tobytes(), "little") for i in range(n // 4)]


E4M3 = {b: float(torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float()) for b in range(256)}


def pair(x: int) -> tuple[float, float]:
    """e4m3x2_to_f16x2 of the low 16 bits: (low byte, high byte) as values."""
    return E4M3[x & 0xFF], E4M3[(x >> 8) & 0xFF]


# ----------------------------------------------------------------------------- an emulated warp mma

def mma(c: list, a: list, b: list) -> None:
    """mma.sync.m16n8k16.row.col: c[lane] (4) += A (16x16) B (16x8) from per-lane registers
    a[lane] = 4 (lo, hi) pairs (a0..a3), b[lane] = 2 pairs (b0, b1)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in LANES:
        g, t = lane // 4, lane % 4
        for reg, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[row, col], A[row, col + 1] = a[lane][reg]
        for reg, k in enumerate([2 * t, 2 * t + 8]):
            B[k, g], B[k + 1, g] = b[lane][reg]
    C = A @ B
    for lane in LANES:
        g, t = lane // 4, lane % 4
        for reg, (row, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
            c[lane][reg] += C[row, col]


# ----------------------------------------------------------------------------- one tile, as the kernel runs it

def tile_bytes(d: int, rows: np.ndarray) -> np.ndarray:
    """A [16, D] uint8 tile copied into shared memory by issue(): lane + 32j -> (token t, chunk
    c), destination tile_chunk<e4m3, D>(t, c)."""
    chunks = d // 16
    smem = np.full(16 * d, 0xEE, dtype=np.uint8)
    for lane in LANES:
        for j in range(chunks * 16 // 32):
            idx = lane + 32 * j
            t, c = idx // chunks, idx % chunks
            dst = swizzle(d, t * d + c * 16)
            smem[dst:dst + 16] = rows[t, c * 16:(c + 1) * 16]
    return smem


def random_tile(d: int, seed: int):
    rng = np.random.default_rng(seed)
    k = rng.integers(0, 256, (16, d), dtype=np.uint8)
    v = rng.integers(0, 256, (16, d), dtype=np.uint8)
    k[(k & 0x7F) == 0x7F] = 0x38   # no NaN bytes (1.0)
    v[(v & 0x7F) == 0x7F] = 0x30
    return k, v


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("g", [1, 2, 4, 8])
def test_s_equals_q_k_transpose(d, g):
    kb, _ = random_tile(d, d + g)
    kval = np.vectorize(E4M3.get)(kb)                       # [16 tokens, D]
    q = np.random.default_rng(g).standard_normal((8, d))
    q[g:] = 0                                               # rows >= G are zero fragments
    smem = tile_bytes(d, kb)
    s = [[0.0] * 4 for _ in LANES], [[0.0] * 4 for _ in LANES]   # s[nt][lane][4]
    fr = {lane: frags(d, lane // 4, lane % 4) for lane in LANES}
    for kb in range(d // 64):
        # q_frags_e4m3: qa[4*kb + st] = q[grp][64*kb + 16*tig + 4*st + {0,1} / {2,3}]
        qa = {}
        for lane in LANES:
            grp, tig = lane // 4, lane % 4
            base = 64 * kb + 16 * tig
            qa[lane] = [((q[grp, base + 4 * st], q[grp, base + 4 * st + 1]),
                         (q[grp, base + 4 * st + 2], q[grp, base + 4 * st + 3])) for st in range(4)]
        w = {lane: [words(smem, kload(fr[lane], kb, nt, d), 16) for nt in range(2)] for lane in LANES}
        for st in range(4):
            for nt in range(2):
                a = [[qa[lane][st][0], (0.0, 0.0), qa[lane][st][1], (0.0, 0.0)] for lane in LANES]
                b = [[pair(w[lane][nt][st] & 0xFFFF), pair(w[lane][nt][st] >> 16)] for lane in LANES]
                mma(s[nt], a, b)
    want = q @ kval.T                                       # [8 heads, 16 tokens]
    for lane in LANES:
        grp, tig = lane // 4, lane % 4
        for nt in range(2):
            for e in range(2):   # s[nt][e] = S[head grp][token nt*8 + 2*tig + e]
                assert s[nt][lane][e] == pytest.approx(want[grp, nt * 8 + 2 * tig + e], abs=1e-9)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("g", [1, 2, 4, 8])
def test_o_equals_p_v_and_the_store_map(d, g):
    _, vb = random_tile(d, 7 * d + g)
    vval = np.vectorize(E4M3.get)(vb)
    p = np.random.default_rng(d).random((8, 16))            # P[head][token]
    smem = tile_bytes(d, vb)
    o = [[[0.0] * 4 for _ in LANES] for _ in range(d // 16)]   # o[mt][lane][4]
    fr = {lane: frags(d, lane // 4, lane % 4) for lane in LANES}
    blk = min(d, 128)
    eb = blk // 8
    wn = eb // 4
    # pb0 / pb1 = pack2(pr[0], pr[1]) / pack2(pr[2], pr[3]) = P[grp][2tig, 2tig+1] / [2tig+8, 2tig+9]
    pb = [[(p[lane // 4, 2 * (lane % 4)], p[lane // 4, 2 * (lane % 4) + 1]),
           (p[lane // 4, 2 * (lane % 4) + 8], p[lane // 4, 2 * (lane % 4) + 9])] for lane in LANES]
    for c in range(d // blk):
        w = {}
        for lane in LANES:
            f = fr[lane]
            w[lane] = [words(smem, (v1(d, f) if r & 1 else f["v0"]) + 8 * d * (r >> 1) + blk * c, eb)
                       for r in range(4)]
        for i in range(wn):
            mt = eb // 2 * c + 2 * i
            for which, sel in ((0, 0x5140), (1, 0x7362)):
                a = []
                for lane in LANES:
                    kk = byte_perm(w[lane][0][i], w[lane][1][i], sel)
                    hh = byte_perm(w[lane][2][i], w[lane][3][i], sel)
                    a.append([pair(kk & 0xFFFF), pair(kk >> 16), pair(hh & 0xFFFF), pair(hh >> 16)])
                mma(o[mt + which], a, pb)
    want = p @ vval                                          # [8 heads, D]
    got = np.full((8, d), np.nan)
    for lane in LANES:                                       # the sm_acc store of decode_range_tc
        grp, tig = lane // 4, lane % 4
        for cc in range(2):
            head = 2 * tig + cc
            if head < g:
                for mt in range(d // 16):
                    e = o_elem(d, mt, grp)
                    got[head, e], got[head, e + 1] = o[mt][lane][cc], o[mt][lane][cc + 2]
    np.testing.assert_allclose(got[:g], want[:g], rtol=1e-12, atol=1e-9)
    assert not np.isnan(got[:g]).any()
    # o_elem covers every element once
    assert sorted(o_elem(d, mt, r) for mt in range(d // 16) for r in range(16)) == list(range(d))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_offset_identities(d):
    eb = d // 8 if d < 128 else 16
    for lane in LANES:
        grp, tig = lane // 4, lane % 4
        f = frags(d, grp, tig)
        assert v1(d, f) == swizzle(d, (2 * tig + 1) * d + eb * grp)
        for kb in range(d // 64):
            for nt in range(2):
                assert kload(f, kb, nt, d) == swizzle(d, (grp + 8 * nt) * d + 64 * kb + 16 * tig)
        for r in range(4):   # rows 2tig + {0, 1, 8, 9}, every block: base + constants
            tok = 2 * tig + (r & 1) + 8 * (r >> 1)
            for c in range(d // min(d, 128)):
                want = swizzle(d, tok * d + min(d, 128) * c + eb * grp)
                assert (v1(d, f) if r & 1 else f["v0"]) + 8 * d * (r >> 1) + min(d, 128) * c == want


def phases(addrs: list[int], width: int) -> None:
    """Each phase (128 bytes of lanes) of one shared-memory load touches distinct banks."""
    per = 128 // width
    for ph in range(0, 32, per):
        banks = [((a % 128) // 4 + i) % 32 for a in addrs[ph:ph + per] for i in range(width // 4)]
        assert len(set(banks)) == len(banks), (width, addrs[ph:ph + per])


@pytest.mark.parametrize("d", [64, 128, 256])
def test_loads_and_copies_are_free_of_bank_conflicts(d):
    fr = [frags(d, lane // 4, lane % 4) for lane in LANES]
    for kb in range(d // 64):
        for nt in range(2):
            phases([kload(f, kb, nt, d) for f in fr], 16)
    blk = min(d, 128)
    for c in range(d // blk):
        for r in range(4):
            phases([(v1(d, f) if r & 1 else f["v0"]) + 8 * d * (r >> 1) + blk * c for f in fr], blk // 8)
    chunks = d // 16
    for j in range(chunks * 16 // 32):   # the copies' destinations
        phases([swizzle(d, ((lane + 32 * j) // chunks) * d + ((lane + 32 * j) % chunks) * 16)
                for lane in LANES], 16)


def test_sm80_conversion_is_exact_for_every_byte_pair():
    """e4m3x2_to_f16x2's sm_80/86 branch: bits moved into fp16's positions, times 256, NaN kept."""
    for lo in range(256):
        for hi in (lo, 255 - lo, 0x7F, 0x80):
            x = lo | (hi << 8)
            bits = ((x & 0x7F) << 7) | ((x & 0x80) << 8) | ((x & 0x7F00) << 15) | ((x & 0x8000) << 16)
            h = np.array([bits], dtype=np.uint32).view(np.float16) * np.float16(256)
            r = int(h.view(np.uint32)[0])
            if (x & 0x7F) == 0x7F:
                r = (r & 0xFFFF0000) | 0x7FFF
            if (x & 0x7F00) == 0x7F00:
                r = (r & 0xFFFF) | 0x7FFF0000
            got = np.array([r], dtype=np.uint32).view(np.float16).astype(np.float64)
            for g_, b in zip(got, (lo, hi)):
                want = E4M3[b]
                assert (np.isnan(g_) and np.isnan(want)) or (g_ == want and np.signbit(g_) == np.signbit(want)), (b, g_, want)
