"""Probe: can L2 cache hints stop the two-pass transposing map kernels re-reading DRAM?

ncu (fifteenth session, docs/RESULTS.md): `quantize_rows_t` at 8192 x 28672 moves ~1.37 GB for the
0.94 GB it needs; its second pass over each 128-row block hits L2 only 47% of the time, because
the resident blocks' inputs and the outputs being written pass through the same 50 MB of L2. This
probe builds variants of the generated kernels by editing their source text (the same program and
ABI; the values stored are the same, only cache policy differs) and times them in one process
against the generated kernel and torch's cast, with the outputs compared bit for bit:

- stream_stores: every FP8 store (row copy, transposed copy) as st.global.cs (evict first), so
  written lines leave L2 before the inputs the second pass re-reads;
- keep_inputs: the first pass loads X with an L2 evict_last policy (createpolicy), the second pass
  with evict_first (the last use);
- both.

    python bench/probes/map_cache_hints.py --build     # build the variants (no GPU needed)
    python bench/probes/map_cache_hints.py OUTDIR      # H200: check and time; writes results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from coda_cutlass import epilogues as E  # noqa: E402
from coda_cutlass.build.builder import build  # noqa: E402
from coda_cutlass.lower.map import lower_map  # noqa: E402
from coda_cutlass.maps import _map_options  # noqa: E402
from coda_cutlass.pipeline import typed_ir  # noqa: E402
from coda_cutlass.render.map import render_map_kernel  # noqa: E402
from coda_cutlass.runtime.map_kernel import CompiledMap  # noqa: E402

# Device helpers the variants call instead of coda::map's (same values, other cache policies).
PRELUDE = r"""
namespace hint {
CUTLASS_DEVICE uint64_t policy_keep() {
  uint64_t p; asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p)); return p;
}
CUTLASS_DEVICE uint64_t policy_drop() {
  uint64_t p; asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p)); return p;
}
template <class T, bool Keep>
CUTLASS_DEVICE void load8(void const* base, int64_t offset, float (&out)[coda::map::kVec]) {
  static_assert(sizeof(T) == 2, "bf16 / f16 inputs");
  uint4 raw;
  const uint64_t pol = Keep ? policy_keep() : policy_drop();
  asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w)
               : "l"(static_cast<T const*>(base) + offset), "l"(pol));
  T const* e = reinterpret_cast<T const*>(&raw);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < coda::map::kVec; ++i) out[i] = coda::map::to_float(e[i]);
}
template <class T>
CUTLASS_DEVICE void store8(void* base, int64_t offset, float const (&in)[coda::map::kVec]) {
  static_assert(sizeof(T) == 1, "FP8 outputs");
  uint2 raw;
  T* e = reinterpret_cast<T*>(&raw);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < coda::map::kVec; ++i) e[i] = coda::map::from_float<T>(in[i]);
  __stcs(reinterpret_cast<uint2*>(static_cast<T*>(base) + offset), raw);
}
template <class Tile>
CUTLASS_DEVICE void write(Tile const& t, void* base, int64_t offset, int col, int rows) {
  uint8_t* p = static_cast<uint8_t*>(base) + offset;
  constexpr int R = sizeof(t.tile) / sizeof(t.tile[0]);
  if (rows == R) {
    CUTLASS_PRAGMA_UNROLL
    for (int r0 = 0; r0 < R; r0 += 16) {
      alignas(16) uint8_t v[16];
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 16; ++r) v[r] = t.tile[r0 + r][col];
      __stcs(reinterpret_cast<uint4*>(p + r0), *reinterpret_cast<uint4 const*>(v));
    }
  } else {
    for (int r = 0; r < rows; ++r) p[r] = t.tile[r][col];
  }
}
}  // namespace hint
"""


def variant(src: str, stream_stores: bool, keep_inputs: bool) -> str:
    out = src.replace("namespace coda_generated {", "namespace coda_generated {\n" + PRELUDE, 1)
    if stream_stores:
        out = out.replace("coda::map::store8<cutlass::float_e4m3_t>(", "hint::store8<cutlass::float_e4m3_t>(")
        out = out.replace("t3.write(", "hint::write(t3, ")
    if keep_inputs:
        first, second = out.split("// Second pass", 1)
        first = first.replace("coda::map::load8<cutlass::bfloat16_t>(", "hint::load8<cutlass::bfloat16_t, true>(")
        second = second.replace("coda::map::load8<cutlass::bfloat16_t>(", "hint::load8<cutlass::bfloat16_t, false>(")
        out = first + "// Second pass" + second
    return out


VARIANTS = {"generated": (False, False), "stream_stores": (True, False), "keep_inputs": (False, True),
            "both": (True, True)}
SHAPES = [(8192, 28672, "dz"), (8192, 6144, "dqkv"), (8192, 4096, "o / dx"), (1000, 384, "ragged")]


def kernels() -> dict[str, CompiledMap]:
    opts = _map_options(torch.bfloat16, None, None, None)
    graph = lower_map(typed_ir(E.quantize_rows_t, opts), opts.dtype)
    src = render_map_kernel(graph)
    assert "// Second pass" in src and "t3.write(" in src, "the generated source changed: update the probe"
    out = {}
    for name, (ss, ki) in VARIANTS.items():
        text = src if name == "generated" else variant(src, ss, ki)
        out[name] = CompiledMap(graph, text, build(text, f"quantize_rows_t_{name}", dtype=opts.dtype))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--build", action="store_true")
    args = ap.parse_args()
    ks = kernels()
    if args.build:
        print("built:", ", ".join(ks))
        return
    from report import environment, require_hopper
    from coda_cutlass.timing import interleaved
    require_hopper("bench/probes/map_cache_hints.py")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for M, N, what in SHAPES:
        xs = [torch.randn(M, N, device="cuda").to(torch.bfloat16) for _ in range(2)]
        fns = {name: k for name, k in ks.items()}
        fns["torch cast"] = lambda x: x.to(torch.float8_e4m3fn)
        ref = ks["generated"](xs[0])
        same = {}
        for name, k in ks.items():
            got = k(xs[0])
            same[name] = all(torch.equal(got[o].view(torch.uint8) if got[o].dtype.itemsize == 1 else got[o],
                                         ref[o].view(torch.uint8) if ref[o].dtype.itemsize == 1 else ref[o])
                             for o in ref)
        t = interleaved(fns, xs, rounds=3, reps=10)
        moved = {n: (3 if n == "torch cast" else 4) * M * N / us / 1e3 for n, us in t.items()}
        rows.append({"tensor": what, "M": M, "N": N, "us": t, "GBps": moved, "same_as_generated": same})
        print(what, M, N, {n: f"{us:.1f} us {moved[n]:.0f} GB/s" for n, us in t.items()}, "same:", same, flush=True)
        del xs
    (args.out / "results.json").write_text(json.dumps({"environment": environment(), "results": rows}, indent=1))
    print(f"wrote {args.out}/results.json")


if __name__ == "__main__":
    main()
