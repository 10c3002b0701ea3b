"""GPU correctness of map kernels and of coda_cutlass.nn (skips cleanly without an sm_90 GPU).

Kernels: the 2x rule of docs/TRANSFORMER_MATH.md on fresh random inputs with poisoned outputs:
    max|out - ref32| <= 2 * max|ref_lowp - ref32| + 1e-6.
Block and model: the same rule one level up: the coda module in bf16/fp16 against the standard
torch block in fp32, bounded by twice the error of the standard block run eagerly in bf16/fp16,
for the output and every gradient (max abs error per tensor, plus a 1e-3 relative floor for the
tiny gradients of norm weights, which sum many rounded products).
"""

from __future__ import annotations

import pytest
import torch

import coda_cutlass as cc
from coda_cutlass import epilogues as E
from coda_cutlass.nn import KernelRunner, LlamaBlock, LlamaModel
from coda_cutlass.runtime import kernel as kernel_module
from conftest import hopper_available
from llama_reference import coda_grads_standard, standard_block, standard_model_loss, standard_weights

pytestmark = pytest.mark.skipif(not hopper_available(), reason="needs an sm_90 GPU (H100/H200)")
F32 = torch.float32


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(kernel_module, "POISON", True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def check(out: dict, ref32: dict, lowp: dict, where: str) -> None:
    for name in ref32:
        o, r, l = out[name].float(), ref32[name].float(), lowp[name].float()
        assert o.shape == r.shape, f"{where} {name}: shape {tuple(o.shape)} vs {tuple(r.shape)}"
        assert bool(torch.isfinite(o).all()), f"{where} {name}: non-finite values (unwritten/poisoned?)"
        err = (o - r).abs().max().item()
        tol = 2 * (l - r).abs().max().item() + 1e-6
        assert err <= tol, f"{where} {name}: max error {err:.3e} > bound {tol:.3e}"


@cc.epilogue
def _generic(acc, s: cc.Scalar, v: cc.PerCol, t: cc.Tile):
    """Exercises what map kernels support beyond the block's programs."""
    a, b = cc.pairs(acc)
    x = cc.interleave(cc.gelu(a) * s, cc.sigmoid(b) + v)
    w = cc.where(cc.col_index() < cc.row_index(), x, cc.cast(t * 3.0, torch.bfloat16))
    return {"D": w, "half": cc.half_width(a * b), "mx": cc.row_max(w), "mn": cc.row_min(x),
            "tot": cc.total_sum(x), "acc_t": cc.accumulate(x * 0.5)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4096, 2048), (1000, 776), (33, 8)])
def test_generic_map_kernel(dtype, shape):
    M, N = shape
    g = torch.Generator(device="cuda").manual_seed(M * 7 + N)
    X = torch.randn(M, N, device="cuda", generator=g).to(dtype)
    ops = {"s": 0.7, "v": torch.randn(N, device="cuda", generator=g).to(dtype),
           "t": torch.randn(M, N, device="cuda", generator=g).to(dtype),
           "acc_t": torch.randn(M, N, device="cuda", generator=g).to(dtype)}
    k = cc.compile_map(_generic, dtype)
    start = ops["acc_t"].clone()
    out = k(X, **ops)
    assert out["acc_t"].data_ptr() == ops["acc_t"].data_ptr()
    ref = lambda p, **kw: cc.map_reference(_generic, X.float() if p == "fp32" else X, dtype=dtype,  # noqa: E731
                                           precision=p, **{**kw, "acc_t": start.float() if p == "fp32" else start})
    f32 = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in ops.items() if k != "acc_t"}
    low = {k: v for k, v in ops.items() if k != "acc_t"}
    check(out, ref("fp32", **f32), ref("lowp", **low), f"generic {dtype} {shape}")


