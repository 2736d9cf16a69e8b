"""Finding a transformers model's pre-norm decoder layers and running them as connections.

A pre-norm decoder layer (Llama, Mistral, Qwen2, Qwen3, GPT-2, ...) computes

    h = h + attn(norm1(h), **kwargs)
    h = h + mlp(norm2(h))

Each of the two sublayers is a branch F of a torch-mhc connection, so that the converted layer
computes, on streams x [B, T, n, C],

    x = conn_attn(x, **kwargs)     # branch: h -> attn(norm1(h), **kwargs)[0]
    x = conn_mlp(x)                # branch: h -> mlp(norm2(h))   ([0] if the MLP returns a tuple)

The layers are recognised by what their `forward` does, not by a list of class names, in two
steps on its source:

1. it calls exactly four of the layer's submodules, in the order norm, attention, norm, MLP (a
   GPT-2 block's cross-attention counts only when the block has one);
2. followed on symbolic values, every path through it returns exactly
   h + mlp(norm2(h)) with h = x + attn(norm1(x)), x its input: each residual update is a plain
   `residual + <sublayer output>` and nothing else touches the residual path.

Anything else (sandwich norms, dropout or scaling on the residual path, a residual taken after
the norm, parallel attention and MLP, a sublayer that is handed the residual, a layer that
returns a tuple) is refused, because the connection would replace a different function. A
refusal is a ConversionError whose message is one line, the structural reason and the file:line
of the forward read, with what was expected and found in its `details`.
The spec is read from every layer, since the layers of one model may hold different sublayers
(Qwen3-Next: linear attention in some layers, full attention in others) or be of different
classes (Jamba: Mamba layers and attention layers).

A converted layer keeps its class as a base: it becomes an instance of a subclass whose
`forward` runs the connections, so `isinstance` checks (output recording, gradient
checkpointing, which transformers attaches per class) keep working.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from dataclasses import dataclass

import torch
from torch import nn

from torch_mhc.connections import expand_streams, reduce_streams

__all__ = ["LayerSpec", "LayerBranch", "branches", "find_decoder_layers", "converted_class",
           "ConversionError"]


class ConversionError(TypeError):
    """The model (or one of its layers) does not have the structure convert() handles.

    The message is one line: the structural reason and, for a layer, the file:line of the
    forward that was read. `details` says what was expected and what was found (the
    submodules called, the source line, what the layer returns)."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


@dataclass(frozen=True)
class LayerSpec:
    """The attribute names of one layer's four sublayers, in call order."""

    norm1: str
    attn: str
    norm2: str
    mlp: str
    arg_names: tuple[str, ...]  # forward's parameters after hidden_states, for positional args


_EXPECTED = (
    "a causal LM whose base model holds an nn.ModuleList of pre-norm decoder layers, each "
    "layer's forward calling exactly norm -> attention -> norm -> MLP "
    "(h = h + attn(norm(h)); h = h + mlp(norm(h)), like LlamaDecoderLayer or GPT2Block)"
)
_PLAIN_UPDATE = (
    "expected each residual update to be exactly `residual + <sublayer output>`, "
    "h = x + attn(norm1(x)); return h + mlp(norm2(h)), with nothing else on the residual path"
)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(module).__name__.lower()


# ------------------------------------------------------------------------------------------
# Reading forward's source


@dataclass(frozen=True)
class _Forward:
    """A layer class's forward, parsed, with what error messages need to point at a line."""

    cls: str
    node: ast.FunctionDef
    lines: tuple[str, ...]
    first_line: int  # the file's line number of lines[0]
    file: str

    @property
    def input_name(self) -> str:
        args = [*self.node.args.posonlyargs, *self.node.args.args]
        return args[1].arg if len(args) > 1 else ""

    def where(self, lineno: int) -> str:
        """"Cls.forward (file.py line N: `source`)" for a line of the parsed source."""
        line = self.lines[lineno - 1].strip()
        return f"{self.cls}.forward ({self.file} line {self.first_line + lineno - 1}: `{line}`)"

    def refuse(self, reason: str, lineno: int | None, details: str) -> ConversionError:
        """The refusal of this layer: "reason (Cls.forward, file.py:N)", N the file's line of
        lineno in the parsed source (the def line when None)."""
        line = self.first_line + (lineno or self.node.lineno) - 1
        return ConversionError(f"{reason} ({self.cls}.forward, {self.file}:{line})", details)


