"""``@cc.epilogue`` and tracing: run the user's function on symbolic values and record the IR.

The first parameter is the GEMM accumulator. Every other parameter is an operand, annotated with
``cc.Tile``, ``cc.PerRow``, ``cc.PerCol`` or ``cc.Scalar``; a parameter annotated ``float``/``int``
(or left unannotated with a numeric default) is a compile-time constant, overridable with
``compile_epilogue(..., constants={...})``; an int one is passed as a Python int (``range(n)``).

The function returns a dict of named outputs (or a single value, meaning ``{"D": value}``):
elementwise values become M x N tile outputs, ``cc.row_sum(...)`` and friends become reductions,
and ``cc.accumulate(v)`` makes the output an in/out tensor updated ``out += v``.
"""

from __future__ import annotations

import functools
import inspect
import keyword
import numbers
from dataclasses import replace
from typing import Any, Callable, Mapping

import torch

from ..errors import CallError, EpilogueError
from ..ir.nodes import Kind, Operand, Program, make_attrs, renumber
from .operands import OperandSpec, resolve_spec
from .values import Accumulate, HalfWidth, Quantized, ReductionResult, Tracer, Value, apply

_MISSING = inspect.Parameter.empty
# Names an operand (or accumulated output, passed by name) cannot have: the GEMM inputs, and the
# keyword options of the kernel call k(A, W, raster=, swizzle=, out=, ...) and of
# cc.reference(program, A, W, dtype=, weight_layout=, precision=, ...). (self, program and X are
# positional-only in those calls, so operands may have those names.)
CALL_KEYWORDS = frozenset({"raster", "swizzle", "out"})
REFERENCE_KEYWORDS = frozenset({"dtype", "weight_layout", "precision", "input_dtypes", "output_dtypes",
                                "constants", "scaling"})
MAP_REFERENCE_KEYWORDS = frozenset({"partial_reductions"})   # cc.map_reference's own, beyond the above
SCALE_KEYWORDS = frozenset({"scale_a", "scale_b"})     # an FP8 GEMM's scales (coda_cutlass/fp8)
RESERVED_NAMES = (frozenset({"A", "W"}) | CALL_KEYWORDS | REFERENCE_KEYWORDS | MAP_REFERENCE_KEYWORDS
                  | SCALE_KEYWORDS)


def _reserved(name: str) -> str:
    """Why an operand name is reserved (for errors)."""
    if name in REFERENCE_KEYWORDS:
        why = f"a keyword option of cc.reference(program, A, W, {name}=..., **operands)"
    elif name in MAP_REFERENCE_KEYWORDS:
        why = f"a keyword option of cc.map_reference(program, X, {name}=..., **operands)"
    elif name in SCALE_KEYWORDS:
        why = "the scales of an FP8 kernel call k(A, W, scale_a=..., scale_b=..., **operands)"
    else:
        why = "taken by the kernel call k(A, W, raster=..., swizzle=..., out=..., **operands)"
    return f"'{name}' is reserved ({why}; reserved names: {', '.join(sorted(RESERVED_NAMES))})"


class EpilogueProgram:
    """A traced-on-demand epilogue program; see ``cc.epilogue``."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None):
        if isinstance(fn, EpilogueProgram):      # cc.epilogue(name=...)(program): the same function renamed
            name, fn = name or fn.name, fn.fn
        if not callable(fn):
            raise EpilogueError(f"an epilogue program must be a function, got {type(fn).__name__}")
        if inspect.isclass(fn) or isinstance(fn, torch.nn.Module):
            # a class is callable (it constructs) and so is a module (its forward on tensors): tracing
            # either fails later with a message about its signature or its return value
            what = f"the class {fn.__qualname__}" if inspect.isclass(fn) else f"the torch.nn.Module {fn!r:.60}"
            raise EpilogueError(f"an epilogue program must be a function of acc, got {what}: pass a function "
                                "that computes the outputs with cc.* ops, e.g. lambda acc: cc.relu(acc)")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise EpilogueError(f"cc.epilogue(name=...): the name must be a non-empty string, got {name!r}")
        self.fn = fn
        self.name = name or _callable_name(fn)
        self.source = _source_location(fn)
        self.specs, self.constants = _parse_signature(fn, self.name)
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def trace(self, constants: Mapping[str, float] | None = None) -> Program:
        return trace(self, constants)

    @property
    def ir(self) -> Program:
        return self.trace()

    def __repr__(self) -> str:
        return f"<cc.epilogue {self.name} from {self.source}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"epilogue program '{self.name}' is not called directly: compile it with "
            "cc.compile_epilogue(program) and call the kernel, or run cc.reference(program, A, W, ...)")


def epilogue(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Decorator turning ``def f(acc, x: cc.Tile, ...)`` into an epilogue program."""
    if fn is None:
        return lambda f: EpilogueProgram(f, name)
    return EpilogueProgram(fn, name)