def test_rope_backward_map_kernel_reads_strided_attention_gradients():
    B, S, H, D = 2, 512, 8, 128
    g = torch.Generator(device="cuda").manual_seed(11)
    grad = torch.randn(B, H, S, D, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)  # (B,S,H,D) view
    qkv = torch.randn(B * S, 3 * H * D, device="cuda", generator=g).to(torch.bfloat16)
    y = qkv[:, H * D:2 * H * D]                     # a column slice: row stride 3 * H * D
    r = torch.rand(B * S, device="cuda", generator=g) + 0.5
    pos = torch.arange(S, dtype=F32, device="cuda").repeat(B)
    freq = (10000.0 ** -(torch.arange(0, D, 2, device="cuda") / D)).repeat_interleave(2).repeat(H).float()
    dz = torch.full((B * S, 3 * H * D), float("nan"), device="cuda", dtype=torch.bfloat16)
    k = cc.compile_map(E.rope_backward, torch.bfloat16)
    out = k(grad, out={"dz": dz[:, H * D:2 * H * D]}, y=y, r=r, pos=pos, freq=freq)
    assert out["dz"].data_ptr() == dz[:, H * D:].data_ptr()
    assert bool(dz[:, :H * D].isnan().all()) and bool(dz[:, 2 * H * D:].isnan().all())   # nothing else written
    ops = dict(r=r, pos=pos, freq=freq)
    ref32 = cc.map_reference(E.rope_backward, grad.float(), dtype=torch.bfloat16, precision="fp32", y=y.float(), **ops)
    lowp = cc.map_reference(E.rope_backward, grad, dtype=torch.bfloat16, precision="lowp", y=y, **ops)
    check(out, ref32, lowp, "rope_backward")


def test_norm_stats_map_kernel():
    x = torch.randn(8192, 4096, device="cuda").to(torch.bfloat16)
    gamma = (torch.randn(4096, device="cuda") * 0.1 + 1).to(torch.bfloat16)
    k = cc.compile_map(E.norm_stats, torch.bfloat16)
    out = k(x, g=gamma)
    ref32 = cc.map_reference(E.norm_stats, x.float(), dtype=torch.bfloat16, precision="fp32", g=gamma.float())
    lowp = cc.map_reference(E.norm_stats, x, dtype=torch.bfloat16, precision="lowp", g=gamma)
    check(out, ref32, lowp, "norm_stats")


def _generic_ops(M: int, N: int, dtype=torch.bfloat16) -> dict:
    g = torch.Generator(device="cuda").manual_seed(M * 7 + N + 1)
    return {"s": 0.7, "v": torch.randn(N, device="cuda", generator=g).to(dtype),
            "t": torch.randn(M, N, device="cuda", generator=g).to(dtype),
            "acc_t": torch.randn(M, N, device="cuda", generator=g).to(dtype)}


def test_map_kernel_refuses_unknown_outputs_and_in_place_aliases():
    M, N = 64, 256
    X = torch.randn(M, N, device="cuda").to(torch.bfloat16)
    ops = _generic_ops(M, N)
    k = cc.compile_map(_generic, torch.bfloat16)
    with pytest.raises(cc.CallError, match=r"out: 'mx' is not a tile output of _generic \(tile outputs: D, half\)"):
        k(X, out={"mx": torch.empty(M, device="cuda")}, **ops)
    with pytest.raises(cc.CallError, match="acc_t: is updated in place and overlaps the memory of X"):
        k(X, **{**ops, "acc_t": X})
    with pytest.raises(cc.CallError, match="D: is updated in place and overlaps the memory of t"):
        k(X, out={"D": ops["t"]}, **ops)
    with pytest.raises(cc.CallError, match="unknown operand 'tt'; did you mean 't'.*The call is k\\(X, s=..."):
        k(X, **{"tt" if n == "t" else n: v for n, v in ops.items()})
    with pytest.raises(cc.CallError, match="X: is on cpu; the kernel runs on a CUDA GPU"):
        k(X.cpu(), **ops)
    tall = torch.zeros(1, N, device="cuda", dtype=torch.bfloat16).expand(1 << 24, N)   # col/row_index: fp32
    with pytest.raises(cc.CallError, match="need M and N below 2\\^24"):
        k(tall, **{**_generic_ops(1, N), "t": tall, "acc_t": tall})
    start = ops["acc_t"].clone()
    k(X, out={"D": torch.empty(M, N, device="cuda", dtype=torch.bfloat16)}, **ops)     # separate tensors: fine
    assert not torch.equal(ops["acc_t"], start)


def test_map_kernel_writes_a_tile_output_over_x_itself():
    """out={"D": X} (the LM head's dlogits over its logits chunk): the same results as into a fresh
    tensor, the other outputs included, at a shape with a partial row block and column tile."""
    M, N = 1000, 392
    X = torch.randn(M, N, device="cuda").to(torch.bfloat16)
    ops = _generic_ops(M, N)
    k = cc.compile_map(_generic, torch.bfloat16)
    fresh = k(X, **{**ops, "acc_t": ops["acc_t"].clone()})
    Xc = X.clone()
    over = k(Xc, out={"D": Xc}, **{**ops, "acc_t": ops["acc_t"].clone()})
    assert over["D"] is Xc
    for name, t in fresh.items():
        assert torch.equal(over[name], t), name