_FORWARDS: dict[tuple, _Forward] = {}  # by class and function: forward may be replaced


def _forward_of(cls: type) -> _Forward:
    forward = inspect.unwrap(cls.forward)
    if (cls, forward) not in _FORWARDS:
        try:
            lines, first = inspect.getsourcelines(forward)
            source = textwrap.dedent("".join(lines))
            node = ast.parse(source).body[0]
        except (OSError, TypeError, SyntaxError) as e:
            raise ConversionError(
                f"cannot read the source of {cls.__name__}.forward: {e}"
            ) from None
        if not isinstance(node, ast.FunctionDef):
            raise ConversionError(
                f"{cls.__name__}.forward's source is not a def statement: "
                f"{type(node).__name__} at `{source.splitlines()[0].strip()}`"
            )
        file = os.path.basename(inspect.getsourcefile(forward) or "?")
        _FORWARDS[cls, forward] = _Forward(cls.__name__, node, tuple(source.splitlines()),
                                           first, file)
    return _FORWARDS[cls, forward]


def _self_attribute(func: ast.AST) -> str | None:
    """"name" when func is `self.name`."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
            and func.value.id == "self":
        return func.attr
    return None


def _called_submodules(layer: nn.Module, forward: _Forward) -> list[str]:
    """Names of the layer's child modules that forward calls as self.<name>(...), in the order
    the calls complete (so the norm in `self.attn(self.norm(h))` comes first)."""
    calls = []
    for node in ast.walk(forward.node):
        name = _self_attribute(node.func) if isinstance(node, ast.Call) else None
        if name and isinstance(getattr(layer, name, None), nn.Module):
            calls.append((node.end_lineno, node.end_col_offset, name))
    return [name for *_, name in sorted(calls)]


def layer_spec(layer: nn.Module) -> LayerSpec:
    """The sublayer names of a pre-norm decoder layer, or a ConversionError naming the
    structural reason it is not one and the line of forward that shows it."""
    forward = _forward_of(type(layer))
    path = _residual_path(layer, forward)
    calls = _called_submodules(layer, forward)
    called = (f"{forward.cls}.forward calls the submodules {calls}; expected exactly four: "
              "norm, attention, norm, MLP")
    problem = _structural_problem(layer, forward, path)
    if problem is not None:
        reason, line, details = problem
        raise forward.refuse(reason, line, f"{details}; {called}")
    reason = _call_order_problem(layer, calls)
    if reason is not None:
        raise forward.refuse(reason, None, called)
    norm1, attn, norm2, mlp = calls
    params = [p.name for p in inspect.signature(inspect.unwrap(type(layer).forward))
              .parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    spec = LayerSpec(norm1, attn, norm2, mlp, tuple(params[2:]))  # drop self, hidden_states
    _check_returns(forward, path, spec)
    return spec


def _call_order_problem(layer: nn.Module, calls: list[str]) -> str | None:
    """Why the submodules called are not norm, attention, norm, MLP, or None."""
    if len(calls) != 4:
        return f"forward calls {len(calls)} submodules; expected 4: norm, attention, norm, MLP"
    for role, name in (("first", calls[0]), ("third", calls[2])):
        if not _is_norm(getattr(layer, name)):
            return f"not pre-norm: the {role} submodule called, self.{name}, is not a norm"
    if len(set(calls)) != 4 or _is_norm(getattr(layer, calls[1])):
        return "expected the calls norm, attention, norm, MLP (four different submodules)"
    return None


# ------------------------------------------------------------------------------------------
# The residual path: what forward returns, as an expression of its input
#
# forward's statements are run on symbolic values. A value is one of
#   _INPUT               forward's hidden_states argument
#   _EXTERNAL            not computed from it (other arguments, constants, attributes)
#   ("call", name, v)    self.<name>(v, ...) for a submodule <name>
#   ("item0", v)         v[0], or the first name of a tuple unpacking of v
#   ("add", a, b)        a + b
#   ("other", line)      anything else computed from the hidden states (at that line)
# A variable holds a frozenset of values, one per path through the if statements before it.
# An if whose test reads only the layer's attributes (self.block_type == "linear_attention")
# takes the branch this layer takes; otherwise both are followed, except a path that calls a
# submodule the layer lacks (GPT-2's cross-attention): it would raise, so it never returns.

_INPUT, _EXTERNAL = ("input",), ("external",)
_UNKNOWN = object()
_SIMPLE = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Return)


class _Unreachable(Exception):
    """Raised on a path that calls a submodule the layer does not have."""


def _static_value(node: ast.AST, layer: nn.Module):
    """The value of an expression made of self.<attributes>, constants, comparisons and
    not/and/or, read from the layer; _UNKNOWN otherwise. self.training is never read: it
    changes after conversion."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Attribute):
        if _self_attribute(node) == "training":
            return _UNKNOWN
        base = layer if _self_attribute(node) is not None else _static_value(node.value, layer)
        try:
            return _UNKNOWN if base is _UNKNOWN else getattr(base, node.attr, _UNKNOWN)
        except Exception:  # a property that fails to compute: left unknown
            return _UNKNOWN
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        value = _static_bool(node.operand, layer)
        return value if value is _UNKNOWN else not value
    if isinstance(node, ast.BoolOp):
        values = [_static_bool(v, layer) for v in node.values]
        if _UNKNOWN in values:
            return _UNKNOWN
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        return _compare(node.ops[0], _static_value(node.left, layer),
                        _static_value(node.comparators[0], layer))
    return _UNKNOWN


