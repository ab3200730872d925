"""Inline-PTX helpers of the W8A16 main loops (compiled GPU code only; the interpreter takes Triton's .to()).

Exact e4m3 -> bf16 widenings that avoid the F2F conversion pipe, selected per GEMM config (GemmConfig.widen):
gemm_configs.WIDENINGS: "bits" (_e4m3_to_bf16, two codes per call), "prmt" (byte-permute trick: _e4m3x4_to_bf16, four codes per call,
in the tokens-on-M orientation; _e4m3x2_to_bf16, two per call, in the swap_ab one) or "cvt" (Triton's
.to(tl.bfloat16)). All are exact, so they give the same bits. `_keep` is a zero-instruction use that makes
Triton retire the wgmmas producing a value. The PRMT widenings' PTX text is shared with lora_gemm_rs's and
bench/lab/explore_gluon_w8a16.py's Gluon copies.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e4m3_to_bf16(w):
    """Exact e4m3 -> bf16 widening without the F2F conversion pipe (compiled GPU code only: inline PTX).

    Triton's `w.to(tl.bfloat16)` goes e4m3x2 -> f16x2 (one F2FP per pair) and then converts each f16 to bf16
    with one F2F instruction, whose low sm_90 throughput bounds the W8A16 main loop at small M (the numbers:
    bench/README.md, "Why the W8A16 widenings").
    Here, per pair of codes (one 16-bit register, pack=2, exactly as the tile comes out of shared memory in
    wgmma's register-operand layout): e4m3x2 -> f16x2 (one F2FP, exact); bf16 bits = sign | (f16 magnitude
    >> 3), which is the same value times 2^-112 as a normal bf16 (every e4m3 value is a normal f16 or zero,
    its f16 mantissa has 3 nonzero bits, so nothing is shifted out); one bf16x2 FMA by 2^112 (+ -0.0)
    restores it exactly. Two LOP3, one SHF, one HMUL2 per pair: no F2F. Bit-identical to w.to(tl.bfloat16)
    for all 254 finite codes (tests/kernel/test_widen.py emulates it for every byte; the GPU tests compare
    both paths). The NaN codes 0x7f/0xff would come out as +-122880 instead of NaN; the quantizer never
    produces them (it clamps to +-448)."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b16 a, hi;
        .reg .b32 f, t, k, z;
        mov.b32 {a, hi}, $1;
        cvt.rn.f16x2.e4m3x2 f, a;
        and.b32 t, f, 0x7FFF7FFF;
        shr.b32 t, t, 3;
        and.b32 f, f, 0x80008000;
        or.b32 t, t, f;
        mov.b32 k, 0x77807780;
        mov.b32 z, 0x80008000;
        fma.rn.bf16x2 $0, t, k, z;
        }
        """,
        constraints="=r,r", args=[w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=2)


# The PRMT widenings' PTX (_e4m3x4_to_bf16: four codes per 32-bit register, two bf16x2 outputs;
# _e4m3x2_to_bf16: two codes): also the text of lora_gemm_rs's and bench/lab/explore_gluon_w8a16.py's Gluon copies.
E4M3X4_TO_BF16_PTX = tl.constexpr("""
        {
        .reg .b32 lo, hi, k;
        prmt.b32 lo, $2, 0, 0x9180;
        prmt.b32 hi, $2, 0, 0xB3A2;
        shl.b32 lo, lo, 4;
        shl.b32 hi, hi, 4;
        and.b32 lo, lo, 0x87F087F0;
        and.b32 hi, hi, 0x87F087F0;
        mov.b32 k, 0x7B807B80;
        mul.rn.bf16x2 $0, lo, k;
        mul.rn.bf16x2 $1, hi, k;
        }
""")
E4M3X2_TO_BF16_PTX = tl.constexpr("""
        {
        .reg .b32 t, k;
        prmt.b32 t, $1, 0, 0x9180;
        shl.b32 t, t, 4;
        and.b32 t, t, 0x87F087F0;
        mov.b32 k, 0x7B807B80;
        mul.rn.bf16x2 $0, t, k;
        }
""")


@triton.jit
def _e4m3x4_to_bf16(w):
    """Exact e4m3 -> bf16 widening, four codes per 32-bit register (compiled GPU code only: inline PTX).

    Meant for layouts where a thread holds 4+ consecutive codes (the non-swapped main loop loads the weight
    tile 16 bytes per thread), so no packing is needed around the asm. Per pair of codes, no conversion
    instruction at all: one PRMT places each code in the low byte of a 16-bit half and replicates its sign
    bit over the high byte; a shift by 4 and one mask leave sign | eeeemmm << 4, which read as bf16 is the
    code's value times 2^-120 (exponent bias 127 vs 7; e4m3 subnormals land on bf16 subnormals, exactly);
    one bf16x2 multiply by 2^120 restores it exactly (bf16 arithmetic keeps subnormals). Four instructions
    per pair (PRMT, SHL, LOP3, HMUL2) against five for _e4m3_to_bf16. Same bits as w.to(tl.bfloat16) for
    all 254 finite codes (tests/kernel/test_widen.py emulates it per byte; the GPU tests compare the paths);
    the NaN codes 0x7f/0xff come out as +-480."""
    return tl.inline_asm_elementwise(
        asm=E4M3X4_TO_BF16_PTX,
        constraints="=r,=r,r", args=[w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _keep(x):
    """A zero-instruction use of x (tied in/out registers, GPU code only): an instruction that reads x, so
    Triton must retire the wgmmas producing x before it."""
    return tl.inline_asm_elementwise("", "=r,0", [x], dtype=x.dtype, is_pure=False, pack=1)


@triton.jit
def _e4m3x2_to_bf16(w):
    """_e4m3x4_to_bf16's arithmetic on two codes per call (pack=2): for the swap_ab main loop, whose
    register-operand layout gives each thread pairs of codes (one 16-bit load each). One PRMT (only bytes
    0 and 1 are read), SHL, LOP3 and HMUL2 per pair, against five instructions for _e4m3_to_bf16."""
    return tl.inline_asm_elementwise(
        asm=E4M3X2_TO_BF16_PTX,
        constraints="=r,r", args=[w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=2)