@pytest.mark.parametrize("dtype, dloss", [(torch.bfloat16, 1 / 3), (torch.float16, 65536.0)])
def test_scale_by_map_kernel_in_place_is_one_fp32_product_per_element(dtype, dloss):
    """E.scale_by over X itself (the fused LM head's gradients times dloss): bit for bit
    (X.float() * s).to(dtype), s fp32 as given (not rounded to X's dtype first), at a shape with a
    partial row block, fp16's overflow to inf included."""
    X = (torch.randn(1000, 392, device="cuda") * 4).to(dtype)
    s = torch.tensor(dloss, device="cuda")
    want = (X.float() * s).to(dtype)
    k = cc.compile_map(E.scale_by, dtype)
    out = k(X, out={"D": X}, s=s)
    assert out["D"] is X and torch.equal(X, want)


def test_model_scales_its_lm_head_gradients_by_dloss_with_the_map_kernel():
    """The model's backward under a dloss other than 1 ((loss / 3).backward()): the LM head's and the
    final norm's gradients are its dloss = 1 gradients times dloss, computed in fp32 and rounded once,
    through the runner's scale_by map kernel (the site it launches under is recorded)."""
    from coda_cutlass.nn.runner import Recorder
    torch.manual_seed(0)
    model = LlamaModel(512, 256, 1, 4, 2, 512, rope_theta=1e4, device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(0, 512, (2, 128), device="cuda")
    runner = KernelRunner(torch.bfloat16)
    model.set_runner(runner)
    grads = []
    for scale in (1.0, 1 / 3):
        model.zero_grad()
        runner.recorder = Recorder()
        try:
            (model(tokens, tokens) * scale).backward()
        finally:
            rec, runner.recorder = runner.recorder, None
        assert "lm_head.dloss" in rec.events
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in ("lm_head", "norm"):
        assert torch.equal(grads[1][name], (grads[0][name].float() * (1 / 3)).to(torch.bfloat16)), name


@pytest.mark.parametrize("partial", [False, True], ids=["finished", "partials"])
@pytest.mark.parametrize("shape", [(0, 512), (6, 0)], ids=["M0", "N0"])
def test_map_kernel_empty_shapes_return_what_the_reference_returns(shape, partial):
    """No launch: reductions are their identity, shaped like cc.map_reference's (with partials:
    (ceil(N / 256), M), e.g. (2, 0) for M = 0)."""
    M, N = shape
    X = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    ops = _generic_ops(M, N)
    k = cc.compile_map(_generic, torch.bfloat16, partial_reductions=partial)
    out = k(X, **ops)
    ref = cc.map_reference(_generic, X, dtype=torch.bfloat16, partial_reductions=partial, **ops)
    assert set(out) == set(ref)
    for name in ref:
        assert out[name].shape == ref[name].shape and out[name].dtype == ref[name].dtype, name
        torch.testing.assert_close(out[name], ref[name])


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_within_twice_eager(name: str, ours: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor) -> None:
    e_ours, e_eager = max_err(ours, ref), max_err(eager, ref)
    bound = 2 * e_eager + 1e-3 * ref.float().abs().max().item()
    assert e_ours <= bound, f"{name}: max error {e_ours:.3e} > 2 x eager's {e_eager:.3e} (+ floor)"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_block_forward_and_gradients_within_twice_eager_error(dtype):
    torch.manual_seed(0)
    B, S, D = 2, 512, 1024
    block = LlamaBlock(D, 16, 4, 2816, eps=1e-5, rope_theta=10000.0, device="cuda", dtype=dtype)
    with torch.no_grad():
        for w in (block.qkv, block.o, block.gate_up, block.down):
            w.mul_(0.5)
        block.attn_norm.normal_(1.0, 0.2)
        block.mlp_norm.normal_(1.0, 0.2)
    assert isinstance(block.get_runner(), KernelRunner)
    x = torch.randn(B, S, D, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(B, S, D, device="cuda", dtype=dtype)
    y = block(x)
    y.backward(dy)
    with torch.no_grad():       # the forward alone (gate/up through swiglu_only, nothing saved)
        y_infer = block(x.detach())
    ours = {"y": y.detach(), "y_no_grad": y_infer, "x": x.grad, **coda_grads_standard(block)}
    results = {}
    for prec in ("fp32", "eager"):
        w = standard_weights(block)
        if prec == "fp32":
            w = {k: v.detach().float().requires_grad_() for k, v in w.items()}
        xr = (x.detach().float() if prec == "fp32" else x.detach().clone()).requires_grad_()
        yr = standard_block(xr, w, block.dims, block.inv_freq)
        yr.backward(dy.float() if prec == "fp32" else dy)
        results[prec] = {"y": yr.detach(), "y_no_grad": yr.detach(), "x": xr.grad,
                         **{k: v.grad for k, v in w.items()}}
    for name in ours:
        assert_within_twice_eager(name, ours[name], results["eager"][name], results["fp32"][name])


def test_model_loss_and_gradients_within_twice_eager_error():
    torch.manual_seed(1)
    V = 4096
    model = LlamaModel(V, 1024, 2, 16, 4, 2816, rope_theta=10000.0, device="cuda", dtype=torch.bfloat16,
                       ce_chunk_bytes=V * 2 * 384)        # several LM-head row chunks
    tokens = torch.randint(0, V, (2, 512), device="cuda")
    targets = torch.randint(0, V, (2, 512), device="cuda")
    targets[:, :7] = -100
    loss = model(tokens, targets)
    loss.backward()
    fp32 = LlamaModel(V, 1024, 2, 16, 4, 2816, rope_theta=10000.0, device="cuda", dtype=torch.float32)
    fp32.load_state_dict(model.state_dict())
    ref, leaves = standard_model_loss(fp32, tokens, targets)
    ref.backward()
    eager, eleaves = standard_model_loss(model, tokens, targets)
    eager.backward()
    assert abs(loss.item() - ref.item()) <= 2 * abs(eager.item() - ref.item()) + 1e-3
    for name in ("embed", "norm", "lm_head"):
        assert_within_twice_eager(name, getattr(model, name).grad, eleaves[name].grad, leaves[name].grad)
    for block, wr, we in zip(model.blocks, leaves["blocks"], eleaves["blocks"]):
        grads = coda_grads_standard(block)
        for name in wr:
            assert_within_twice_eager(name, grads[name], we[name].grad, wr[name].grad)


def test_in_sequence_tuning_confirms_stores_and_adopts_a_plan(tmp_path):
    """The tuner end to end on a small block (two candidates per site, to stay quick): every site
    gets a first-pass timing and a confirmation verdict, the plan is stored in the cache given and
    the runner uses it; tuning the forward alone then adds its own sites and keeps the training
    choices; the block is still right afterwards."""
    from coda_cutlass.nn.plan_store import load_plan
    from coda_cutlass.pipeline import Options, lower_program
    from coda_cutlass.tuning.space import candidate_configs
    torch.manual_seed(2)
    block = LlamaBlock(1024, 16, 4, 2816, eps=1e-5, rope_theta=10000.0, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for w in (block.qkv, block.o, block.gate_up, block.down):
            w.mul_(0.5)
    two = lambda site: candidate_configs(lower_program(site.program, Options.make(torch.bfloat16, site.layout)).graph)[:2]  # noqa: E731
    rec = block.tune(1, 512, iters=1, rounds=2, confirm_rounds=2, candidates=two, cache_dir=tmp_path, verbose=False)
    sites = {"qkv", "o", "gate_up", "down.last", "down.dgrad", "gate_up.dgrad", "qkv.dgrad"}
    assert set(rec["timings"]) == set(rec["confirm"]) == sites
    assert all(v["verdict"].startswith(("kept", "replaced")) for v in rec["confirm"].values())
    runner = block.get_runner()
    stored = load_plan(block.context(), torch.bfloat16, 512, cache_dir=tmp_path, nearest=False)
    assert stored is not None and {s: c.to_json() for s, c in stored.items()} == rec["sites"]
    assert {s: runner.plan[s].to_json() for s in sites} == {s: rec["sites"][s] for s in sites}
    fwd = block.tune(1, 512, forward_only=True, iters=1, rounds=2, confirm_rounds=2, candidates=two,
                     cache_dir=tmp_path, verbose=False)
    infer = {"qkv.infer", "o.infer", "gate_up.infer", "down.last.infer"}
    assert set(fwd["timings"]) == set(fwd["confirm"]) == infer         # the forward's own sites only
    assert {s: fwd["sites"][s] for s in sites} == rec["sites"]          # the training choices stay
    assert {s: runner.plan[s].to_json() for s in infer} == {s: fwd["sites"][s] for s in infer}
    x = torch.randn(1, 512, 1024, device="cuda", dtype=torch.bfloat16)
    w = standard_weights(block)
    ref32 = standard_block(x.float(), {k: v.float() for k, v in w.items()}, block.dims, block.inv_freq)
    eager = standard_block(x, w, block.dims, block.inv_freq)
    with torch.no_grad():
        assert_within_twice_eager("y", block(x), eager, ref32)
