"""Where a whole-model training step's peak memory goes (issue 21: coda's peak against Liger's).

    python bench/probes/memory_peak.py --config 1b --variants liger,coda --out /tmp/mem

Builds the variants as bench/model.py does (same weights, tokens, fused AdamW), runs two steps of
each, then records the CUDA caching allocator's history over a third step alone and replays it:
the peak of allocated bytes, when in the step it happens (the Python frame that allocated the block
that set it), and the blocks alive at that moment grouped by the first frame inside coda_cutlass,
transformers or liger_kernel (torch's own frames skipped). Writes memory.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import model as bench_model  # noqa: E402  (bench/model.py: sets the allocator config before CUDA starts)
import torch  # noqa: E402

OWN = ("coda_cutlass", "transformers", "liger_kernel", "bench/")
SKIP = ("coda_cutlass/runtime/", "coda_cutlass/nn/runner.py", "coda_cutlass/partials.py")   # allocators, not callers


def frame_key(frames: list[dict[str, Any]]) -> str:
    """The first frame of a library that users call (not torch's), as file:line function."""
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in OWN) and not any(k in name for k in SKIP):
            short = name.split("site-packages/")[-1].split("/work/main/")[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "(torch internal)"


def replay(trace: list[dict[str, Any]]) -> dict[str, Any]:
    """Live bytes over the trace; the live blocks at the peak, grouped by frame_key."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    peak_at = -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], "")
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif e["action"] in ("free_completed",) and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    live, total = {}, 0
    for e in trace[:peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], frame_key(e.get("frames", [])))
        elif e["action"] == "free_completed" and e["addr"] in live:
            live.pop(e["addr"])
    groups: dict[str, list[int]] = defaultdict(list)
    for size, key in live.values():
        groups[key].append(size)
    top = sorted(((sum(v), len(v), k) for k, v in groups.items()), reverse=True)
    return {"step_peak_gib": peak / 2**30, "peak_set_by": frame_key(trace[peak_at].get("frames", [])) if peak_at >= 0 else None,
            "live_at_peak": [{"gib": b / 2**30, "blocks": n, "where": k} for b, n, k in top[:25]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="1b", choices=sorted(bench_model.CONFIGS))
    p.add_argument("--variants", default="liger,coda")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--ce-chunk-mib", type=int, default=None)
    p.add_argument("--compile-mode", default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    names = args.variants.split(",")
    fields = dict(bench_model.CONFIGS[args.config])
    results: dict[str, Any] = {"config": args.config, "batch": args.batch, "seq": args.seq}
    for name in names:             # one variant at a time: nothing else resident
        variants = bench_model.build_variants(fields, [name], args)
        v = variants[name]
        g = torch.Generator(device="cuda").manual_seed(1)
        tokens = torch.randint(0, fields["vocab_size"], (args.batch, args.seq), device="cuda", generator=g)
        for _ in range(2):
            v.step(tokens)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        v.step(tokens)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][torch.cuda.current_device()]
        r = replay(trace)
        r["allocated_before_gib"] = before / 2**30
        r["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        r["resident_gib"] = v.resident_bytes() / 2**30
        results[name] = r
        print(f"\n[{args.config}] {name}: max allocated {r['max_allocated_gib']:.2f} GiB (before the step "
              f"{before / 2**30:.2f}); the step's own peak {r['step_peak_gib']:.2f} GiB, set by {r['peak_set_by']}")
        for row in r["live_at_peak"][:15]:
            print(f"  {row['gib']:7.3f} GiB  {row['blocks']:5d} blocks  {row['where']}")
        del variants, v
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
