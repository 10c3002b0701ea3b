"""Random epilogue programs for differential fuzzing (issue 5), from a seed.

A generated program is a list of steps; from it we build both the epilogue function (traced by
coda-cutlass) and a direct torch function doing the same math, so the interpreter can be checked
against plain torch on the CPU and the kernels against the interpreter on the GPU.

Values stay in a numerically tame range (safe wrappers around log/sqrt/div/pow/exp), and comparisons
only look at operand values (exact in every precision), so a rounding difference can never flip a
branch: any mismatch is a real bug.

`invalid_program(seed)` makes programs that must be refused, each with the words the error must
contain.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

import coda_cutlass as cc

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}

UNARY = {
    "neg": (lambda x: -x, lambda x: -x),
    "abs": (lambda x: abs(x), torch.abs),
    "tanh": (cc.tanh, torch.tanh),
    "sigmoid": (cc.sigmoid, torch.sigmoid),
    "silu": (cc.silu, F.silu),
    "gelu": (cc.gelu, F.gelu),
    "gelu_tanh": (lambda x: cc.gelu(x, approximate="tanh"), lambda x: F.gelu(x, approximate="tanh")),
    "relu": (cc.relu, torch.relu),
    "square": (cc.square, torch.square),
    "exp_tame": (lambda x: cc.exp(cc.tanh(x)), lambda x: torch.exp(torch.tanh(x))),
    "log_safe": (lambda x: cc.log(abs(x) + 1.0), lambda x: torch.log(x.abs() + 1.0)),
    "sqrt_safe": (lambda x: cc.sqrt(abs(x) + 0.25), lambda x: torch.sqrt(x.abs() + 0.25)),
    "rsqrt_safe": (lambda x: cc.rsqrt(abs(x) + 1.0), lambda x: torch.rsqrt(x.abs() + 1.0)),
    "recip_safe": (lambda x: cc.reciprocal(abs(x) + 1.0), lambda x: torch.reciprocal(x.abs() + 1.0)),
    "pow_safe": (lambda x: (abs(x) + 0.5) ** 1.5, lambda x: (x.abs() + 0.5) ** 1.5),
    "cast_bf16": (lambda x: cc.cast(x, torch.bfloat16), lambda x: x.to(torch.bfloat16).float()),
    "cast_f16": (lambda x: cc.cast(x, torch.float16), lambda x: x.to(torch.float16).float()),
}
BINARY = {
    "add": (lambda a, b: a + b, torch.add),
    "sub": (lambda a, b: a - b, torch.sub),
    "mul": (lambda a, b: a * b, torch.mul),
    "div_safe": (lambda a, b: a / (abs(b) + 1.0), lambda a, b: a / (b.abs() + 1.0)),
    "maximum": (cc.maximum, torch.maximum),
    "minimum": (cc.minimum, torch.minimum),
}
COMPARE = {
    "lt": (lambda a, b: a < b, torch.lt), "le": (lambda a, b: a <= b, torch.le),
    "gt": (lambda a, b: a > b, torch.gt), "ge": (lambda a, b: a >= b, torch.ge),
    "eq": (lambda a, b: a == b, torch.eq), "ne": (lambda a, b: a != b, torch.ne),
}
REDUCE = {
    "row_sum": (cc.row_sum, lambda x: x.sum(1)), "row_max": (cc.row_max, lambda x: x.amax(1)),
    "row_min": (cc.row_min, lambda x: x.amin(1)), "col_sum": (cc.col_sum, lambda x: x.sum(0)),
    "col_max": (cc.col_max, lambda x: x.amax(0)), "col_min": (cc.col_min, lambda x: x.amin(0)),
    "total_sum": (cc.total_sum, lambda x: x.sum()),
}


@dataclass
class Generated:
    seed: int
    program: Any
    torch_fn: Callable[..., dict[str, torch.Tensor]]    # (acc fp32, **operands fp32) -> outputs
    operands: dict[str, tuple[str, str]]                # name -> (kind, dtype name)
    options: dict[str, Any] = field(default_factory=dict)
    text: str = ""

    def make_inputs(self, M: int, N: int, K: int, device: str, seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        dt = self.options.get("dtype", torch.bfloat16)
        A = (torch.randn(M, K, generator=g) * 0.5).to(device=device, dtype=dt)
        wshape = (N, K) if self.options.get("weight_layout", "nk") == "nk" else (K, N)
        W = (torch.randn(*wshape, generator=g) / math.sqrt(K)).to(device=device, dtype=dt)
        ops: dict[str, Any] = {}
        for name, (kind, dname) in self.operands.items():
            dtype = DTYPES[dname]
            if kind == "scalar":
                ops[name] = float(torch.rand((), generator=g) + 0.5)
            elif kind == "mask":
                ops[name] = torch.randint(0, 3, (M, N), generator=g).to(device=device, dtype=dtype)
            else:
                shape = {"tile": (M, N), "row": (M,), "col": (N,)}[kind]
                ops[name] = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        return A, W, ops


def random_program(seed: int) -> Generated:
    rng = random.Random(seed)
    operands: dict[str, tuple[str, str]] = {}
    for kind, lo, hi in (("tile", 0, 2), ("row", 0, 2), ("col", 0, 2), ("scalar", 0, 1), ("mask", 0, 1)):
        for i in range(rng.randint(lo, hi)):
            dname = rng.choice(["bf16", "bf16", "f32"]) if kind not in ("scalar",) else "f32"
            operands[f"{kind}{i}"] = (kind, dname)
    steps: list[tuple] = []   # (op_kind, op_name, input indices)
    n_leaves = 1 + len(operands)
    n_ops = rng.randint(2, 10)
    loads = list(range(1, n_leaves))
    for _ in range(n_ops):
        avail = n_leaves + len(steps)
        r = rng.random()
        pick = lambda: rng.randrange(avail)   # noqa: E731
        if r < 0.45:
            steps.append(("unary", rng.choice(list(UNARY)), (pick(),)))
        elif r < 0.85:
            steps.append(("binary", rng.choice(list(BINARY)), (pick(), pick())))
        elif r < 0.92:
            steps.append(("const", rng.choice(["add", "mul"]), (pick(),), rng.choice([0.5, -1.25, 2.0, 3.0])))
        elif loads:
            a, b = rng.choice(loads), rng.choice(loads + [-1])
            steps.append(("where", rng.choice(list(COMPARE)), (a, b, pick(), pick())))
        else:
            steps.append(("unary", "tanh", (pick(),)))
    total = n_leaves + len(steps)
    # outputs: D (usually) + named tiles + reductions, maybe one accumulated output
    outputs: list[tuple] = []
    if rng.random() < 0.85:
        outputs.append(("D", "store", total - 1, rng.choice(["bf16", "bf16", "f32"])))
    for i in range(rng.randint(0, 2)):
        outputs.append((f"t{i}", "store", rng.randrange(total), rng.choice(["bf16", "f16", "f32"])))
    for i in range(rng.randint(0, 2) if outputs else rng.randint(1, 2)):
        outputs.append((f"r{i}", rng.choice(list(REDUCE)), rng.randrange(total), "f32"))
    if rng.random() < 0.2:
        outputs.append(("acc0", "accumulate", rng.randrange(total), "bf16"))
    weight_layout = "kn" if rng.random() < 0.2 else "nk"
    dtype = torch.float16 if rng.random() < 0.15 else torch.bfloat16
    if dtype == torch.float16:
        operands = {k: (kind, "f16" if d == "bf16" else d) for k, (kind, d) in operands.items()}
        outputs = [(n, w, i, "f16" if d == "bf16" else d) for n, w, i, d in outputs]

    names = list(operands)

    def evaluate(values: list, lib: str) -> list:
        sel = 0 if lib == "cc" else 1
        for st in steps:
            kind, op = st[0], st[1]
            if kind == "unary":
                values.append(UNARY[op][sel](values[st[2][0]]))
            elif kind == "binary":
                values.append(BINARY[op][sel](values[st[2][0]], values[st[2][1]]))
            elif kind == "const":
                x = values[st[2][0]]
                values.append(x + st[3] if op == "add" else x * st[3])
            else:
                a, b, c, d = st[2]
                lhs, rhs = values[a], (values[b] if b >= 0 else 0.0)
                if lib == "cc":
                    values.append(cc.where(COMPARE[op][0](lhs, rhs), values[c], values[d]))
                else:
                    rhs_t = rhs if isinstance(rhs, torch.Tensor) else torch.tensor(rhs)
                    values.append(torch.where(COMPARE[op][1](lhs, rhs_t), values[c], values[d]))
        return values

    def body(acc: Any, **ops: Any) -> dict[str, Any]:
        values = evaluate([acc] + [ops[n] for n in names], "cc")
        out: dict[str, Any] = {}
        for name, what, idx, _ in outputs:
            v = values[idx]
            if what == "store":
                out[name] = v
            elif what == "accumulate":
                out[name] = cc.accumulate(v)
            else:
                out[name] = REDUCE[what][0](v)
        return out

    def torch_fn(acc: torch.Tensor, **ops: Any) -> dict[str, torch.Tensor]:
        M, N = acc.shape
        shaped = []
        for n in names:
            kind = operands[n][0]
            v = ops[n]
            if kind == "row":
                v = v[:, None]
            shaped.append(torch.tensor(v) if kind == "scalar" else v)
        values = evaluate([acc] + shaped, "torch")
        out = {}
        for name, what, idx, _ in outputs:
            v = values[idx].expand(M, N)
            if what == "store":
                out[name] = v
            elif what == "accumulate":
                out[name] = ops[name] + v
            else:
                out[name] = REDUCE[what][1](v)
        return out

    # the epilogue function's signature: acc plus annotated operands
    spec = {"tile": cc.Tile, "mask": cc.Tile, "row": cc.PerRow, "col": cc.PerCol, "scalar": cc.Scalar}
    params = ", ".join(["acc"] + names)
    fn = eval(f"lambda {params}: body(acc, {', '.join(f'{n}={n}' for n in names)})", {"body": body})  # noqa: S307
    fn.__annotations__ = {n: spec[operands[n][0]] for n in names}
    prog = cc.epilogue(fn, name=f"fuzz_{seed}")
    options: dict[str, Any] = {"dtype": dtype, "weight_layout": weight_layout,
                               "input_dtypes": {n: DTYPES[d] for n, (k, d) in operands.items() if k != "scalar"},
                               "output_dtypes": {n: DTYPES[d] for n, w, _, d in outputs if w in ("store",)}}
    acc_out = [n for n, w, _, _ in outputs if w == "accumulate"]
    if acc_out:
        operands[acc_out[0]] = ("tile", "f16" if dtype == torch.float16 else "bf16")
    text = f"seed {seed}: operands {operands}, steps {steps}, outputs {outputs}, layout {weight_layout}, {dtype}"
    return Generated(seed, prog, torch_fn, operands, options, text)


# ---------------------------------------------------------------------------------------------- invalid
def invalid_program(seed: int) -> tuple[str, Callable[[], Any], tuple[type, ...], str]:
    """(description, thunk that compiles/traces it, exception types, words the message must contain)."""
    rng = random.Random(seed)
    base = random_program(seed)
    kinds = [
        ("reduction used later", lambda acc, t: acc * cc.row_sum(acc + t), "cannot be used later"),
        ("python if on a value", lambda acc, t: acc if acc > t else t, "cc.where"),
        ("math module on a value", lambda acc, t: math.exp(acc), "cc.exp"),
        ("floor division", lambda acc, t: acc // t, "operator // is not supported"),
        ("matmul operator", lambda acc, t: acc @ t, "operator @ is not supported"),
        ("modulo", lambda acc, t: acc % 2.0, "operator % is not supported"),
        ("unsupported torch function", lambda acc, t: torch.erf(acc), "not supported on traced"),
        ("indexing", lambda acc, t: acc[0], "indexing is not supported"),
        ("traced exponent", lambda acc, t: acc ** t, "exponent must be a Python number"),
        ("cast to an integer dtype", lambda acc, t: cc.cast(acc, torch.int8), "not supported"),
        ("tuple return", lambda acc, t: (acc, t), "must return a dict"),
        ("empty dict", lambda acc, t: {}, "no outputs"),
        ("non-identifier output", lambda acc, t: {"a b": acc}, "Python identifier"),
        ("output named like an operand", lambda acc, t: {"t": acc}, "same name as an operand"),
        ("bare reduction", lambda acc, t: cc.row_max(acc), "bare reduction"),
        ("accumulate of a reduction", lambda acc, t: {"x": cc.accumulate(cc.col_sum(acc))}, "elementwise value"),
        ("captured tensor", lambda acc, t: acc + torch.ones(3), "captured"),
        ("iteration", lambda acc, t: sum(acc), "iterated"),
        ("reduction of a reduction", lambda acc, t: {"s": cc.row_sum(cc.row_sum(acc))}, "cannot be used later"),
        ("string operand", lambda acc, t: acc + "x", "cannot use a str"),
    ]
    desc, body, words = kinds[rng.randrange(len(kinds))]
    fn = eval("lambda acc, t: body(acc, t)", {"body": body})  # noqa: S307
    fn.__annotations__ = {"t": rng.choice([cc.Tile, cc.PerRow, cc.PerCol])}
    prog = cc.epilogue(fn, name=f"invalid_{seed}")
    del base
    return desc, (lambda: cc.emit(prog)), (cc.EpilogueError, cc.ConfigError), words


def prebuild_items(n: int, start: int = 0) -> list[tuple[Any, dict[str, Any]]]:
    return [(g.program, g.options) for g in (random_program(s) for s in range(start, start + n))]


# What `python -m coda_cutlass prebuild tests/fuzzgen.py` builds: the programs gpu/fuzz_gpu.py runs.
PREBUILD = prebuild_items(200)
