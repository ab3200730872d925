"""rlfp8-diagnose's acceptance lines (issue 17 / 13): the matched pair's full KL over the bf16/bf16 floor
(<= 1.4x) and over the W8A8 pair's (<= 0.2x), with pass/fail, and 'not measurable' where a pair is missing."""
import pytest

from rlfp8.diagnose.decompose import acceptance
from rlfp8.diagnose.report import acceptance_text


def _pairs(**kl):
    names = {"floor": ("engine_bf16", "trainer_bf16"), "matched": ("engine_w8a16", "trainer_fp8"),
             "w8a8": ("engine_w8a8", "trainer_fp8"), "other": ("engine_bf16", "trainer_fp8")}
    return [{"engine": names[k][0], "trainer": names[k][1], "full_kl_mean": v} for k, v in kl.items()]


def test_ratios_and_verdicts():
    acc = acceptance(_pairs(floor=1e-3, matched=1.2e-3, w8a8=1e-2, other=5.0))
    assert acc["matched_over_floor"]["ratio"] == pytest.approx(1.2) and acc["matched_over_floor"]["passed"] is True
    assert acc["matched_over_w8a8"]["ratio"] == pytest.approx(0.12) and acc["matched_over_w8a8"]["passed"] is True
    acc = acceptance(_pairs(floor=1e-3, matched=1.5e-3, w8a8=5e-3))
    assert acc["matched_over_floor"]["passed"] is False and acc["matched_over_w8a8"]["passed"] is False
    text = acceptance_text(acc)
    assert "matched_over_floor: engine_w8a16/trainer_fp8 / engine_bf16/trainer_bf16" in text
    assert "= 1.500x (bound <= 1.4x): FAIL" in text and "= 0.300x (bound <= 0.2x): FAIL" in text


def test_missing_pair_or_zero_floor_is_not_measurable():
    acc = acceptance(_pairs(floor=0.0, matched=1e-3))
    assert acc["matched_over_floor"]["ratio"] is None and acc["matched_over_w8a8"]["passed"] is None
    text = acceptance_text(acc)
    assert "matched_over_floor: engine_w8a16/trainer_fp8 / engine_bf16/trainer_bf16: not measurable (denominator 0)" in text
    assert "matched_over_w8a8: engine_w8a16/trainer_fp8 / engine_w8a8/trainer_fp8: not measurable (not scored)" in text
