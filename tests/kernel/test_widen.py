"""The W8A16 e4m3 -> bf16 widening without F2F (widen._e4m3_to_bf16): the interpreter cannot run inline
PTX, so its arithmetic is emulated here for every byte, step by step as the asm does it; the sm_90a compile
test checks that the GPU kernels contain it and no F2F in their MMA loops, the GPU tests compare it with
Triton's own cast on the H200."""
import inspect
import re

import torch

from rlfp8.kernels import widen


def _emulate(codes_u8: torch.Tensor) -> torch.Tensor:
    """The asm's steps on a uint8 tensor of e4m3 codes -> bf16 values (as float64)."""
    f16 = codes_u8.view(torch.float8_e4m3fn).to(torch.float16)       # cvt.rn.f16x2.e4m3x2 (exact)
    f = f16.view(torch.int16).to(torch.int32) & 0xFFFF
    t = ((f & 0x7FFF) >> 3) | (f & 0x8000)                           # and, shr, and, or (per 16-bit half)
    bf = t.to(torch.int16).view(torch.bfloat16)
    assert torch.all(((t >> 7) & 0xFF)[(t & 0x7FFF) != 0] > 0), "an intermediate bf16 is subnormal"
    return bf.double() * 2.0 ** 112                                  # fma.rn.bf16x2 by 2^112 (+ -0.0)


def test_bit_trick_is_exact_for_every_finite_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    fp8 = codes.view(torch.float8_e4m3fn)
    finite = torch.isfinite(fp8.float())
    assert int(finite.sum()) == 254                                  # 0x7f, 0xff are NaN
    got = _emulate(codes)
    # exact: the scaled value is representable in bf16, and its bits equal torch's (RNE) cast, signed zeros too
    assert torch.equal(got.to(torch.bfloat16).double()[finite], got[finite])
    want = fp8.to(torch.bfloat16)
    assert torch.equal(got.to(torch.bfloat16).view(torch.int16)[finite], want.view(torch.int16)[finite])
    # the NaN codes come out finite (documented; the quantizer never produces them)
    assert torch.all(got[~finite].abs() == 122880.0)


def test_asm_text_matches_the_emulated_steps():
    fn = widen._e4m3_to_bf16
    src = inspect.getsource(getattr(fn, "fn", fn))             # JITFunction or the interpreter's wrapper
    steps = ["cvt.rn.f16x2.e4m3x2", "and.b32 t, f, 0x7FFF7FFF", "shr.b32 t, t, 3", "and.b32 f, f, 0x80008000",
             "or.b32 t, t, f", "mov.b32 k, 0x77807780", "mov.b32 z, 0x80008000", "fma.rn.bf16x2"]
    pos = [src.find(s) for s in steps]
    assert all(p >= 0 for p in pos) and pos == sorted(pos), dict(zip(steps, pos))
    # 0x7780 is bf16 2^112, 0x8000 bf16 -0.0
    assert torch.tensor([0x7780], dtype=torch.int16).view(torch.bfloat16).item() == 2.0 ** 112
    assert re.search(r"pack=2", src)