def as_program(program: Any) -> EpilogueProgram:
    if isinstance(program, EpilogueProgram):
        return program
    if callable(program):
        return EpilogueProgram(program)
    raise EpilogueError(f"expected an epilogue program (a function decorated with @cc.epilogue), "
                        f"got {type(program).__name__}")


def check_option_values(call: str, program: Any, constants: Any, options: Mapping[str, Any]) -> None:
    """A keyword option of ``call`` (cc.reference, cc.map_reference) given a tensor: most likely an
    accumulated output named like the option (they are passed by name), which the program's
    reserved-name check names when it is traced; else an error naming the option, not one that
    prints the tensor."""
    given = [k for k, v in options.items() if isinstance(v, torch.Tensor)]
    if not given:
        return
    prog = as_program(program)
    prog.trace(constants if isinstance(constants, Mapping) else None)
    raise CallError(f"{call}: {given[0]}= was given a torch.Tensor, but '{given[0]}' is a keyword option of "
                    f"{call}, not an operand of '{prog.name}'")


def _unpartial(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The callable behind ``functools.partial`` layers."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _innermost(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function that holds the annotations and code: behind partials, a callable object's
    ``__call__``."""
    fn = _unpartial(fn)
    if not inspect.isroutine(fn) and not inspect.isclass(fn):
        fn = getattr(type(fn), "__call__", fn)
    return fn


def _callable_name(fn: Callable[..., Any]) -> str:
    fn = _unpartial(fn)
    return getattr(fn, "__name__", None) or type(fn).__name__


def _source_location(fn: Callable[..., Any]) -> str:
    code = getattr(_innermost(fn), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else "?"


def constant_value(value: Any, what: str, program: str | None = None, integer: bool = False) -> float | int:
    """A constant's value as the program is traced with it: a float, or with ``integer`` (an int
    constant) a Python int, so that it works where Python wants an int (range(n), a segment
    width); a clear error for anything else (strings, None, a number too large for a float, a
    fraction for an int constant). Arithmetic with traced values turns either into an fp32 constant."""
    if isinstance(value, (str, bytes, bool)) or not isinstance(value, numbers.Real):
        raise EpilogueError(f"{what}={value!r}: a constant must be a real number (int or float), "
                            f"got {type(value).__name__}", program=program)
    try:
        f = float(value)     # an int constant too: it becomes an fp32 constant where a traced value uses it
    except OverflowError:
        raise EpilogueError(f"{what}: {type(value).__name__} {_short(value)} is too large for a float "
                            "(write float('inf') for infinity)", program=program) from None
    if not integer:
        return f
    if isinstance(value, numbers.Integral):
        return int(value)
    if not f.is_integer():
        raise EpilogueError(f"{what}={value!r}: the constant is an int (annotated int, or an int default), "
                            "so its value must be a whole number", program=program)
    return int(f)    # e.g. 64.0: Options keeps constants as floats (they are part of its hashes)


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:10]}...{text[-6:]} ({len(text)} digits)"


def _parse_signature(fn: Callable[..., Any], name: str
                     ) -> tuple[dict[str, OperandSpec], dict[str, float | int]]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise EpilogueError(f"cannot read the signature: {e}", program=name) from None
    try:    # a functools.partial or callable object: the annotations of the function behind it
        annotations = inspect.get_annotations(_innermost(fn), eval_str=True)
    except Exception as e:  # noqa: BLE001 - any failure to evaluate string annotations
        raise EpilogueError(f"cannot evaluate the parameter annotations: {e}", program=name) from None
    params = list(sig.parameters.values())
    if not params or params[0].kind in (params[0].KEYWORD_ONLY, params[0].VAR_KEYWORD):
        raise EpilogueError("the first parameter must be the accumulator, positional, e.g. def f(acc, ...)",
                            program=name)
    specs: dict[str, OperandSpec] = {}
    constants: dict[str, float | int] = {}
    for i, p in enumerate(params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise EpilogueError(f"parameter '{p.name}': *args and **kwargs are not supported", program=name)
        if i == 0:
            continue
        if p.name in RESERVED_NAMES:
            raise EpilogueError(f"parameter '{p.name}': {_reserved(p.name)}; rename it", program=name)
        ann = annotations.get(p.name, _MISSING)
        spec = resolve_spec(ann)
        if spec is not None:
            if p.default is not p.empty:    # a default, or a value bound by functools.partial: never used
                raise EpilogueError(
                    f"operand '{p.name}' has a default value ({p.default!r}): operands are passed at every call "
                    "(the default would be ignored); drop it, or make the parameter a constant (a float default "
                    "without a cc.* annotation, overridable with constants={...})", program=name)
            specs[p.name] = spec
            continue
        is_number_default = isinstance(p.default, numbers.Real) and not isinstance(p.default, bool)
        if ann in (float, int) or (ann is _MISSING and is_number_default):
            if not is_number_default:
                raise EpilogueError(f"constant parameter '{p.name}' needs a numeric default value", program=name)
            # int-annotated, or unannotated with an int default: an int (range(n), segment widths)
            integer = ann is int or (ann is _MISSING and isinstance(p.default, numbers.Integral))
            constants[p.name] = constant_value(p.default, f"constant parameter '{p.name}'", name, integer)
            continue
        raise EpilogueError(
            f"parameter '{p.name}' needs an operand annotation: cc.Tile (M x N), cc.PerRow (M), "
            f"cc.PerCol (N) or cc.Scalar (a runtime number); or a float default for a constant"
            + ("" if ann is _MISSING else f" (got {ann!r})"), program=name)
    return specs, constants


def trace(program: EpilogueProgram, constants: Mapping[str, float] | None = None) -> Program:
    """Run the program's function on symbolic values and return the (untyped) IR."""
    consts = dict(program.constants)
    for k, v in (constants or {}).items():
        if k not in consts:
            raise EpilogueError(f"constants: '{k}' is not a constant parameter (constant parameters: "
                                f"{', '.join(consts) or 'none'})", program=program.name)
        consts[k] = constant_value(v, f"constants['{k}']", program.name, integer=type(consts[k]) is int)

    tracer = Tracer(program.name)
    acc = Value(tracer, tracer.emit("acc", (), Kind.TILE))
    operands: list[Operand] = []
    kwargs: dict[str, Any] = {}
    for pname, spec in program.specs.items():
        operands.append(Operand(pname, spec.kind, spec.dtype, packed=spec.packed, device=spec.device))
        op = "scalar" if spec.kind == Kind.SCALAR and not spec.device else "load"
        attrs = {"packed": True} if spec.packed else {}
        kwargs[pname] = Value(tracer, tracer.emit(op, (), spec.kind, operand=pname, **attrs))
    kwargs.update(consts)

    # Positional parameters positionally (they may be positional-only), keyword-only ones by name
    # (e.g. those after a functools.partial's keyword).
    params = list(inspect.signature(program.fn).parameters.values())[1:]
    positional = [kwargs[p.name] for p in params if p.kind != p.KEYWORD_ONLY]
    by_name = {p.name: kwargs[p.name] for p in params if p.kind == p.KEYWORD_ONLY}
    with tracer:    # cc.* functions without a traced argument (cc.col_index()) find the trace here
        try:
            result = program.fn(acc, *positional, **by_name)
        except EpilogueError as e:
            if e.program is None:    # raised by a cc.* function that had no trace to name
                # keep its traceback: the program's line that called it (the CLI prints it)
                raise EpilogueError(e.reason, program=program.name, node=e.node).with_traceback(
                    e.__traceback__) from None
            raise
        outputs = _record_outputs(tracer, program, result, operands)

    nodes = [n for n in tracer.nodes if not (n.op == "reduce" and not n.attr("name"))]
    # the constants' values ride along (not in the IR: they are baked into its nodes) so that a call
    # passing one as an operand is told it is a compile-time constant, not just an unknown name
    prog = Program(name=program.name, operands=tuple(operands), nodes=renumber(nodes),
                   outputs=tuple(outputs), source=program.source, meta={"constants": consts})
    return prog


