"""Variants of the fused loss's two passes (log-sum-exp, then gradient sweep), kernel alone.

    python benchmarks/fused_loss_variants.py {fused|coop|coop_reg|bwd}   # CUDA GPU

The evidence behind ``ratiokl._kernels.fused_loss.launch_plan``: can the
gradient sweep re-read the row from L2 instead of HBM? bf16, N = 8192,
V = 151,936, a simplified epilogue (one coefficient per row). One JSON line
per configuration (ms, read+write GB/s, max error against a torch reference).

- ``fused``: one program per row (or a persistent grid), tile x warps, L2
  eviction hints (``evict_last`` on the first pass, ``evict_first`` on the
  second and on the stores), the sweep in reverse tile order;
- ``coop``: S programs per row meet at a device-side counter (a spinning
  wait: it needs the S programs co-resident, which a normal launch does not
  promise), combine their partial statistics, then each writes its own span;
- ``coop_reg``: the same, holding its span in registers across the wait;
- ``ticket``: ``coop`` with each program's (row, span) taken from a device
  counter at its start, so no launch order is assumed (the library's scheme);
- ``persist``: the same on a persistent grid (fewer spans in flight);
- ``bwd``: the standalone backward (one read, one write) by tile and hints.

H200, 2026-11-30: best ``fused`` 1.72 ms (16384 x 32 warps, hints, 1056
programs; 4096 x 4 one per row 1.79), ``coop`` 1.61 ms (S = 8, hints),
``ticket`` 1.566 ms (S = 13; 1.596 with S = 8), ``persist`` 1.78-3.8 ms,
``coop_reg`` 2.05 ms, ``bwd`` 1.23-1.31 ms against a 1.16-1.17 ms device copy.
None reaches PERF.md's 1.50 ms for the whole loss. The library's kernel
(``ratiokl._kernels.fused_loss``) uses the ``ticket`` scheme with 8 spans; it
holds more registers (96 against 56), and ran the whole torch step in 1.80 ms.
"""
import json
import sys

import torch
import triton
import triton.language as tl
import triton.testing

LOG2E = tl.constexpr(1.4426950408889634)
N, V = 8192, 151936
#: L2 hints by name: (pass-1 loads, pass-2 loads, gradient stores); "" is none.
HINTS = {"none": ("", "", ""), "ev": ("evict_last", "evict_first", ""),
         "ev+cs": ("evict_last", "evict_first", "evict_first"),
         "st": ("", "", "evict_first"), "cs": ("", "", "evict_first")}


