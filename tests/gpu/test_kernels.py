"""GPU correctness of every catalogue program (skips cleanly without an sm_90 GPU).

Rules (docs/TRANSFORMER_MATH.md): fresh random inputs for every run; every output buffer the kernel
writes is poisoned with NaN first; for every output
    max|out - ref32| <= 2 * max|ref_lowp - ref32| + 1e-6,
with ref32 the interpreter in fp32 on fp32 copies and ref_lowp the same math at the operand
precision. Two runs give bitwise-equal results; one call launches exactly one GEMM kernel plus one
small finishing reduction per finished reduction output.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import coda_cutlass as cc
from catalog import BY_NAME, CASES, compile_options, fit_n, make_inputs
from conftest import hopper_available
from coda_cutlass.runtime import kernel as kernel_module

pytestmark = pytest.mark.skipif(not hopper_available(), reason="needs an sm_90 GPU (H100/H200)")

SHAPES = [(8192, 4096, 4096), (1000, 776, 520), (129, 136, 64)]
BUILD_KEYS = ("dtype", "weight_layout", "config", "input_dtypes", "output_dtypes", "constants",
              "partial_reductions")


class LazyKernels(dict):
    """Compiles a case's kernel on first use (prebuilt or cached kernels load instantly)."""

    def __missing__(self, name: str):
        c = BY_NAME[name]
        k = self[name] = cc.compile_epilogue(c.program, **{k: v for k, v in compile_options(c).items()
                                                            if k in BUILD_KEYS})
        return k


@pytest.fixture(scope="session")
def kernels():
    return LazyKernels()


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(kernel_module, "POISON", True)
    torch.backends.cuda.matmul.allow_tf32 = False


def seed_of(name: str, shape: tuple[int, int, int], salt: int = 0) -> int:
    return zlib.crc32(f"{name}{shape}{salt}".encode())