_COMPARE = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
            ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}


def _compare(op: ast.cmpop, a, b):
    if a is _UNKNOWN or b is _UNKNOWN or type(op) not in _COMPARE:
        return _UNKNOWN
    try:
        return bool(_COMPARE[type(op)](a, b))
    except Exception:  # e.g. a tensor's ambiguous truth value: left to run both branches
        return _UNKNOWN


def _static_bool(node: ast.AST, layer: nn.Module):
    value = _static_value(node, layer)
    if value is _UNKNOWN:
        return _UNKNOWN
    try:
        return bool(value)
    except Exception:
        return _UNKNOWN


class _ResidualPath:
    """Runs one layer's forward on symbolic values (see above), collecting what it returns."""

    def __init__(self, layer: nn.Module, forward: _Forward):
        self.layer, self.forward = layer, forward
        self.returns: list[tuple[ast.Return, frozenset]] = []
        self.call_lines: dict[tuple, int] = {}  # ("call", ...) value -> the line of its call

    # statements: each run returns the variables after them, or None when every path returns

    def run(self, stmts: list[ast.stmt], env: dict) -> dict | None:
        for stmt in stmts:
            if isinstance(stmt, _SIMPLE) and self.calls_missing(stmt):
                raise _Unreachable
            if isinstance(stmt, ast.Return):
                value = self.eval(stmt.value, env) if stmt.value else frozenset({_EXTERNAL})
                self.returns.append((stmt, value))
                return None
            if isinstance(stmt, ast.Raise):
                return None
            if isinstance(stmt, ast.If):
                env = self.run_if(stmt, env)
            elif isinstance(stmt, ast.With):
                env = self.run(stmt.body, env)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                self.assign(stmt, env)
            elif not isinstance(stmt, (ast.Assert, ast.Pass)):  # these change no value
                self.spoil(stmt, env)
            if env is None:
                return None
        return env

    def run_if(self, stmt: ast.If, env: dict) -> dict | None:
        test = _static_bool(stmt.test, self.layer)
        if test is not _UNKNOWN:
            return self.run(stmt.body if test else stmt.orelse, env)
        paths = []
        for branch in (stmt.body, stmt.orelse):
            try:
                paths.append(self.run(branch, dict(env)))
            except _Unreachable:  # a path this layer cannot take
                pass
        paths = [p for p in paths if p is not None]
        if not paths:
            return None
        names = set().union(*paths)
        return {k: frozenset().union(*(p.get(k, frozenset()) for p in paths)) for k in names}

    def calls_missing(self, stmt: ast.stmt) -> bool:
        """Whether the statement calls self.<name>(...) for a name the layer lacks or holds
        None for (GPT-2's cross-attention when it has none): it would raise there."""
        return any(
            isinstance(n, ast.Call) and _self_attribute(n.func) is not None
            and getattr(self.layer, _self_attribute(n.func), None) is None
            for n in ast.walk(stmt)
        )

    def assign(self, stmt: ast.stmt, env: dict) -> None:
        if isinstance(stmt, ast.AugAssign):  # x += y is x = x + y for the values followed
            if not isinstance(stmt.target, ast.Name):
                return self.spoil(stmt, env)
            load = ast.copy_location(ast.Name(stmt.target.id, ast.Load()), stmt.target)
            expr = ast.copy_location(ast.BinOp(load, stmt.op, stmt.value), stmt)
            return self.bind(stmt.target, self.eval(expr, env), env)
        if stmt.value is None:  # an annotation alone
            return None
        value = self.eval(stmt.value, env)
        for target in getattr(stmt, "targets", None) or [stmt.target]:
            self.bind(target, value, env)

    def bind(self, target: ast.expr, value: frozenset, env: dict) -> None:
        if isinstance(target, ast.Name):
            env[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)) and target.elts \
                and isinstance(target.elts[0], ast.Name):  # h, weights = attn(...)
            env[target.elts[0].id] = frozenset(("item0", v) for v in value)
            for rest in target.elts[1:]:
                self.spoil(rest, env)
        else:  # h[...] = ..., a starred unpacking: the names in it are no longer followed
            self.spoil(target, env)

    def spoil(self, node: ast.AST, env: dict) -> None:
        """A statement not followed (a loop, an in-place call, ...): every variable it assigns
        or mentions that carries the hidden states becomes "other", and so does what it
        returns."""
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and (isinstance(n.ctx, ast.Store) or self.carries(n, env)):
                env[n.id] = self.other(n, env)
            elif isinstance(n, ast.Return):
                self.returns.append((n, self.other(n, env)))

    # expressions

    def eval(self, node: ast.expr, env: dict) -> frozenset:
        if isinstance(node, ast.Name):
            return env.get(node.id, frozenset({_EXTERNAL}))
        if isinstance(node, ast.Call) and self.submodule(node.func) is not None:
            return self.eval_call(node, env)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and node.slice.value == 0:
            return frozenset(("item0", v) for v in self.eval(node.value, env))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) \
                and self.carries(node, env):
            left, right = self.eval(node.left, env), self.eval(node.right, env)
            return frozenset(("add", a, b) for a in left for b in right)
        if isinstance(node, ast.IfExp):
            test = _static_bool(node.test, self.layer)
            if test is _UNKNOWN:
                return self.eval(node.body, env) | self.eval(node.orelse, env)
            return self.eval(node.body if test else node.orelse, env)
        return self.other(node, env) if self.carries(node, env) else frozenset({_EXTERNAL})

    def eval_call(self, node: ast.Call, env: dict) -> frozenset:
        """self.<submodule>(input, ...): the input is the first positional argument or the
        keyword named like the submodule's forward's first parameter."""
        name = _self_attribute(node.func)
        main = node.args[0] if node.args else _keyword(node, _first_parameter(self.submodule(
            node.func)))
        for arg in [*node.args[1:], *(k.value for k in node.keywords if k.value is not main)]:
            if self.carries(arg, env):
                text = ast.unparse(arg)
                raise self.forward.refuse(
                    f"self.{name} is also given `{text if len(text) <= 30 else text[:27] + '...'}`"
                    ", which carries the hidden states", node.lineno,
                    f"{self.forward.where(node.lineno)}: expected a sublayer to receive only its "
                    "normed input (a sublayer that adds the residual itself cannot be a "
                    "connection's branch)"
                )
        if main is None or isinstance(main, ast.Starred):
            return self.other(node, env)
        values = frozenset(("call", name, v) for v in self.eval(main, env))
        for value in values:
            self.call_lines.setdefault(value, node.lineno)
        return values

    def other(self, node: ast.AST, env: dict) -> frozenset:
        """("other", line) for a value computed from the hidden states in a way not followed;
        line is the earliest such line it depends on, the one an error message points at."""
        earlier = [line for n in ast.walk(node) if isinstance(n, ast.Name)
                   for v in env.get(n.id, ()) for line in _other_lines(v)]
        return frozenset({("other", min([node.lineno, *earlier]))})

    def submodule(self, func: ast.expr) -> nn.Module | None:
        module = getattr(self.layer, _self_attribute(func) or "", None)
        return module if isinstance(module, nn.Module) else None

    def carries(self, node: ast.AST, env: dict) -> bool:
        """Whether the expression mentions a variable computed from the hidden states."""
        return any(isinstance(n, ast.Name) and env.get(n.id, {_EXTERNAL}) != {_EXTERNAL}
                   for n in ast.walk(node))


