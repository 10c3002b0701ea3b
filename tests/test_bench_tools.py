"""The benchmark tools that run without a GPU (bench/byte_bound.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_byte_bound_reads_block_results_without_a_gpu():
    import byte_bound
    result = {"width": "8b", "M": 8192,
              "sites": {"coda": {"qkv.dgrad": 676.0, "qkv": 646.0}, "cublas": {"qkv.dgrad": 629.0, "qkv": 636.0}},
              "sites_fwd": {"coda": {"gate_up.infer": 3030.0}, "cublas": {"gate_up": 2994.0}}}
    rows = {r["site"]: r for r in byte_bound.rows(result)}
    assert set(rows) == {"qkv.dgrad", "qkv", "gate_up.infer"}
    nb = rows["qkv.dgrad"]          # x and dres read: 2 x 8192 x 4096 bf16 = 128 MiB beyond the bare GEMM
    assert 128 < nb["extra_mib"] < 130
    assert nb["unhidden"] == 1 + nb["extra_us"] / 629.0
    assert nb["hidden"] < 0         # it lost more (47 us) than its bytes take at copy bandwidth (~32 us)
    assert rows["qkv"]["hidden"] is None and rows["gate_up.infer"]["extra_mib"] < 0
    assert "| 8b | 8192 | qkv.dgrad |" in byte_bound.markdown(list(rows.values()))
