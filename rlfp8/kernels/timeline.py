"""Benchmark-only kernel timeline: `%globaltimer` stamps written by K1 and K2 into a small int64 buffer
(bench/pdl_timeline.py). Off in every production path: with ADDR == 0 (the default) `stamp` emits no code,
so the kernels' SASS is unchanged. A benchmark process enables it by setting ADDR to the buffer's device
address before any kernel compiles (Triton keys its cache on the value of this global)."""
from __future__ import annotations

import triton
import triton.language as tl

ADDR = tl.constexpr(0)          # device address of the int64 stamp buffer; 0 = stamps off
# slots of the buffer (min = earliest over the stamping programs, max = latest)
SLOT_NAMES = ("k1_start", "k1_end", "k2_start", "k2_wait_enter", "k2_wait_exit", "k2_mainloop_end", "k2_end")
(K1_START, K1_END, K2_START, K2_WAIT_ENTER, K2_WAIT_EXIT, K2_MAINLOOP_END,
 K2_END) = (tl.constexpr(i) for i in range(len(SLOT_NAMES)))
SLOTS = 8
MAX_SLOTS = ("k1_end", "k2_mainloop_end", "k2_end")   # slots reduced by max; the others by min


def enable(addr: int) -> None:
    """Turn the stamps on for this process: call before any kernel compiles (also as the initializer of
    precompile's worker processes, so that their binaries match)."""
    global ADDR
    ADDR = tl.constexpr(int(addr))


@triton.jit
def stamp(mask, SLOT: tl.constexpr, AT_MAX: tl.constexpr):
    """Record %globaltimer (ns) into slot SLOT where `mask` (a scalar) holds: atomic max if AT_MAX else min."""
    if ADDR != 0:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                      pack=1)
        ptr = tl.full((), ADDR, tl.int64).to(tl.pointer_type(tl.int64)) + SLOT
        if AT_MAX:
            tl.atomic_max(ptr, t, mask=mask, sem="relaxed", scope="gpu")
        else:
            tl.atomic_min(ptr, t, mask=mask, sem="relaxed", scope="gpu")