def _keyword(call: ast.Call, name: str | None) -> ast.expr | None:
    return next((k.value for k in call.keywords if name and k.arg == name), None)


def _first_parameter(module: nn.Module) -> str | None:
    try:
        return next(iter(inspect.signature(module.forward).parameters), None)
    except (TypeError, ValueError):
        return None


def _updates(h: tuple, norm: str, sublayer: str) -> set[tuple]:
    """h + sublayer(norm(h)) in the forms accepted: either order, the output or its [0]."""
    out = ("call", sublayer, ("call", norm, h))
    return {v for o in (out, ("item0", out)) for v in (("add", h, o), ("add", o, h))}


def _render(value: tuple, input_name: str) -> str:
    """A symbolic value as the expression it stands for."""
    tag = value[0]
    if tag == "call":
        return f"self.{value[1]}({_render(value[2], input_name)})"
    if tag == "item0":
        return f"{_render(value[1], input_name)}[0]"
    if tag == "add":
        return f"({_render(value[1], input_name)} + {_render(value[2], input_name)})"
    return {"input": input_name, "external": "<not the hidden states>"}.get(tag, "<...>")


def _other_lines(value: tuple) -> list[int]:
    if value[0] == "other":
        return [value[1]]
    return [line for v in value[1:] if isinstance(v, tuple) for line in _other_lines(v)]


