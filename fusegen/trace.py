"""Stage 3: trace one module's `forward` into an fx graph of its dataflow.

The graph answers one question for the matcher: which child linears read the
very same value. Every child module is recorded as an opaque `call_module`
node, attention interfaces as opaque calls, and each proxy carries the value
the operation would produce on `meta` tensors, so Python-level shape code
(`(*x.shape[:-1], -1, d)`) traces instead of stopping the trace. Anything that
still cannot be traced (data-dependent control flow, unknown inputs) ends the
trace early: the graph up to that point is kept, because the projections sit
near the top of a forward and are usually already recorded.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from dataclasses import dataclass
from unittest import mock

import torch
from torch import fx, nn

UNKNOWN = object()
"""The value of a proxy whose result could not be computed on `meta`."""


@dataclass
class Trace:
    graph: fx.Graph
    error: str | None
    """Why the trace stopped early, or None if it reached the end."""


class TraceStopped(Exception):
    """The forward did something that depends on a value the trace cannot know."""


def trace_module(module: nn.Module) -> Trace:
    """Trace `type(module).forward` on `module`, keeping whatever graph it reaches."""
    tracer = _MetaTracer(module)
    forward = inspect.unwrap(type(module).forward)
    error = None
    try:
        args, kwargs = _example_inputs(tracer, module, forward)
        with _children_as_leaves(tracer), _attention_as_leaf(tracer):
            forward(module, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a partial graph is still useful; record why it stopped
        error = f"{type(exc).__name__}: {exc}".strip()
    return Trace(tracer.graph, error)


def module_value(node: fx.Node) -> object:
    """The meta value recorded for `node`, or `UNKNOWN`."""
    return node.meta.get("value", UNKNOWN)


class _MetaProxy(fx.Proxy):
    """A proxy that knows its meta value, so it can be unpacked and measured."""

    def __len__(self) -> int:
        value = module_value(self.node)
        if value is UNKNOWN or not hasattr(value, "__len__"):
            raise TraceStopped(f"the length of {self.node.name} is not known while tracing")
        return len(value)

    def __iter__(self):
        return iter([self[i] for i in range(len(self))])

    def __setitem__(self, key, value) -> None:
        # Recorded so the trace goes on; the rewrite stage judges the write itself.
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def __bool__(self) -> bool:
        raise TraceStopped(f"control flow depends on the traced value {self.node.name}")

    def __getattr__(self, name: str) -> _MetaAttribute:
        return _MetaAttribute(self, name)


class _MetaAttribute(_MetaProxy, fx.proxy.Attribute):
    """`proxy.attr`: becomes a `getattr` node when used, a method call when called."""


class _MetaTracer(fx.proxy.GraphAppendingTracer):
    """Appends nodes to a fresh graph and evaluates each one on meta values."""

    def __init__(self, root: nn.Module):
        super().__init__(fx.Graph())
        self.root = root
        self.child_paths = {id(child): name for name, child in root.named_modules() if name}
        self.opaque: set[int] = set()
        self._constants = 0

    def proxy(self, node: fx.Node) -> _MetaProxy:
        return _MetaProxy(node, self)

    def create_arg(self, a):
        try:
            return super().create_arg(a)
        except NotImplementedError:
            # Tensors, modules and other objects: the graph only needs a node
            # standing for them, since it is analysed, never run.
            self._constants += 1
            node = self.graph.create_node("get_attr", f"_constant_{self._constants}")
            node.meta["value"] = a
            return node

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if kind != "placeholder":
            proxy.node.meta["value"] = self._evaluate(kind, target, args, kwargs)
        return proxy

    def _evaluate(self, kind, target, args, kwargs) -> object:
        """What the operation returns on meta values, or `UNKNOWN`."""
        if kind == "call_function" and id(target) in self.opaque:
            return (UNKNOWN, UNKNOWN)
        values = fx.node.map_aggregate((args, kwargs), _value_of)
        if _contains_unknown(values):
            return UNKNOWN
        args, kwargs = values
        try:
            if kind == "call_function":
                return target(*args, **kwargs)
            if kind == "call_method":
                return getattr(args[0], target)(*args[1:], **kwargs)
            if kind == "call_module":
                return self.root.get_submodule(target)(*args, **kwargs)
        except Exception:  # noqa: BLE001 - an op that fails on meta just has no known value
            return UNKNOWN
        return UNKNOWN


def _value_of(a):
    return module_value(a.node) if isinstance(a, fx.Proxy) else a


def _contains_unknown(values) -> bool:
    found = False

    def visit(v):
        nonlocal found
        found = found or v is UNKNOWN
        return v

    fx.node.map_aggregate(values, visit)
    return found


def _has_proxy(args, kwargs) -> bool:
    found = False

    def visit(v):
        nonlocal found
        found = found or isinstance(v, fx.Proxy)
        return v

    fx.node.map_aggregate((args, kwargs), visit)
    return found


def _example_inputs(tracer: _MetaTracer, module: nn.Module, forward) -> tuple[list, dict]:
    """Placeholders for `forward`'s parameters.

    The first parameter gets a meta value shaped like a batch of hidden states
    fed to the module's first linear; parameters with defaults keep them (so
    `if cache is not None` takes the simple path); the rest are unknown.
    """
    parameters = list(inspect.signature(forward).parameters.values())[1:]
    args, kwargs = [], {}
    for index, parameter in enumerate(parameters):
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.default is not parameter.empty and index > 0:
            value = parameter.default
        else:
            value = tracer.create_proxy("placeholder", parameter.name, (), {})
            if index == 0:
                value.node.meta["value"] = _hidden_states_like(module)
        if parameter.kind == parameter.KEYWORD_ONLY:
            kwargs[parameter.name] = value
        else:
            args.append(value)
    return args, kwargs


def _hidden_states_like(module: nn.Module) -> object:
    linear = next((child for child in module.children() if isinstance(child, nn.Linear)), None)
    if linear is None:
        return UNKNOWN
    weight = linear.weight
    return torch.empty(2, 3, linear.in_features, dtype=weight.dtype, device="meta")


@contextlib.contextmanager
def _children_as_leaves(tracer: _MetaTracer):
    """Record a call of any child module on traced values as one `call_module` node."""
    original = nn.Module.__call__

    def call(module, *args, **kwargs):
        path = tracer.child_paths.get(id(module))
        if path is not None and _has_proxy(args, kwargs):
            return tracer.create_proxy("call_module", path, args, kwargs)
        return original(module, *args, **kwargs)

    with mock.patch.object(nn.Module, "__call__", call):
        yield


@contextlib.contextmanager
def _attention_as_leaf(tracer: _MetaTracer):
    """Make every attention interface one opaque call returning two values.

    Attention kernels are not traceable in general (flash, flex, paged) and
    nothing inside them is a projection, so their body is of no interest.
    """
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:  # pragma: no cover - older Transformers
        yield
        return
    original = AttentionInterface.get_interface

    def get_interface(self, *args, **kwargs):
        interface = original(self, *args, **kwargs)
        tracer.opaque.add(id(interface))

        def leaf(*call_args, **call_kwargs):
            if not _has_proxy(call_args, call_kwargs):
                return interface(*call_args, **call_kwargs)
            return tracer.create_proxy("call_function", interface, call_args, call_kwargs)

        return leaf

    with mock.patch.object(AttentionInterface, "get_interface", get_interface):
        yield
