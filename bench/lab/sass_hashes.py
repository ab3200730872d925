"""Hash the sm_90a SASS and PTX of every Triton kernel variant the sm_90a compile test builds, to prove that a
refactor moved kernel code without changing it (no GPU needed).

The launches are those of tests/kernel/sm90_compile_worker.collect() (Qwen3-8B projection shapes at one M per
token bucket, the committed H200 tuned table, TMA / orientation / widening / PDL variants, the Gluon main
loop). Each is compiled through the JIT's own argument specialization into a fresh Triton cache, so nothing
is read back from an earlier compile. SASS = `cuobjdump -sass` of the cubin; PTX without its debug-location
lines (.loc/.file/debug sections name the source file and line, which a move changes on purpose).

    python bench/lab/sass_hashes.py --out /tmp/after.json          # in each tree (run from its root)
    python bench/lab/sass_hashes.py --compare /tmp/before.json /tmp/after.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor


def _variant_key(spec: dict, fn) -> str:
    """Kernel name + constexprs by argument name + the non-constexpr signature + compile options."""
    named = {fn.arg_names[i[0]]: str(v) for i, v in spec["constexprs"].items()}
    sig = {fn.arg_names[i[0]] if isinstance(i, tuple) else str(i): str(v) for i, v in spec["signature"].items()}
    opts = {k: str(v) for k, v in sorted(spec["options"].items())}
    return json.dumps(dict(name=spec["name"], constexprs=named, signature=sig, attrs=str(spec["attrs"]),
                           options=opts), sort_keys=True)


def _ptx_without_debug_info(ptx: str) -> str:
    ptx = re.sub(r"\.section\s+\.debug_\w+\s*\{.*?\}", "", ptx, flags=re.S)
    return "\n".join(ln for ln in ptx.splitlines() if not re.match(r"\s*\.(loc|file)\b", ln))


def _hash_one(item):
    key, spec = item
    from rlfp8.kernels import _triton_utils as tu
    from tests.kernel.sm90_compile_worker import _cuda_tool
    k = tu.compile_spec(spec)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([_cuda_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    sass = "\n".join(ln for ln in sass.splitlines() if "Fatbin" not in ln and ".cubin" not in ln)
    return key, dict(sass=hashlib.sha256(sass.encode()).hexdigest()[:16],
                     ptx=hashlib.sha256(_ptx_without_debug_info(k.asm["ptx"]).encode()).hexdigest()[:16],
                     sass_lines=sass.count("\n"))


def dump(out: str, jobs: int) -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
    os.environ.setdefault("RLFP8_TUNED_GPU", "NVIDIA H200")       # as tests/kernel/test_compile_sm90.py
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="sass_hashes_cache_")
    sys.path.insert(0, os.getcwd())
    from rlfp8.kernels import _triton_utils as tu
    from tests.kernel.sm90_compile_worker import collect
    items = {}
    for kern, _grid, args, kw in collect():
        spec = tu.jit_spec(kern, args, kw)
        items.setdefault(_variant_key(spec, kern), spec)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        result = dict(pool.map(_hash_one, items.items()))
    with open(out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"{len(result)} kernel variants -> {out}")


def compare(before: str, after: str) -> int:
    a, b = json.load(open(before)), json.load(open(after))
    by_name: dict[str, list[int]] = {}
    for key in sorted(set(a) | set(b)):
        name = json.loads(key)["name"]
        row = by_name.setdefault(name, [0, 0, 0, 0])       # variants, same SASS, same PTX, only on one side
        row[0] += 1
        if key not in a or key not in b:
            row[3] += 1
            continue
        row[1] += a[key]["sass"] == b[key]["sass"]
        row[2] += a[key]["ptx"] == b[key]["ptx"]
    print(f"{'kernel':24s} {'variants':>8s} {'same SASS':>9s} {'same PTX':>8s} {'one side only':>13s}")
    for name, (n, s, p, one) in sorted(by_name.items()):
        print(f"{name:24s} {n:8d} {s:9d} {p:8d} {one:13d}")
    bad = sum(n - s for n, s, _, _ in by_name.values())
    print("identical" if bad == 0 else f"{bad} variants differ or are missing")
    return int(bad != 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    dump(a.out, a.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