def _prmt(a: int, sel: int) -> int:
    """PTX prmt.b32 d, a, 0, sel (default mode): byte i of d = byte (sel nibble i & 7) of {0, a}, or that byte's
    sign bit replicated when the nibble's bit 3 is set."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [0, 0, 0, 0]
    d = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        b = src[nib & 7]
        if nib & 8:
            b = 0xFF if b & 0x80 else 0x00
        d |= b << (8 * i)
    return d


def _emulate_x4(word: int) -> list[float]:
    """_e4m3x4_to_bf16's steps on one 32-bit register holding four codes -> their four bf16 values."""
    out = []
    for sel in (0x9180, 0xB3A2):
        t = (_prmt(word, sel) << 4) & 0xFFFFFFFF & 0x87F087F0        # prmt, shl, and
        for half in (t & 0xFFFF, t >> 16):
            v = torch.tensor([half], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
            prod = v.double() * 2.0 ** 120                            # mul.rn.bf16x2 by 2^120 (0x7B80)
            out.append(float(prod.to(torch.bfloat16).double()))      # ... rounded to bf16 (exact here)
            assert float(prod) == out[-1], "the product is not exact in bf16"
    return out


def test_prmt_trick_is_exact_for_every_finite_code():
    codes = torch.arange(256, dtype=torch.int32)
    fp8 = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    want = fp8.to(torch.bfloat16)
    finite = torch.isfinite(fp8.float())
    got = []
    for i in range(0, 256, 4):                                       # four codes per register, element 0 lowest
        word = sum(int(codes[i + j]) << (8 * j) for j in range(4))
        got += _emulate_x4(word)
    got = torch.tensor(got, dtype=torch.float64)
    assert torch.equal(got[finite].to(torch.bfloat16).view(torch.int16), want[finite].view(torch.int16))
    assert torch.all(got[~finite].abs() == 480.0)                    # NaN codes: documented, never produced
    # the sign of zero survives (0x80 is -0.0)
    assert torch.signbit(got[0x80]) and not torch.signbit(got[0x00])
    # subnormal e4m3 codes (exponent field 0) pass through bf16 subnormals and come back exact
    assert got[0x01] == 2.0 ** -9 and got[0x07] == 7 * 2.0 ** -9


def test_prmt_asm_text_matches_the_emulated_steps():
    fn = widen._e4m3x4_to_bf16
    src = inspect.getsource(getattr(fn, "fn", fn)) + widen.E4M3X4_TO_BF16_PTX.value   # the asm text it passes
    steps = ["prmt.b32 lo, $2, 0, 0x9180", "prmt.b32 hi, $2, 0, 0xB3A2", "shl.b32 lo, lo, 4", "shl.b32 hi, hi, 4",
             "and.b32 lo, lo, 0x87F087F0", "and.b32 hi, hi, 0x87F087F0", "mov.b32 k, 0x7B807B80",
             "mul.rn.bf16x2 $0, lo, k", "mul.rn.bf16x2 $1, hi, k"]
    pos = [src.find(s) for s in steps]
    assert all(p >= 0 for p in pos) and pos == sorted(pos), dict(zip(steps, pos))
    assert torch.tensor([0x7B80], dtype=torch.int16).view(torch.bfloat16).item() == 2.0 ** 120
    assert re.search(r"pack=4", src)


def test_prmt_pair_variant_is_the_same_arithmetic():
    """_e4m3x2_to_bf16 (two codes per call, swap_ab loop) runs the low-pair steps of _e4m3x4_to_bf16; its
    input register holds the two codes in bytes 0 and 1 (bytes 2 and 3 are never read by selector 0x9180)."""
    fn = widen._e4m3x2_to_bf16
    src = inspect.getsource(getattr(fn, "fn", fn)) + widen.E4M3X2_TO_BF16_PTX.value
    steps = ["prmt.b32 t, $1, 0, 0x9180", "shl.b32 t, t, 4", "and.b32 t, t, 0x87F087F0", "mov.b32 k, 0x7B807B80",
             "mul.rn.bf16x2 $0, t, k"]
    pos = [src.find(s) for s in steps]
    assert all(p >= 0 for p in pos) and pos == sorted(pos), dict(zip(steps, pos))
    assert re.search(r"pack=2", src)
    assert all(((0x9180 >> (4 * i)) & 7) in (0, 1) for i in range(4))   # reads bytes 0 and 1 only
    for b0 in range(256):                                              # == the x4 variant's low pair
        for b1 in (0x00, 0x01, 0x38, 0x80, 0xC5, 0xFE):
            word = b0 | (b1 << 8) | (0xAB << 16) | (0xCD << 24)
            assert _emulate_x4(word)[:2] == _emulate_x4(b0 | (b1 << 8))[:2]