def _first_other_line(value: tuple) -> tuple:
    return min(_other_lines(value), default=float("inf")), repr(value)


def _residual_path(layer: nn.Module, forward: _Forward) -> _ResidualPath:
    """forward run on symbolic values; refused when it never returns or returns a tuple."""
    path = _ResidualPath(layer, forward)
    try:
        path.run(forward.node.body, {forward.input_name: frozenset({_INPUT})})
    except _Unreachable:  # every path calls a missing submodule; returns reached before count
        pass
    if not path.returns:
        raise forward.refuse("forward never returns", None, _PLAIN_UPDATE)
    for ret, _ in path.returns:
        if isinstance(ret.value, ast.Tuple):
            raise forward.refuse(
                "the layer returns a tuple, not the hidden states alone", ret.lineno,
                f"{forward.where(ret.lineno)} returns a tuple; expected forward to return the "
                "hidden states alone (a tensor), as transformers' Llama-style layers do"
            )
    return path


def _terms(value: tuple) -> list[tuple]:
    """The summands of a value: a + (b + c) -> [a, b, c]."""
    return [*_terms(value[1]), *_terms(value[2])] if value[0] == "add" else [value]


def _chain(value: tuple) -> tuple[list[tuple], tuple]:
    """The submodule calls a summand goes through, outermost first, and what the innermost
    one is given."""
    calls = []
    while value[0] in ("call", "item0"):
        if value[0] == "call":
            calls.append(value)
        value = value[-1]
    return calls, value


# The structural reasons, most telling first: a parallel layer also puts dropout on its outputs,
# but the parallel residual is why it cannot be two connections in a row.
_PARALLEL, _SANDWICH, _WRAPPED, _AFTER_NORM, _OTHER = range(5)


def _structural_problem(layer: nn.Module, forward: _Forward, path: _ResidualPath):
    """(reason, line, details) for the first structural reason found in what forward returns
    (by the order above, then line), or None."""
    found = [(*f, ret, value) for ret, values in path.returns for value in values
             for f in _findings(layer, forward, path, value)]
    if not found:
        return None
    _, line, reason, ret, value = min(found, key=lambda f: f[:3])
    return reason, line, (
        f"{forward.where(line)} puts something else on the residual path; "
        f"{forward.where(ret.lineno)} returns {_render(value, forward.input_name)}; "
        f"{_PLAIN_UPDATE}")