def _record_outputs(tracer: Tracer, program: EpilogueProgram, result: Any, operands: list[Operand]) -> list[str]:
    """Record the returned outputs as sinks; returns their names in order."""
    if isinstance(result, (Value, Accumulate, HalfWidth, Quantized)):
        result = {"D": result}
    if isinstance(result, ReductionResult):
        raise tracer.error("a bare reduction was returned; name it: return {'name': cc.row_sum(...)}")
    if not isinstance(result, dict):
        raise tracer.error(f"the program must return a dict of named outputs (or one value for 'D'), "
                           f"got {type(result).__name__}")
    if not result:
        raise tracer.error("the program returned no outputs")

    outputs: list[str] = []
    names_used = set(program.specs)
    for name, value in result.items():
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise tracer.error(f"output name {name!r} must be a Python identifier")
        if name in RESERVED_NAMES and isinstance(value, Accumulate):
            raise tracer.error(f"accumulated output '{name}' is passed to the kernel call k(A, W, ...) by name, "
                               f"but {_reserved(name)}; rename it")
        if name in names_used:
            raise tracer.error(f"output '{name}' has the same name as an operand; pick another name "
                               "(accumulated outputs are passed by their output name)")
        outputs.append(name)
        if isinstance(value, Quantized):
            scale_name = _record_quantized(tracer, name, value)
            if scale_name and (scale_name in names_used or scale_name in result):
                raise tracer.error(f"output '{name}' is quantised in blocks, which adds the output '{scale_name}' "
                                   f"(its scales), but an {'operand' if scale_name in names_used else 'output'} "
                                   "already has that name; rename one")
            if scale_name:
                outputs.append(scale_name)
            continue
        _record_output(tracer, name, value, operands)
    return outputs


