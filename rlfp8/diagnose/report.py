"""The diagnose report: a console table, report.json and report.png (full KL and sampled-token k3 per pair)."""
from __future__ import annotations

import json
from pathlib import Path

COLUMNS = (("full_kl_mean", "full KL"), ("kl_k3", "k3"), ("abs_logp_diff_p50", "|dlp| p50"),
           ("abs_logp_diff_p90", "p90"), ("abs_logp_diff_p99", "p99"), ("abs_logp_diff_max", "max"),
           ("x_floor", "x floor"))


def table(pairs: list[dict]) -> str:
    """Pairs as fixed-width rows: engine, trainer, then COLUMNS."""
    head = f"{'engine':<22}{'trainer':<22}" + "".join(f"{label:>11}" for _, label in COLUMNS)
    lines = [head, "-" * len(head)]
    for p in pairs:
        cells = "".join(f"{p[key]:>11.3e}" if isinstance(p.get(key), float) else f"{'-':>11}" for key, _ in COLUMNS)
        lines.append(f"{p['engine']:<22}{p['trainer']:<22}{cells}")
    return "\n".join(lines)


def floor_text(floor: dict) -> str:
    if not floor:
        return "floor: not measured (needs engine bf16 and trainer bf16)"
    lines = [f"floor (engine bf16 / trainer bf16, full KL): {floor['bf16_bf16']:.3e}"]
    if "hf_batch_vs_single" in floor:
        lines.append(f"  HF/HF, padded batch vs one sequence at a time: {floor['hf_batch_vs_single']:.3e} "
                     f"(batch-dependent numerics: {floor['batch_share']:.0%} of the floor)")
    if "vllm_batch_vs_single" in floor:
        lines.append(f"  vLLM/vLLM, one batch vs one sequence at a time: {floor['vllm_batch_vs_single']:.3e}")
    if "kernels_share" in floor:
        lines.append(f"  the rest, vLLM-vs-HF kernels: ~{floor['kernels_share']:.0%} of the floor")
    return "\n".join(lines)


def acceptance_text(acc: dict) -> str:
    """The issue 17 / 13 ratios, one line each: matched full KL / the other pair's, bound, pass or fail."""
    lines = []
    for name, a in acc.items():
        if a["ratio"] is None:
            why = "not scored" if a["numerator_kl"] is None or a["denominator_kl"] is None else "denominator 0"
            lines.append(f"{name}: {a['numerator']} / {a['denominator']}: not measurable ({why})")
            continue
        lines.append(f"{name}: {a['numerator']} / {a['denominator']} = {a['numerator_kl']:.3e} / "
                     f"{a['denominator_kl']:.3e} = {a['ratio']:.3f}x (bound <= {a['bound']}x): "
                     f"{'PASS' if a['passed'] else 'FAIL'}")
    return "\n".join(lines)


def write(out: Path, report: dict) -> tuple[Path, Path]:
    js = out / "report.json"
    js.write_text(json.dumps(report, indent=2))
    png = out / "report.png"
    plot(report["pairs"], report["floor"], png, f"{report['model']} ({report['dtype']}), {report['samples']['scored_tokens']} tokens")
    return js, png


def plot(pairs: list[dict], floor: dict, path: Path, subtitle: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{p['engine']}\n{p['trainer']}" for p in pairs]
    x = range(len(pairs))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(pairs) + 2), 4.5))
    tiny = 1e-30                                     # log axis: an exact zero shows at the bottom
    ax.bar([i - 0.2 for i in x], [max(p["full_kl_mean"], tiny) for p in pairs], 0.4, label="full-vocabulary KL")
    ax.bar([i + 0.2 for i in x], [max(p["kl_k3"], tiny) for p in pairs], 0.4, label="sampled-token k3")
    if floor:
        ax.axhline(max(floor["bf16_bf16"], tiny), color="k", ls="--", lw=1, label="bf16/bf16 floor")
    ax.set_yscale("log")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("mean over scored tokens")
    ax.set_title(f"engine-trainer mismatch per pair: {subtitle}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