def _findings(layer: nn.Module, forward: _Forward, path: _ResidualPath, value: tuple) -> list:
    """(kind, line, reason) of each structural reason one returned value shows."""
    def norm(call: tuple) -> bool:
        return _is_norm(getattr(layer, call[1]))

    def line(call: tuple) -> int:
        return path.call_lines.get(call, forward.node.lineno)

    found, readers = [], []
    for term in _terms(value):
        calls, start = _chain(term)
        subs = [c for c in calls if not norm(c)]
        if subs and start == _INPUT:
            readers.append(subs[-1])
        if calls and subs and norm(calls[0]):
            found.append((_SANDWICH, line(calls[0]), f"sandwich norm: self.{subs[0][1]}'s output "
                                                     "is normalised before the residual add"))
        elif len(subs) > 1 and calls[0] is subs[0]:
            found.append((_WRAPPED, line(calls[0]), f"self.{subs[0][1]} is applied to "
                                                     f"self.{subs[1][1]}'s output before the "
                                                     "residual add"))
        elif calls and not subs:
            found.append((_AFTER_NORM, line(calls[0]), f"residual taken after the norm: "
                                                        f"self.{calls[0][1]}'s output is added"))
        other = _other_lines(term)
        if other:
            found.append((_OTHER, min(other), _other_reason(forward, min(other))))
    if len(readers) > 1:
        first, second = sorted(readers, key=line)[:2]
        found.append((_PARALLEL, line(second), f"parallel residual: self.{first[1]} and "
                                               f"self.{second[1]} both read the layer input"))
    return found


def _other_reason(forward: _Forward, lineno: int) -> str:
    """What the line that puts something else on the residual path does, in a few words."""
    nodes = [n for n in ast.walk(forward.node) if getattr(n, "lineno", None) == lineno]
    called = [n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
              for n in nodes if isinstance(n, ast.Call)]
    if any(isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Mult, ast.Div)) for n in nodes):
        return "scaled residual: a residual update multiplies the residual or a sublayer output"
    if any("dropout" in name.lower() for name in called):
        return "dropout on the residual path"
    if any(name.endswith("_") and not name.startswith("_") for name in called):
        return "an in-place op changes the hidden states on the residual path"
    return "the residual path is not a plain `residual + sublayer output`"


def _check_returns(forward: _Forward, path: _ResidualPath, spec: LayerSpec) -> None:
    """Refuse unless every path returns h + mlp(norm2(h)) with h = x + attn(norm1(x))."""
    expected = {v for h in _updates(_INPUT, spec.norm1, spec.attn)
                for v in _updates(h, spec.norm2, spec.mlp)}
    for ret, values in path.returns:
        wrong = sorted(values - expected, key=_first_other_line)
        if wrong:
            raise forward.refuse(
                "it returns something other than h + mlp(norm(h)), h = x + attn(norm(x))",
                ret.lineno, _mismatch(forward, ret, wrong[0]))


def _mismatch(forward: _Forward, ret: ast.Return, value: tuple) -> str:
    """The details for a path that returns something other than the pre-norm update: the
    first line that puts something else on the residual path, or else what it returns."""
    lines = _other_lines(value)
    if lines:
        return (f"{forward.where(min(lines))} puts something else on the residual path; "
                f"{_PLAIN_UPDATE}")
    return (f"{forward.where(ret.lineno)} returns {_render(value, forward.input_name)}; "
            f"{_PLAIN_UPDATE}")


# ------------------------------------------------------------------------------------------
# Finding the layers


def find_decoder_layers(model: nn.Module) -> tuple[nn.ModuleList, list[LayerSpec]]:
    """The base model's ModuleList of decoder layers and each layer's spec."""
    base = getattr(model, "base_model", model)
    candidates = [m for m in base.children() if isinstance(m, nn.ModuleList) and len(m) > 0]
    errors = []
    for layers in candidates:
        try:
            return layers, _layer_specs(layers)
        except ConversionError as e:
            errors.append(e)
    name = type(model).__name__
    if not errors:
        raise ConversionError(f"torch_mhc.hf cannot convert {name}: its base model holds no "
                              "nn.ModuleList of layers", f"expected {_EXPECTED}")
    # the list whose layers were read (a refusal with a file:line) is the decoder's
    first = next((e for e in errors if e.details), errors[0])
    found = "; ".join(e.details or str(e) for e in errors)
    raise ConversionError(f"torch_mhc.hf cannot convert {name}: {first}",
                          f"expected {_EXPECTED}; {found}")


def _layer_specs(layers: nn.ModuleList) -> list[LayerSpec]:
    """Every layer's spec, read from the layer itself: layers may hold different sublayers
    (Qwen3-Next's linear and full attention), take different paths or differ in class."""
    specs = []
    for i, layer in enumerate(layers):
        try:
            specs.append(layer_spec(layer))
        except ConversionError as e:
            raise ConversionError(f"layer {i}: {e}" if i else str(e), e.details) from None
    return specs