def _record_quantized(tracer: Tracer, name: str, q: Quantized) -> str | None:
    """An FP8 output: per tensor, the store of value * (1 / scale); blockwise, a quantising store and
    the sink of its scales (output ``name_scale``, returned). Stores round with saturation."""
    value, half = (q.value.value, True) if isinstance(q.value, HalfWidth) else (q.value, False)
    layout = ("half_t" if half else "t") if q.transpose else ("half" if half else "tile")
    v = _output_value(tracer, name, value)
    if q.block is None:
        s = tracer.lift(q.scale, f"output '{name}': the scale")
        v = apply("mul", v, apply("reciprocal", s))
        tracer.emit("store", (v.id,), Kind.TILE, name=name, accumulate=False, layout=layout, qdtype=q.dtype.name)
        return None
    scale_name = f"{name}_scale"
    grouped = {"group": q.group} if q.group != 1 else {}   # ungrouped IR (and cache keys) as before
    tracer.emit("store", (v.id,), Kind.TILE, name=name, accumulate=False, layout=layout, qdtype=q.dtype.name,
                quant="block", block=q.block, pow2=q.pow2, **grouped)
    tracer.emit("block_scale", (v.id,), Kind.TILE, name=scale_name, of=name, layout=layout, qdtype=q.dtype.name,
                block=q.block, pow2=q.pow2, **grouped)
    return scale_name


def _output_value(tracer: Tracer, name: str, value: Any) -> Value:
    """The traced value an output stores. A Python number is refused, not broadcast to a tile: a
    constant output is almost always a slip (a constant parameter or literal returned by mistake)."""
    if isinstance(value, numbers.Number):
        raise tracer.error(f"output '{name}' is the constant {value!r}: an output must be a traced value, computed "
                           f"from acc or the operands (for a constant tile, write acc * 0 + {value!r})")
    return tracer.lift(value, f"output '{name}'")


def _record_output(tracer: Tracer, name: str, value: Any, operands: list[Operand]) -> None:
    if isinstance(value, ReductionResult):
        if value.tracer is not tracer:
            raise tracer.error(f"output '{name}': a reduction from another trace")
        node = tracer.nodes[value.id]
        if node.attr("name"):   # the same reduction returned twice: record a second sink
            attrs = dict(node.attrs)
            attrs["name"] = name
            tracer.emit("reduce", node.inputs, node.kind, **attrs)
        else:
            attrs = dict(node.attrs)
            attrs["name"] = name
            tracer.nodes[value.id] = replace(node, attrs=make_attrs(**attrs))
        return
    accumulate = isinstance(value, Accumulate)
    layout = "tile"
    if isinstance(value, HalfWidth):
        layout = "half"
        value = value.value
    if accumulate:
        target = Value(tracer, tracer.emit("load", (), Kind.TILE, operand=name))
        operands.append(Operand(name, Kind.TILE, None))
        value = apply("add", target, value.value)
    if isinstance(value, Value) and tracer.nodes[value.id].op == "pack":
        if layout == "half" or accumulate:
            raise tracer.error(f"output '{name}': a cc.pack(...) value is stored as it is (M x 2N); "
                               "it cannot be half width or accumulated")
        layout = "packed"
    if isinstance(value, Value) and tracer.nodes[value.id].op == "load" and tracer.nodes[value.id].attr("packed"):
        raise tracer.error(f"output '{name}': a cc.PairTile operand cannot be stored directly; "
                           "unpack it, or store cc.pack(a, b)")
    v = _output_value(tracer, name, value)
    attrs = {"layout": layout} if layout != "tile" else {}
    tracer.emit("store", (v.id,), Kind.TILE, name=name, accumulate=accumulate, **attrs)


__all__ = ["EpilogueProgram", "epilogue", "trace", "as_program", "check_option_values", "constant_value",
           "RESERVED_NAMES"]