def fp32_copy(ops: dict) -> dict:
    """fp32 copies (always new tensors: the reference updates accumulated outputs in place)."""
    return {k: (v.to(torch.float32, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in ops.items()}


def clone(ops: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in ops.items()}


def check_outputs(k, out: dict, ref32: dict, lowp: dict, where: str) -> dict[str, tuple[float, float]]:
    report = {}
    assert set(out) == set(ref32), where
    for name in ref32:
        o, r, l = out[name].float(), ref32[name].float(), lowp[name].float()
        assert o.shape == r.shape, f"{where} {name}: shape {tuple(o.shape)} vs {tuple(r.shape)}"
        finite = torch.isfinite(r)
        assert torch.equal(torch.isfinite(o), finite), f"{where} {name}: non-finite values (unwritten/poisoned?)"
        same = (o[~finite] == r[~finite]) | (o[~finite].isnan() & r[~finite].isnan())
        assert bool(same.all()), f"{where} {name}: wrong infinities / NaNs"
        err = (o - r)[finite].abs().max().item() if finite.any() else 0.0
        tol = 2 * (l - r)[finite].abs().max().item() + 1e-6 if finite.any() else 1e-6
        assert err <= tol, f"{where} {name}: max error {err:.3e} > bound {tol:.3e}"
        report[name] = (err, tol)
    return report


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_matches_reference(kernels, case, shape):
    k = kernels[case.name]
    M, N, K = shape
    N = fit_n(case, N)
    A, W, ops = make_inputs(case, M, N, K, "cuda", seed=seed_of(case.name, shape))
    before = clone(ops)
    out = k(A, W, **ops)
    torch.cuda.synchronize()
    ref32 = k.reference(A.float(), W.float(), precision="fp32", **fp32_copy(before))
    lowp = k.reference(A, W, precision="lowp", **before)
    check_outputs(k, out, ref32, lowp, f"{case.name} {shape}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bitwise_deterministic(kernels, case):
    k = kernels[case.name]
    M, N, K = 1000, fit_n(case, 776), 520
    A, W, ops = make_inputs(case, M, N, K, "cuda", seed=seed_of(case.name, (M, N, K), 1))
    first = k(A, W, **clone(ops))
    second = k(A, W, **clone(ops))
    for name in first:
        assert torch.equal(first[name], second[name]) or (
            torch.isnan(first[name]).any() and torch.equal(first[name].nan_to_num(), second[name].nan_to_num())
        ), name


def count_kernels(fn) -> list[str]:
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_one_gemm_launch_per_call(kernels, case, monkeypatch):
    monkeypatch.setattr(kernel_module, "POISON", False)
    k = kernels[case.name]
    A, W, ops = make_inputs(case, 1000, fit_n(case, 776), 520, "cuda", seed=3)
    k(A, W, **clone(ops))     # warm up (loads the library, caches workspace size)
    names = count_kernels(lambda: k(A, W, **ops))
    gemm = [n for n in names if "cutlass" in n or "device_kernel" in n]
    assert len(gemm) == 1, names
    reductions = [n for n in k.ir.nodes if n.op == "reduce"]
    if k.partial_reductions:
        assert len(names) == 1, names
    elif all(r.attr("fn") in ("sum", "max", "min") and r.attr("axis") != "segment" for r in reductions):
        assert len(names) == 1 + len(reductions), names       # one torch / cuBLAS reduction each
    else:   # log-sum-exp and segment sums finish with a few small torch ops each (logsumexp: ~10)
        assert len(names) <= 1 + 12 * len(reductions), names


def test_errors_before_launch(kernels):
    k = kernels["residual_norm_stats"]
    A = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    R = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(cc.CallError, match="missing operand 'g'"):
        k(A, W, resid=R)
    with pytest.raises(cc.CallError, match="unknown operand 'gg'; did you mean 'g'"):
        k(A, W, resid=R, gg=g)
    with pytest.raises(cc.CallError, match="dtype"):
        k(A.float(), W, resid=R, g=g)
    with pytest.raises(cc.CallError, match="shape"):
        k(A, W, resid=R[:, :128], g=g)
    with pytest.raises(cc.CallError, match="16-byte aligned"):
        big = torch.randn(256 * 256 + 1, device="cuda", dtype=torch.bfloat16)
        k(A, W, resid=big[1:].view(256, 256), g=g)
    with pytest.raises(cc.CallError, match="unit column stride"):
        k(A, W, resid=R.t(), g=g)
    with pytest.raises(cc.CallError, match="multiple of 8"):
        k(A[:, :124].contiguous(), W[:, :124].contiguous(), resid=R, g=g)
    out = k(A, W, resid=R, g=g)
    assert out["D"].shape == (256, 256)


def test_empty_dimensions(kernels):
    k = kernels["many_reductions"]
    for M, N in ((0, 776), (1000, 0)):
        A = torch.randn(M, 520, device="cuda", dtype=torch.bfloat16)
        W = torch.randn(N, 520, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        out = k(A, W, x=x)
        assert out["D"].shape == (M, N) and out["rs"].shape == (M,) and out["cs"].shape == (N,)
        assert out["tot"].item() == 0.0
        if N == 0:
            assert torch.all(out["rs"] == 0) and torch.all(out["rmx"] == float("-inf"))
        else:
            assert torch.all(out["cmn"] == float("inf"))
        ref = k.reference(A, W, x=x)          # the reference gives the same identities
        for name in out:
            assert torch.equal(out[name], ref[name]), name
    k = kernels["total_max_min"]
    for M, N in ((0, 776), (1000, 0)):
        A = torch.randn(M, 520, device="cuda", dtype=torch.bfloat16)
        W = torch.randn(N, 520, device="cuda", dtype=torch.bfloat16)
        out = k(A, W, x=torch.randn(M, N, device="cuda", dtype=torch.bfloat16))
        assert out["amax"].item() == float("-inf") and out["tmin"].item() == float("inf")


def test_leading_batch_dims_flatten_like_nn_linear(kernels):
    """(B, S, K) activations, (B, S, N) tiles and (B, S) per-row vectors: the same results as the
    flattened 2-D call, outputs with the leading dimensions back, accumulation in place."""
    k = kernels["norm_backward"]
    c = BY_NAME["norm_backward"]
    B, S, N, K = 4, 250, 776, 520
    A, W, ops = make_inputs(c, B * S, N, K, "cuda", seed=21)
    flat = k(A, W, **clone(ops))
    batched = {n: (v.view(B, S, *v.shape[1:]) if isinstance(v, torch.Tensor) and v.shape[0] == B * S else v)
               for n, v in clone(ops).items()}
    out = k(A.view(B, S, K), W, **batched)
    assert out["dres"] is batched["dres"] and out["y"].shape == (B, S, N) and out["dgamma"].shape == (N,)
    for name in flat:
        assert torch.equal(out[name].reshape(flat[name].shape), flat[name]), name
    ref = k.reference(A.view(B, S, K), W, **{n: (v.clone() if isinstance(v, torch.Tensor) else v)
                                             for n, v in batched.items()})
    assert ref["y"].shape == (B, S, N)


def test_torch_compile_traces_without_graph_break(kernels, monkeypatch):
    monkeypatch.setattr(kernel_module, "POISON", False)
    k = kernels["residual_norm_stats"]
    c = BY_NAME["residual_norm_stats"]
    A, W, ops = make_inputs(c, 1000, 776, 520, "cuda", seed=11)

    def block(A, W, resid, g):
        out = k(A, W, resid=resid, g=g)
        return out["D"] * 2, out["sumsq"].sqrt()

    compiled = torch.compile(block, fullgraph=True)
    got = compiled(A, W, **ops)
    want = block(A, W, **ops)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # leading batch dimensions flatten inside the traced call too
    got = compiled(A.view(8, 125, 520), W, ops["resid"].view(8, 125, 776), ops["g"])
    assert got[0].shape == (8, 125, 776) and got[1].shape == (8, 125)
    for a, b in zip(got, want):
        assert torch.equal(a.reshape(b.shape), b)


def test_every_candidate_config_is_correct():
    from coda_cutlass.tuning.space import candidate_configs
    c = BY_NAME["residual_norm_stats"]
    base = cc.compile_epilogue(c.program, torch.bfloat16)
    for cfg in candidate_configs(base.graph):
        k = cc.compile_epilogue(c.program, torch.bfloat16, config=cfg)
        for shape in ((1000, 776, 520), (2048, 4096, 1024)):
            A, W, ops = make_inputs(c, *shape, "cuda", seed=5)
            out = k(A, W, **clone(ops))
            ref32 = k.reference(A.float(), W.float(), precision="fp32", **fp32_copy(ops))
            lowp = k.reference(A, W, precision="lowp", **ops)
            check_outputs(k, out, ref32, lowp, f"{cfg.name()} {shape}")


def test_autotuner_tunes_once_and_remembers(tmp_path, monkeypatch):
    from coda_cutlass.tuning import TunedEpilogue
    c = BY_NAME["residual_norm_stats"]
    k = cc.compile_epilogue(c.program, torch.bfloat16, config="tune", cache_dir=tmp_path)
    assert isinstance(k, TunedEpilogue)
    A, W, ops = make_inputs(c, 2048, 4096, 1024, "cuda", seed=9)
    out = k(A, W, **ops)
    rec = k.choice(A, W)
    assert rec["tuned"] and len(rec["timings"]) >= len(k.candidates)
    ref = k.kernel(cc.KernelConfig()).reference(A, W, **ops)
    torch.testing.assert_close(out["D"].float(), ref["D"].float(), rtol=0.02, atol=0.05)
    again = cc.compile_epilogue(c.program, torch.bfloat16, config="tune", cache_dir=tmp_path)
    monkeypatch.setattr(TunedEpilogue, "tune", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("re-tuned")))
    again(A, W, **ops)
    assert again.choice(A, W)["config"] == rec["config"]


def _library_inputs(program, M: int, N: int, K: int, seed: int) -> tuple:
    """Fresh inputs for a library epilogue, from its operand kinds (index and position vectors by name)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16
    A = (torch.randn(M, K, device="cuda", generator=g) * 0.5).to(bf)
    W = (torch.randn(N, K, device="cuda", generator=g) * 0.5).to(bf)
    ops = {}
    for o in program.trace().operands:
        if o.name == "target":
            ops[o.name] = torch.randint(-1, N, (M,), device="cuda", generator=g)
        elif o.name == "pos":
            ops[o.name] = torch.randint(0, 8192, (M,), device="cuda", generator=g).float()
        elif o.name == "freq":
            ops[o.name] = 10000.0 ** -torch.rand(N, device="cuda", generator=g)
        elif o.packed:
            ops[o.name] = torch.randn(M, 2 * N, device="cuda", generator=g).to(bf)
        else:
            ops[o.name] = torch.rand(M, device="cuda", generator=g) + 0.5
    return A, W, ops


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_reusing_angles_across_heads_matches_the_reference(head_dim):
    """coda::PairRotate reuses a thread's cos/sin in epilogue subtile n + EPI_N/2 when its angles there
    equal those of subtile n (heads with the same frequencies). Llama-style head-periodic frequencies
    with V columns (freq 0), a few perturbed frequencies (so only some lanes of a warp can reuse), a
    ragged M and N tail, every candidate config, 2x rule with poisoned outputs."""
    from coda_cutlass import epilogues as E
    from coda_cutlass.tuning.space import candidate_configs
    M, N, K = 1000, 1536 + 2 * head_dim, 520
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    inv = 500000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device="cuda") / head_dim)
    freq = inv.repeat_interleave(2).repeat(N // head_dim)
    freq[N - 256:] = 0.0                                         # V
    bumped = torch.randint(N // 2, N - 256, (5,), device="cuda", generator=g) // 2 * 2
    freq[bumped] *= 1.001
    freq[bumped + 1] = freq[bumped]
    A = (torch.randn(M, K, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    W = (torch.randn(N, K, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    ops = {"r": torch.rand(M, device="cuda", generator=g) + 0.5,
           "pos": torch.randint(0, 8192, (M,), device="cuda", generator=g).float(), "freq": freq}
    base = cc.compile_epilogue(E.rope, torch.bfloat16)
    for cfg in candidate_configs(base.graph):
        k = cc.compile_epilogue(E.rope, torch.bfloat16, config=cfg)
        out = k(A, W, **clone(ops))
        ref32 = k.reference(A.float(), W.float(), precision="fp32", **fp32_copy(ops))
        lowp = k.reference(A, W, precision="lowp", **ops)
        check_outputs(k, out, ref32, lowp, f"rope head_dim {head_dim} {cfg.name()}")
        # V columns (freq 0) are the row-scaled GEMM, not rotated
        v = (A.float() @ W.float().t())[:, N - 256:] * ops["r"][:, None]
        assert (out["D"][:, N - 256:].float() - v).abs().max() <= 0.02 * v.abs().max()


@pytest.mark.parametrize("name", ["swiglu", "swiglu_only", "rope", "qk_norm_stats", "lm_head_lse",
                                  "lm_head_lse_logits", "swiglu_backward"])
def test_every_candidate_config_of_the_pairwise_library(name):
    """The autotuner may pick any candidate: each one, for each library epilogue with custom visitor
    nodes (pairs, half-width stores, packed pairs, log-sum-exp, gather, segment sums), at a ragged
    shape, under the 2x rule with poisoned outputs."""
    from coda_cutlass import epilogues as E
    from coda_cutlass.tuning.space import candidate_configs
    program = getattr(E, name)
    base = cc.compile_epilogue(program, torch.bfloat16)
    M, N, K = 1000, 768, 520
    for i, cfg in enumerate(candidate_configs(base.graph)):
        k = cc.compile_epilogue(program, torch.bfloat16, config=cfg)
        A, W, ops = _library_inputs(program, M, N, K, seed=i)
        out = k(A, W, **clone(ops))
        ref32 = k.reference(A.float(), W.float(), precision="fp32", **fp32_copy(ops))
        lowp = k.reference(A, W, precision="lowp", **ops)
        check_outputs(k, out, ref32, lowp, f"{name} {cfg.name()}")


@pytest.mark.parametrize("shape", [(1000, 776, 520), (77, 40, 64), (256, 4112, 128)])
@pytest.mark.parametrize("aligned", [True, False])
def test_half_width_store_exchange_edges(shape, aligned):
    """coda::HalfWidthStore hands a quad's outputs around so each lane writes 4 adjacent ones in one
    8-byte store. Its other paths: a tile past N (N/2 not a multiple of the 16 outputs a quad
    writes per row: the stores inside N go out one by one), and an output whose rows do not start
    on 8 bytes (a column slice of a wider buffer: every value on its own). Outputs poisoned, the
    columns around the slice must stay untouched."""
    from coda_cutlass import epilogues as E
    M, N, K = shape
    k = cc.compile_epilogue(E.swiglu, torch.bfloat16)
    A, W, ops = _library_inputs(E.swiglu, M, N, K, seed=M + N)
    pad = 0 if aligned else 1
    buf = torch.full((M, N // 2 + 2 * pad), -7.0, device="cuda", dtype=torch.bfloat16)
    y = buf[:, pad:pad + N // 2]
    y.fill_(float("nan"))
    out = k(A, W, out={"y": y}, **clone(ops))
    assert out["y"].data_ptr() == y.data_ptr()
    ref32 = k.reference(A.float(), W.float(), precision="fp32", **fp32_copy(ops))
    lowp = k.reference(A, W, precision="lowp", **ops)
    check_outputs(k, out, ref32, lowp, f"swiglu half-width {shape} aligned={aligned}")
    if pad:
        assert bool((buf[:, 0] == -7.0).all()) and bool((buf[:, -1] == -7.0).all()), "wrote outside the slice"