# ------------------------------------------------------------------------------------------
# The converted layer


class LayerBranch:
    """One sublayer of a converted layer as a connection's branch: calls
    layer.<method>(h, ...), looking the sublayer up on the layer at every call.

    It is not a bound method because copy.deepcopy copies a bound method's layer: a connection
    copied on its own (PEFT's modules_to_save copies each one) would then run a hidden copy of
    the layer, which LoRA never reaches. A deep copy keeps this layer, unless the layer is
    copied in the same deepcopy (the whole model is), then it takes the layer's copy. Pickle
    saves the layer by reference, so an unpickled connection calls the unpickled layer."""

    __slots__ = ("layer", "method")

    def __init__(self, layer: nn.Module, method: str):
        self.layer, self.method = layer, method

    def __call__(self, h: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return getattr(self.layer, self.method)(h, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> LayerBranch:
        # copy.deepcopy enters a copied object in memo before copying its state, so the layer
        # that holds this connection is already there when the whole layer is copied.
        return LayerBranch(memo.get(id(self.layer), self.layer), self.method)

    def __reduce__(self):
        return LayerBranch, (self.layer, self.method)

    def __repr__(self) -> str:
        return f"LayerBranch({type(self.layer).__name__}.{self.method})"


def branches(layer: nn.Module) -> tuple[LayerBranch, LayerBranch]:
    """The attention and MLP branches of a converted layer."""
    return LayerBranch(layer, "_mhc_attn_branch"), LayerBranch(layer, "_mhc_mlp_branch")


def _mhc_attn_branch(self, h: torch.Tensor, **kwargs) -> torch.Tensor:
    """norm1 + attention: [B, T, C] -> [B, T, C] (attention modules return (out, weights))."""
    out = getattr(self, self._mhc_spec.attn)(getattr(self, self._mhc_spec.norm1)(h), **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _mhc_mlp_branch(self, h: torch.Tensor) -> torch.Tensor:
    """norm2 + MLP: [B, T, C] -> [B, T, C] (some MoE blocks return (out, router scores))."""
    out = getattr(self, self._mhc_spec.mlp)(getattr(self, self._mhc_spec.norm2)(h))
    return out[0] if isinstance(out, tuple) else out


def _converted_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The layer as two connections; the first layer expands, the last reduces the streams."""
    names = self._mhc_spec.arg_names
    if len(args) > len(names):
        raise TypeError(f"{type(self).__name__}.forward takes at most {len(names) + 1} positional "
                        f"arguments, got {len(args) + 1}")
    kwargs.update(zip(names[: len(args)], args, strict=True))  # positional arguments by name
    for name in ("encoder_hidden_states", "encoder_attention_mask"):
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"a torch_mhc-converted {type(self).__name__} takes no {name}")
    x = hidden_states
    if self._mhc_first:
        x = expand_streams(x, self.mhc_attn.streams)  # [B, T, C] -> [B, T, n, C]
    x = self.mhc_attn(x, **kwargs)  # [B, T, n, C]
    x = self.mhc_mlp(x)
    return reduce_streams(x) if self._mhc_last else x  # the final norm receives [B, T, C]


def _reduce_ex(self, protocol: int):
    # pickle finds a class by its module and name, and the generated class is in no module
    # until a conversion in this process builds it: pickle the (importable) base class and
    # rebuild the subclass from it. The state comes third so that the connections' branches
    # can refer back to this layer.
    return _unpickle_converted, (type(self)._mhc_base,), self.__getstate__()


def _unpickle_converted(base: type) -> nn.Module:
    cls = converted_class(base)
    return cls.__new__(cls)


_CLASSES: dict[type, type] = {}


def converted_class(cls: type) -> type:
    """The subclass of a decoder layer class whose forward runs the connections (one per class,
    so that transformers' per-class wrappers, e.g. gradient checkpointing, apply to it)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            f"MHC{cls.__name__}", (cls,),
            {
                "forward": _converted_forward,
                "_mhc_attn_branch": _mhc_attn_branch,
                "_mhc_mlp_branch": _mhc_mlp_branch,
                "_mhc_base": cls,
                "__reduce_ex__": _reduce_ex,
                "__module__": __name__,
            },
        )
    return _CLASSES[cls]


def is_converted(module: nn.Module) -> bool:
    return type(module) in _CLASSES.values() or hasattr(module, "_mhc_spec")
