"""Map kernels (an epilogue program over an existing tensor, no GEMM) on the CPU: the reference,
the generated source, refusals, and one real nvcc build (a map kernel compiles in seconds)."""

from __future__ import annotations

import shutil

import pytest
import torch

import coda_cutlass as cc
from coda_cutlass import epilogues as E

F32 = torch.float32


def test_rope_backward_reference_on_a_strided_4d_gradient():
    g = torch.Generator().manual_seed(0)
    B, S, H, D = 2, 4, 3, 16
    grad = torch.randn(B, H, S, D, generator=g).transpose(1, 2)       # (B, S, H, D) view, not contiguous
    y = torch.randn(B * S, H * D, generator=g)
    r = torch.rand(B * S, generator=g) + 0.5
    pos = torch.arange(S, dtype=F32).repeat(B)
    freq = torch.rand(H * D // 2, generator=g).repeat_interleave(2)
    out = cc.map_reference(E.rope_backward, grad, y=y, r=r, pos=pos, freq=freq, precision="fp32")
    dy = grad.reshape(B * S, H * D)
    theta = -(pos[:, None] * freq[None, :])[:, 0::2]
    a, b = dy[:, 0::2], dy[:, 1::2]
    rot = torch.stack((a * theta.cos() - b * theta.sin(), a * theta.sin() + b * theta.cos()), -1).flatten(1)
    torch.testing.assert_close(out["dz"], rot * r[:, None], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out["zdz"], (dy * y).sum(1), rtol=1e-5, atol=1e-5)


def test_norm_stats_reference():
    x = torch.randn(6, 32)
    gamma = torch.randn(32)
    out = cc.map_reference(E.norm_stats, x, g=gamma, precision="fp32")
    torch.testing.assert_close(out["h"], x * gamma)
    torch.testing.assert_close(out["sumsq"], (x * x).sum(1))


def test_generated_source_hoists_what_does_not_vary_along_rows():
    src = cc.emit_map(E.rope_backward)
    loop = src.index("for (int64_t m = ")
    assert src.index("load1<float>(p.tensors[4], n0 + i)") < loop       # freq: per column, before the loop
    assert src.index("load1<float>(p.tensors[2], m)") > loop           # r: per row, inside
    assert "coda_map_run" in src and "rope_backward" in src


@cc.epilogue
def _with_lse(acc):
    return {"lse": cc.row_logsumexp(acc)}


@cc.epilogue
def _with_col_sum(acc):
    return {"s": cc.col_sum(acc)}


@cc.epilogue
def _with_pack(acc, z: cc.PairTile):
    a, b = cc.unpack(z)
    return a * acc


@cc.epilogue
def _with_pack_store(acc):
    return {"D": cc.pack(acc, acc * 2.0)}


@pytest.mark.parametrize("program,what", [(_with_lse, "log-sum-exp"), (_with_col_sum, "col reductions"),
                                          (_with_pack, "operand 'z'.*packed pairs"),
                                          (_with_pack_store, r"node %\d+ \(pack\).*packed pairs")])
def test_unsupported_nodes_are_refused_by_name(program, what):
    with pytest.raises(cc.EpilogueError, match=what):
        cc.emit_map(program)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_map_kernel_builds_and_describes_itself(tmp_path):
    import json
    import ctypes
    k = cc.compile_map(E.rope_backward, cache_dir=tmp_path, verbose=False)
    assert k.path.is_file() and k.origin == "built"
    lib = ctypes.CDLL(str(k.path))
    lib.coda_describe.restype = ctypes.c_char_p
    desc = json.loads(lib.coda_describe().decode())
    assert desc["program"] == "rope_backward" and [s["name"] for s in desc["slots"]] == ["acc", "y", "r", "pos",
                                                                                       "freq", "dz", "zdz"]
    if not torch.cuda.is_available():
        with pytest.raises(cc.DeviceError):
            k(torch.zeros(8, 8, dtype=torch.bfloat16), y=None, r=None, pos=None, freq=None)