def spans_of(tiles: int, tps: int):
    """``(S, S2)``: spans of ``tps`` tiles in a row of ``tiles``, and S's next power of two."""
    s = -(-tiles // tps)
    return s, 1 << (s - 1).bit_length()


@triton.jit
def _lse_step(x, m, s):
    m_new = tl.maximum(m, tl.max(x, axis=0))
    s = s * tl.exp2(m - m_new) + tl.sum(tl.exp2(x - m_new), axis=0)
    return m_new, s


@triton.jit
def exp_fused(p_ptr, c_ptr, ids_ptr, g_ptr, N, V: tl.constexpr, BLOCK: tl.constexpr,
              EV1: tl.constexpr, EV2: tl.constexpr, ST: tl.constexpr, REV: tl.constexpr):
    first = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    n_full: tl.constexpr = V // BLOCK
    for j in range(0, (N - first + step - 1) // step):
        row = first + j * step
        row64 = row.to(tl.int64)
        p_row = p_ptr + row64 * V
        g_row = g_ptr + row64 * V
        m = -float("inf")
        s = 0.0
        for b in range(0, n_full):
            x = tl.load(p_row + b * BLOCK + cols, eviction_policy=EV1).to(tl.float32) * LOG2E
            m, s = _lse_step(x, m, s)
        if V % BLOCK != 0:
            offs = n_full * BLOCK + cols
            x = tl.load(p_row + offs, mask=offs < V, other=-float("inf"), eviction_policy=EV1)
            m, s = _lse_step(x.to(tl.float32) * LOG2E, m, s)
        lse2 = m + tl.log2(s)
        c = tl.load(c_ptr + row)
        a = tl.load(ids_ptr + row)
        if V % BLOCK != 0:
            offs = n_full * BLOCK + cols
            x = tl.load(p_row + offs, mask=offs < V, other=0.0, eviction_policy=EV2)
            g = c * (tl.where(offs == a, 1.0, 0.0) - tl.exp2(x.to(tl.float32) * LOG2E - lse2))
            tl.store(g_row + offs, g.to(tl.bfloat16), mask=offs < V, eviction_policy=ST)
        for i in range(0, n_full):
            if REV:
                b = n_full - 1 - i
            else:
                b = i
            offs = b * BLOCK + cols
            xg = tl.load(p_row + offs, eviction_policy=EV2).to(tl.float32)
            g = c * (tl.where(offs == a, 1.0, 0.0) - tl.exp2(xg * LOG2E - lse2))
            tl.store(g_row + offs, g.to(tl.bfloat16), eviction_policy=ST)


@triton.jit
def _meet(part_ptr, cnt_ptr, row64, seg, m, s, S: tl.constexpr, S2: tl.constexpr,
          POLL: tl.constexpr):
    """Publish this span's ``(m, s)``, spin until the row's S programs have, return the lse2.

    ``S2``: S rounded up to a power of two. ``POLL``: 0 spins on atomic (acquire)
    reads, 1 on volatile loads then one atomic read. The wait needs the S
    programs of a row resident together.
    """
    tl.store(part_ptr + (row64 * S + seg) * 2, m)
    tl.store(part_ptr + (row64 * S + seg) * 2 + 1, s)
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr + row64, 1, sem="release")
    if POLL == 1:
        cnt = tl.load(cnt_ptr + row64, volatile=True)
        while cnt < S:
            cnt = tl.load(cnt_ptr + row64, volatile=True)
    cnt = tl.atomic_add(cnt_ptr + row64, 0, sem="acquire")
    while cnt < S:
        cnt = tl.atomic_add(cnt_ptr + row64, 0, sem="acquire")
    so = tl.arange(0, S2)
    ms = tl.load(part_ptr + (row64 * S + so) * 2, mask=so < S, other=-float("inf"),
                 cache_modifier=".cg")
    ss = tl.load(part_ptr + (row64 * S + so) * 2 + 1, mask=so < S, other=0.0,
                 cache_modifier=".cg")
    mm = tl.max(ms, axis=0)
    return mm + tl.log2(tl.sum(ss * tl.exp2(ms - mm), axis=0))


@triton.jit
def _span_lse(p_row, t0, t1, last, V: tl.constexpr, BLOCK: tl.constexpr, EV1: tl.constexpr):
    """Base-2 ``(max, sum)`` of whole tiles ``[t0, t1)``, plus the masked tail if ``last``."""
    cols = tl.arange(0, BLOCK)
    n_full: tl.constexpr = V // BLOCK
    m = -float("inf")
    s = 0.0
    for b in range(t0, t1):
        x = tl.load(p_row + b * BLOCK + cols, eviction_policy=EV1).to(tl.float32) * LOG2E
        m, s = _lse_step(x, m, s)
    if V % BLOCK != 0:
        offs = n_full * BLOCK + cols
        x = tl.load(p_row + offs, mask=(offs < V) & last, other=-float("inf"),
                    eviction_policy=EV1)
        m, s = _lse_step(x.to(tl.float32) * LOG2E, m, s)
    return m, s


@triton.jit
def _span_grad(p_row, g_row, t0, t1, last, c, a, lse2, V: tl.constexpr, BLOCK: tl.constexpr,
               EV2: tl.constexpr, ST: tl.constexpr):
    """``c * (onehot(a) - softmax)`` on tiles ``[t0, t1)`` (last to first), tail if ``last``."""
    cols = tl.arange(0, BLOCK)
    n_full: tl.constexpr = V // BLOCK
    if V % BLOCK != 0:
        offs = n_full * BLOCK + cols
        tm = (offs < V) & last
        x = tl.load(p_row + offs, mask=tm, other=0.0, eviction_policy=EV2)
        g = c * (tl.where(offs == a, 1.0, 0.0) - tl.exp2(x.to(tl.float32) * LOG2E - lse2))
        tl.store(g_row + offs, g.to(tl.bfloat16), mask=tm, eviction_policy=ST)
    for i in range(t0, t1):
        b = t1 - 1 - (i - t0)
        offs = b * BLOCK + cols
        xg = tl.load(p_row + offs, eviction_policy=EV2).to(tl.float32)
        g = c * (tl.where(offs == a, 1.0, 0.0) - tl.exp2(xg * LOG2E - lse2))
        tl.store(g_row + offs, g.to(tl.bfloat16), eviction_policy=ST)


@triton.jit
def _span_work(p_ptr, c_ptr, ids_ptr, g_ptr, part_ptr, cnt_ptr, row, seg, V: tl.constexpr,
               S: tl.constexpr, S2: tl.constexpr, TPS: tl.constexpr, BLOCK: tl.constexpr,
               POLL: tl.constexpr, EV1: tl.constexpr, EV2: tl.constexpr, ST: tl.constexpr):
    """Span ``seg`` of ``row``: its partial lse, the row's meeting, then its gradient."""
    row64 = row.to(tl.int64)
    p_row = p_ptr + row64 * V
    g_row = g_ptr + row64 * V
    t0 = seg * TPS
    t1 = tl.minimum(t0 + TPS, V // BLOCK)
    last = seg == S - 1
    m, s = _span_lse(p_row, t0, t1, last, V, BLOCK, EV1)
    lse2 = _meet(part_ptr, cnt_ptr, row64, seg, m, s, S, S2, POLL)
    c = tl.load(c_ptr + row)
    a = tl.load(ids_ptr + row)
    _span_grad(p_row, g_row, t0, t1, last, c, a, lse2, V, BLOCK, EV2, ST)


@triton.jit
def coop_fused(p_ptr, c_ptr, ids_ptr, g_ptr, part_ptr, cnt_ptr, N, V: tl.constexpr,
               S: tl.constexpr, TPS: tl.constexpr, BLOCK: tl.constexpr,
               EV1: tl.constexpr, EV2: tl.constexpr, ST: tl.constexpr):
    """S programs per row: partial lse per segment, a counter barrier, then own-segment grad."""
    pid = tl.program_id(0)
    row = pid // S
    seg = pid % S
    _span_work(p_ptr, c_ptr, ids_ptr, g_ptr, part_ptr, cnt_ptr, row, seg, V, S, S, TPS, BLOCK,
               0, EV1, EV2, ST)


@triton.jit
def exp_bwd(p_ptr, c_ptr, lse_ptr, ids_ptr, g_ptr, V: tl.constexpr, BLOCK: tl.constexpr,
            ST: tl.constexpr, EV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    lse2 = tl.load(lse_ptr + row) * LOG2E
    c = tl.load(c_ptr + row)
    a = tl.load(ids_ptr + row)
    n_full: tl.constexpr = V // BLOCK
    for b in range(0, n_full):
        offs = b * BLOCK + cols
        x = tl.load(p_ptr + row * V + offs, eviction_policy=EV).to(tl.float32)
        g = c * (tl.where(offs == a, 1.0, 0.0) - tl.exp2(x * LOG2E - lse2))
        tl.store(g_ptr + row * V + offs, g.to(tl.bfloat16), eviction_policy=ST)
    if V % BLOCK != 0:
        offs = n_full * BLOCK + cols
        x = tl.load(p_ptr + row * V + offs, mask=offs < V, other=0.0).to(tl.float32)
        g = c * (tl.where(offs == a, 1.0, 0.0) - tl.exp2(x * LOG2E - lse2))
        tl.store(g_ptr + row * V + offs, g.to(tl.bfloat16), mask=offs < V, eviction_policy=ST)


def rec(**kw):
    print(json.dumps(kw), flush=True)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150)


def trial(run, g, err, floor2, **fields):
    """One configuration: a checked first run (max error against the reference gradient),
    then its timing, as one record; one that fails to compile or launch records the error.
    ``run`` may return the launched kernel (its register count is recorded)."""
    try:
        g.zero_()
        kernel = run()
        torch.cuda.synchronize()
        e = err()
        ms = bench(run)
        rec(**fields, ms=ms, gbps_rw=floor2 / ms / 1e6, err=e,
            regs=getattr(kernel, "n_regs", None))
    except Exception as ex:  # noqa: BLE001 - some configurations do not compile
        rec(**fields, error=repr(ex)[:300])


def main(section):
    torch.manual_seed(0)
    p = torch.randn(N, V, device="cuda").to(torch.bfloat16)
    c = torch.randn(N, device="cuda")
    ids = torch.randint(0, V, (N,), device="cuda")
    g = torch.empty_like(p)
    # reference gradient
    ref = torch.empty_like(p)
    lse = torch.empty(N, device="cuda")
    for i in range(0, N, 512):
        x = p[i:i + 512].float()
        lse[i:i + 512] = torch.logsumexp(x, -1)
        r = -torch.softmax(x, -1)
        r[torch.arange(x.shape[0]), ids[i:i + 512]] += 1
        ref[i:i + 512] = (c[i:i + 512, None] * r).to(torch.bfloat16)
    floor2 = 2 * N * V * 2  # read + write bytes

    def err():
        return float((g.float() - ref.float()).abs().max())

    if section == "fused":
        configs = []
        for block, warps in ((4096, 4), (8192, 8), (8192, 16), (16384, 16), (16384, 32)):
            for hints in ("none", "ev", "ev+cs", "st"):
                for progs in (N, 2112, 1056, 528, 396, 264, 132):
                    if warps >= 16 and progs > 1056:
                        continue
                    configs.append((block, warps, hints, progs))
        for block, warps, hints, progs in configs:
            ev1, ev2, st = HINTS[hints]
            def run():
                exp_fused[(progs,)](p, c, ids, g, N, V=V, BLOCK=block, EV1=ev1, EV2=ev2, ST=st,
                                    REV=True, num_warps=warps)
            trial(run, g, err, floor2, sec="fused", block=block, warps=warps, hints=hints,
                  progs=progs)
    elif section == "coop":
        part = torch.empty(N * 16 * 2, device="cuda")
        for S, block, warps in ((2, 4096, 4), (4, 4096, 4), (8, 4096, 4), (4, 8192, 8),
                                (8, 2048, 4), (16, 2048, 4), (8, 4096, 8)):
            n_full = V // block
            tps = -(-n_full // S)
            for hints in ("none", "ev+cs"):
                ev1, ev2, st = HINTS[hints]
                cnt = torch.zeros(N, dtype=torch.int32, device="cuda")

                def run():
                    cnt.zero_()
                    coop_fused[(N * S,)](p, c, ids, g, part, cnt, N, V=V, S=S, TPS=tps,
                                         BLOCK=block, EV1=ev1, EV2=ev2, ST=st, num_warps=warps)
                trial(run, g, err, floor2, sec="coop", S=S, block=block, warps=warps,
                      hints=hints)
    elif section == "ticket":
        ticket_section(p, c, ids, g, err, floor2)
    elif section == "persist":
        persist_section(p, c, ids, g, err, floor2)
    elif section == "coop_reg":
        coop_reg_section(p, c, ids, g, err, floor2)
    elif section == "bwd":
        for block, warps in ((8192, 16), (4096, 8), (8192, 8), (16384, 16), (4096, 4),
                             (16384, 32), (2048, 4)):
            for st, ev in (("", ""), ("evict_first", ""), ("evict_first", "evict_first")):
                def run():
                    exp_bwd[(N,)](p, c, lse, ids, g, V=V, BLOCK=block, ST=st, EV=ev,
                                  num_warps=warps)
                run(); e = err()
                ms = bench(run)
                rec(sec="bwd", block=block, warps=warps, st=st, ev=ev, ms=ms,
                    gbps=floor2 / ms / 1e6, err=e)
        def copy():
            g.copy_(p)
        rec(sec="bwd", what="copy", ms=bench(copy), gbps=floor2 / bench(copy) / 1e6)



@triton.jit
def coop_reg(p_ptr, c_ptr, ids_ptr, g_ptr, part_ptr, cnt_ptr, N, V: tl.constexpr,
             S: tl.constexpr, S2: tl.constexpr, BLOCK: tl.constexpr, ST: tl.constexpr):
    """S programs per row, each holding one BLOCK of the row in registers across a barrier."""
    pid = tl.program_id(0)
    row = pid // S
    seg = pid % S
    row64 = row.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    offs = seg * BLOCK + cols
    inside = offs < V
    x = tl.load(p_ptr + row64 * V + offs, mask=inside, other=-float("inf")).to(tl.float32) * LOG2E
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp2(x - m), axis=0)
    lse2 = _meet(part_ptr, cnt_ptr, row64, seg, m, s, S, S2, 0)
    c = tl.load(c_ptr + row)
    a = tl.load(ids_ptr + row)
    g = c * (tl.where(offs == a, 1.0, 0.0) - tl.exp2(x - lse2))
    tl.store(g_ptr + row64 * V + offs, g.to(tl.bfloat16), mask=inside, eviction_policy=ST)


def coop_reg_section(p, c, ids, g, err, floor2):
    part = torch.empty(N * 64 * 2, device="cuda")
    for block, warps in ((8192, 8), (8192, 4), (16384, 16), (16384, 8), (4096, 4), (4096, 2),
                         (8192, 16), (2048, 2)):
        S, S2 = spans_of(-(-V // block), 1)
        for st in ("", "evict_first"):
            cnt = torch.zeros(N, dtype=torch.int32, device="cuda")

            def run():
                cnt.zero_()
                coop_reg[(N * S,)](p, c, ids, g, part, cnt, N, V=V, S=S, S2=S2, BLOCK=block,
                                   ST=st, num_warps=warps)
            trial(run, g, err, floor2, sec="coop_reg", S=S, block=block, warps=warps, st=st)


@triton.jit
def persist_fused(p_ptr, c_ptr, ids_ptr, g_ptr, part_ptr, cnt_ptr, ticket_ptr, N,
                  V: tl.constexpr, S: tl.constexpr, S2: tl.constexpr, TPS: tl.constexpr,
                  BLOCK: tl.constexpr, TICKET: tl.constexpr, POLL: tl.constexpr,
                  EV1: tl.constexpr, EV2: tl.constexpr, ST: tl.constexpr):
    """``coop_fused`` on a persistent grid: work items (row, span) taken in order.

    ``TICKET``: items come from a device counter (a program only ever waits for
    items already taken or still to be taken, so it cannot deadlock while S
    programs can be resident); else program p takes items p, p + P, ... (needs
    the whole grid resident).
    """
    n_items = N * S
    if TICKET:
        w = tl.atomic_add(ticket_ptr, 1)
    else:
        w = tl.program_id(0)
    while w < n_items:
        row = w // S
        seg = w % S
        _span_work(p_ptr, c_ptr, ids_ptr, g_ptr, part_ptr, cnt_ptr, row, seg, V, S, S2, TPS,
                   BLOCK, POLL, EV1, EV2, ST)
        if TICKET:
            w = tl.atomic_add(ticket_ptr, 1)
        else:
            w += tl.num_programs(0)


def persist_section(p, c, ids, g, err, floor2):
    part = torch.empty(N * 32 * 2, device="cuda")
    cnt = torch.zeros(N + 1, dtype=torch.int32, device="cuda")
    configs = []
    for tps in (10, 5, 3):  # 4096-tiles: S = 4, 8, 13
        for progs in (264, 528, 1056):
            configs.append((4096, 4, tps, progs, 1, 1, "ev+cs"))
    configs += [(4096, 4, 5, 528, 1, 0, "ev+cs"), (4096, 4, 5, 528, 1, 1, "none"),
                (4096, 4, 5, 396, 1, 1, "ev+cs"), (4096, 4, 5, 792, 1, 1, "ev+cs"),
                (2048, 4, 5, 528, 1, 1, "ev+cs"), (2048, 4, 5, 1056, 1, 1, "ev+cs"),
                (2048, 4, 10, 1056, 1, 1, "ev+cs"), (8192, 8, 4, 264, 1, 1, "ev+cs"),
                (8192, 8, 4, 528, 1, 1, "ev+cs"), (8192, 8, 2, 528, 1, 1, "ev+cs")]
    # Last: a static grid hangs unless it is resident as a whole.
    configs += [(4096, 4, tps, progs, 0, 1, "ev+cs") for tps in (10, 5) for progs in (264, 528)]
    for block, warps, tps, progs, ticket, poll, hint in configs:
        S, S2 = spans_of(V // block, tps)
        ev1, ev2, st = HINTS[hint]

        def run():
            cnt.zero_()
            return persist_fused[(progs,)](p, c, ids, g, part, cnt, cnt[N:], N, V=V, S=S,
                                           S2=S2, TPS=tps, BLOCK=block, TICKET=ticket,
                                           POLL=poll, EV1=ev1, EV2=ev2, ST=st, num_warps=warps)
        trial(run, g, err, floor2, sec="persist", block=block, warps=warps, S=S, progs=progs,
              ticket=ticket, poll=poll, hints=hint)


@triton.jit
def ticket_fused(p_ptr, c_ptr, ids_ptr, g_ptr, part_ptr, cnt_ptr, ticket_ptr, N,
                 V: tl.constexpr, S: tl.constexpr, S2: tl.constexpr, TPS: tl.constexpr,
                 BLOCK: tl.constexpr, EV1: tl.constexpr, EV2: tl.constexpr, ST: tl.constexpr):
    """``coop_fused`` (one item per program, grid N * S) with the item taken from a device
    counter at the start: a program only waits for items already taken or still to be
    taken, so no launch order is assumed (it needs S programs resident, nothing more)."""
    w = tl.atomic_add(ticket_ptr, 1)
    row = w // S
    seg = w % S
    _span_work(p_ptr, c_ptr, ids_ptr, g_ptr, part_ptr, cnt_ptr, row, seg, V, S, S2, TPS, BLOCK,
               0, EV1, EV2, ST)


def ticket_section(p, c, ids, g, err, floor2):
    part = torch.empty(N * 32 * 2, device="cuda")
    cnt = torch.zeros(N + 1, dtype=torch.int32, device="cuda")
    configs = [(4096, 4, 5, "ev+cs"), (4096, 4, 5, "none"), (4096, 4, 5, "cs"),
               (4096, 4, 10, "ev+cs"), (4096, 4, 3, "ev+cs"), (4096, 4, 2, "ev+cs"),
               (4096, 8, 5, "ev+cs"), (2048, 4, 5, "ev+cs"), (2048, 4, 10, "ev+cs"),
               (2048, 2, 5, "ev+cs"), (8192, 8, 2, "ev+cs"), (8192, 8, 3, "ev+cs"),
               (4096, 4, 1, "ev+cs")]
    for block, warps, tps, hint in configs:
        S, S2 = spans_of(V // block, tps)
        ev1, ev2, st = HINTS[hint]

        def run():
            cnt.zero_()
            return ticket_fused[(N * S,)](p, c, ids, g, part, cnt, cnt[N:], N, V=V, S=S, S2=S2,
                                          TPS=tps, BLOCK=block, EV1=ev1, EV2=ev2, ST=st,
                                          num_warps=warps)
        trial(run, g, err, floor2, sec="ticket", block=block, warps=warps, S=S, hints=hint)


if __name__ == "__main__":
    main(sys.argv[1])
