"""Stage 3: trace one module's `forward` into an fx graph of its dataflow.

The graph answers one question for the matcher: which child linears read the
very same value. Every child module is recorded as an opaque `call_module`
node, attention interfaces as opaque calls, and each proxy carries the value
the operation would produce on `meta` tensors, so Python-level shape code
(`(*x.shape[:-1], -1, d)`) traces instead of stopping the trace. The inputs
are the arguments the module received in one meta forward of the whole model
(`record_inputs`), so a tuple (`cos, sin = position_embeddings`), a dict or a
cache has its real structure; a module the forward never reached gets
synthetic inputs instead. Anything that still cannot be traced (control flow
on an unknown value) ends the trace early: the graph up to that point is kept,
because the projections sit near the top of a forward and are usually already
recorded, and the report says where it stopped.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import inspect
import operator
from unittest import mock

import torch
import torch.utils._pytree
from torch import fx, nn

from fusegen.compiler.inputs import extra_inputs
from fusegen.compiler.modal_inputs import meta_image_inputs, meta_signal_batches
from fusegen.core.traced import Trace

UNKNOWN = object()
"""The value of a proxy whose result could not be computed on `meta`."""
_METADATA = {"shape", "dtype", "device", "ndim", "is_floating_point", "dim", "size"}


class TraceStopped(Exception):
    """The forward did something that depends on a value the trace cannot know."""


Recorded = tuple[tuple, dict]
"""The positional and keyword arguments one call of a module's forward received."""


def trace_module(module: nn.Module, recorded: Recorded | None = None) -> Trace:
    """Trace `type(module).forward` on `module`, keeping whatever graph it reaches.

    With `recorded` (see `record_inputs`), the placeholders carry the values the
    forward really received, so a tuple can be unpacked and a dict indexed;
    without, synthetic inputs stand in (see `_example_inputs`). When the
    recorded trace stops early and the synthetic one sees more child calls,
    the synthetic one is kept: either is a specialisation the matcher only
    proposes groups from, so the one that sees more can only find more.
    """
    snapshot = None if recorded is None else _snapshot(recorded)
    if snapshot is None:
        why = "the model's meta forward never reached it" if recorded is None else "its recorded inputs do not copy"
        return _with_note(_synthetic_trace(module), f"traced with synthetic inputs: {why}")
    trace = _trace(module, snapshot)
    if trace.error is None:
        return trace
    synthetic = _synthetic_trace(module)
    if _child_calls(synthetic) > _child_calls(trace):
        return _with_note(
            synthetic, f"traced with synthetic inputs: with its recorded ones it stopped at {trace.error}"
        )
    return trace


def _with_note(trace: Trace, note: str) -> Trace:
    """`trace` with `note` appended to its stop reason, if it stopped: the report says why the trace stopped."""
    return trace if trace.error is None else Trace(trace.graph, f"{trace.error} ({note})")


def _synthetic_trace(module: nn.Module) -> Trace:
    """The trace with synthetic inputs that gets furthest: the plain ones first, then each of `_FILLED_INPUTS`.

    Every variant is one way the forward can really be called (a cross-attention
    given encoder states, a required mask given a mask), so each graph is a
    specialisation the matcher only proposes groups from; the one that reaches
    the end, or failing that sees the most child calls, can only find more.
    """
    best = _trace(module, None)
    forward = inspect.unwrap(type(module).forward)
    for fill in _FILLED_INPUTS:
        if best.error is None:
            break
        filled = fill(module, inspect.signature(forward))
        if filled:
            trace = _trace(module, None, filled)
            if trace.error is None or _child_calls(trace) > _child_calls(best):
                best = trace
    return best


def _trace(module: nn.Module, recorded: Recorded | None, filled: dict | None = None) -> Trace:
    tracer = _MetaTracer(module)
    forward = inspect.unwrap(type(module).forward)
    error = None
    try:
        if recorded is None:
            args, kwargs = _example_inputs(tracer, module, forward, filled or {})
        else:
            args, kwargs = _recorded_inputs(tracer, forward, module, recorded)
        with _children_as_leaves(tracer), _attention_as_leaf(tracer):
            forward(module, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a partial graph is still useful; record why it stopped
        error = f"{type(exc).__name__}: {exc}".strip()
    return Trace(tracer.graph, error)


def _child_calls(trace: Trace) -> int:
    return sum(node.op == "call_module" for node in trace.graph.nodes)


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
        entries = self._mapping_entries()
        if entries is not None:
            return iter(entries)
        return iter([self[i] for i in range(len(self))])

    def _mapping_entries(self) -> list | None:
        """What iterating a known dict, or its `.keys()`/`.values()`/`.items()`, yields: its keys as they are (plain
        data, as in the recorded call, so a dict rebuilt from them still finds `shared_kv_states["full_attention"]`),
        each value a `getitem` of the dict; None for anything else. A dict view cannot be indexed, so `self[i]`
        would make every entry unknown."""
        node, method = self.node, "keys"
        if node.op == "call_method" and node.target in ("keys", "values", "items") and node.args:
            node, method = node.args[0], node.target
        mapping = module_value(node) if isinstance(node, fx.Node) else UNKNOWN
        if not isinstance(mapping, dict) or not all(isinstance(key, (str, int, enum.Enum)) for key in mapping):
            return None
        source = self.tracer.proxy(node)
        if method == "keys":
            return list(mapping)
        if method == "values":
            return [source[key] for key in mapping]
        return [(key, source[key]) for key in mapping]

    def __setitem__(self, key, value) -> None:
        # Recorded so the trace goes on; the rewrite stage judges the write itself.
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def __bool__(self) -> bool:
        # A branch on a known plain value (a shape comparison, a flag read off
        # a recorded cache) follows the recorded call. The graph only proposes
        # groups; whether the source may be rewritten is judged on the source.
        value = module_value(self.node)
        if isinstance(value, (bool, int, float)):
            return bool(value)
        raise TraceStopped(f"control flow depends on the traced value {self.node.name}")

    def __getattr__(self, name: str):
        # Tensor metadata of a known value is a constant of the traced call, and
        # C functions (`torch.finfo(x.dtype)`, `torch.ones(n, device=x.device)`)
        # accept no proxy for it; the matcher never needs it as a node.
        value = module_value(self.node)
        if name in _METADATA and isinstance(value, torch.Tensor):
            return getattr(value, name)
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
        values = fx.node.map_aggregate((args, kwargs), _value_of)
        if kind == "call_function" and id(target) in self.opaque:
            # The kernel's body stays out of the graph, but on known meta
            # inputs it still says what it returns (eager and sdpa run on meta).
            return _attention_value(target, values)
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


def _attention_value(interface, values) -> object:
    """What an attention interface returns on meta values: its pair of outputs, or two unknowns."""
    unknown = (UNKNOWN, UNKNOWN)
    if _contains_unknown(values):
        return unknown
    args, kwargs = values
    try:
        result = interface(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a kernel without meta support just has no known value
        return unknown
    return tuple(result) if isinstance(result, tuple) and len(result) == 2 else unknown


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


def _example_inputs(tracer: _MetaTracer, module: nn.Module, forward, filled: dict) -> tuple[list, dict]:
    """Placeholders for `forward`'s parameters.

    The first parameter gets a meta value shaped like a batch of hidden states
    fed to the module's first linear; parameters with defaults keep them (so
    `if cache is not None` takes the simple path); the rest are unknown.
    Parameters named in `filled` get a placeholder carrying that meta value.
    """
    parameters = list(inspect.signature(forward).parameters.values())[1:]
    args, kwargs = [], {}
    for index, parameter in enumerate(parameters):
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.name in filled:
            value = _placeholder(tracer, parameter.name, filled[parameter.name])
        elif parameter.default is not parameter.empty and index > 0:
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


def _recorded_inputs(tracer: _MetaTracer, forward, module: nn.Module, recorded: Recorded) -> tuple[list, dict]:
    """Placeholders for the arguments of one recorded call: tensors, containers and caches carry their value.

    Plain values (None, flags, numbers, strings) are passed as they were, so
    control flow on them takes the branch the real call took. Parameters the
    call left out keep their defaults, as in the real call.
    """
    args, kwargs = recorded
    bound = inspect.signature(forward).bind(module, *args, **kwargs)
    names = list(bound.arguments)[1:]
    parameters = inspect.signature(forward).parameters
    for name in names:
        value = bound.arguments[name]
        kind = parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            bound.arguments[name] = tuple(_placeholder(tracer, f"{name}_{i}", v) for i, v in enumerate(value))
        elif kind == inspect.Parameter.VAR_KEYWORD:
            bound.arguments[name] = {key: _placeholder(tracer, key, v) for key, v in value.items()}
        else:
            bound.arguments[name] = _placeholder(tracer, name, value)
    return list(bound.args[1:]), dict(bound.kwargs)


def _placeholder(tracer: _MetaTracer, name: str, value: object) -> object:
    """`value` itself if it is plain data, else a placeholder whose meta value it is."""
    if not _is_traced(value):
        return value
    proxy = tracer.create_proxy("placeholder", name, (), {})
    proxy.node.meta["value"] = value
    return proxy


def _is_traced(value: object) -> bool:
    """Whether a recorded argument becomes a placeholder: a tensor, a container holding one, or a cache.

    Everything else (None, flags, numbers, strings, enums) is data the forward
    branches on; passing it as it was keeps the branch the real call took.
    """
    leaves = torch.utils._pytree.tree_leaves(value)
    if any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return True
    return not isinstance(
        value, (type(None), bool, int, float, complex, str, bytes, enum.Enum, torch.dtype, torch.device)
    )


def record_inputs(model: nn.Module, modules: list[nn.Module], length: int = 5) -> dict[int, Recorded]:
    """The arguments each of `modules` receives in one forward of `model` on meta `input_ids` (keyed by `id`).

    The model runs in eval mode without gradients, with its config's other
    defaults (`use_cache` included); a forward that fails part-way (an op with
    no meta kernel, a data-dependent branch) still leaves the calls made
    before the failure recorded, and the nested models are run next for what
    is missing (see `_roots`). Modules not reached get no entry, so their
    trace falls back to synthetic inputs. MoE experts run the
    `batched_mm` implementation, the one whose shapes do not depend on the
    routing (grouped kernels want bf16, the eager loop reads which experts
    were hit). Modes and configs are restored afterwards.
    """
    recorded: dict[int, Recorded] = {}
    sink = [recorded]  # where the hook records: a scratch dict while `_record_signals` tries a layout
    wanted = {id(module) for module in modules}

    def hook(module, args, kwargs):
        if id(module) not in sink[0] and id(module) not in recorded:
            snapshot = _snapshot((args, dict(kwargs)))
            if snapshot is not None:
                sink[0][id(module)] = snapshot
        if sink[0] is recorded and wanted <= recorded.keys():
            raise _AllRecorded  # the rest of the forward would record nothing (see `_AllRecorded`)

    handles = [module.register_forward_pre_hook(hook, with_kwargs=True) for module in modules]
    modes = {module: module.training for module in model.modules()}
    experts = _configs_with_experts(model)
    try:
        for config, _ in experts:
            config._experts_implementation = "batched_mm"
        model.eval()
        recorded.update(_record_signals(model, sink))
        sink[0] = recorded
        for root in _roots(model):
            for options in _RUN_OPTIONS:
                if all(id(module) in recorded for module in modules) or _run(root, length, **options):
                    break
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in modes.items():
            module.training = mode
        for config, implementation in experts:
            config._experts_implementation = implementation
    return recorded


class _AllRecorded(Exception):
    """Raised by `record_inputs`' hook once every module of its list has its call recorded, to end the forward there.

    Nothing is lost: the hook keeps only each module's first call, as a deep copy taken when the call is made
    (`_snapshot`), so what the forward would still run (for a default config, every layer after the first and the
    head) could record nothing and change nothing recorded; `record_inputs` stops its runs once all are recorded
    anyway. Only the token runs stop early: while `_record_signals` tries a layout (recording into a scratch dict),
    whether that layout's forward runs to the end decides which layout's calls are kept, so those run in full."""


def _record_signals(model: nn.Module, sink: list) -> dict[int, Recorded]:
    """The calls recorded while `model` runs on meta audio or video (`fusegen.compiler.modal_inputs.
    meta_signal_batches`), so an audio tower's classes record the inputs they really get.

    Each layout is recorded apart (into `sink[0]`): the first batch whose forward runs to the end gives the calls;
    if none does (placing audio among meta tokens fails after the tower ran), the batch that reached the most
    modules, for a layout the model does not read fails at its first layer. Nothing for a model that reads neither.
    """
    best: dict[int, Recorded] = {}
    for batch in meta_signal_batches(model):
        for options in _RUN_OPTIONS:
            sink[0] = scratch = {}
            try:
                with torch.no_grad():
                    model(**batch, **options)
            except Exception:  # noqa: BLE001 - upstream code on meta may fail part-way; what was recorded is right
                best = scratch if len(scratch) > len(best) else best
                continue
            return scratch
    return best


def _roots(model: nn.Module) -> list[nn.Module]:
    """The model, then each model nested in it that reads `input_ids` (a multimodal model's language model).

    A wrapper whose own forward fails on meta (a mask helper calling `.item()`)
    still lets its text model record the calls the wrapper would have made.
    """
    from transformers import PreTrainedModel

    nested = [
        module
        for module in model.modules()
        if module is not model
        and isinstance(module, PreTrainedModel)
        and "input_ids" in inspect.signature(type(module).forward).parameters
    ]
    return [model, *nested]


_RUN_OPTIONS = ({}, {"use_cache": False})
"""The config's defaults first; then without a cache, which some hybrid models' default cache cannot serve
(`get_seq_length` on a cache holding only linear-attention layers fails before the first layer runs)."""


def _run(root: nn.Module, length: int, **options) -> bool:
    """One forward of `root` on meta `input_ids`; whether it ran to the end. A failure just ends the recording there.

    A retry with other `options` only adds the calls of modules not yet recorded (the hook keeps the first call).
    A model that needs more than tokens to run all its classes gets those inputs too (`fusegen.compiler.inputs.extra_inputs`:
    Mllama's image states, a Gemma 4 assistant's backbone states). A model whose forward takes images is first run
    with one (`fusegen.compiler.modal_inputs.meta_image_inputs`), for the calls its vision tower makes.
    """
    images = meta_image_inputs(root)
    if images:  # first with an image, so the vision tower's classes record the inputs they really get
        try:
            with torch.no_grad():
                root(input_ids=torch.zeros(2, length, dtype=torch.long, device="meta"), **images, **options)
        except _AllRecorded:
            return True
        # placing image features among meta tokens fails after the tower ran; the text-only runs below go on
        except Exception:  # noqa: BLE001, S110
            pass
    try:
        extra = extra_inputs(root, 2, length, lambda *shape: torch.empty(*shape, device="meta"))
    except Exception:  # noqa: BLE001 - sizes the config does not spell as expected: tokens alone
        extra = {}
    for given in [extra, {}] if extra else [{}]:
        try:
            with torch.no_grad():
                root(input_ids=torch.zeros(2, length, dtype=torch.long, device="meta"), **given, **options)
        except _AllRecorded:
            return True
        # upstream code on meta may fail part-way; what was recorded is still right
        except Exception:  # noqa: BLE001, S112
            continue
        return True
    return False


def _snapshot(recorded: Recorded) -> Recorded | None:
    """A deep copy of recorded arguments, or None if they cannot be copied.

    A cache is updated in place by the very call it is passed to (and again by
    the trace, which runs `cache.update` on meta values), so each use starts
    from a copy of the state the call saw.
    """
    try:
        return copy.deepcopy(recorded)
    except Exception:  # noqa: BLE001 - an argument that cannot be copied: trace with synthetic inputs
        return None


def _configs_with_experts(model: nn.Module) -> list[tuple[object, str]]:
    """Each config a module of `model` reads whose `_experts_implementation` is set, with its value."""
    found = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        implementation = getattr(config, "_experts_implementation", None)
        if implementation is not None:
            found.setdefault(id(config), (config, implementation))
    return list(found.values())


_CROSS_INPUTS = ("cross_attention_states", "encoder_hidden_states", "key_value_states")
"""Names the cross-attention classes of Transformers give the encoder (or image) states their k/v read."""


def _cross_attention_states(module: nn.Module, signature: inspect.Signature) -> dict:
    """Encoder states for a cross-attention argument left at its default (None): a class the text-only forward
    skips (Mllama's cross-attention layers) or reaches only with encoder outputs (BLT) reads them before k/v."""
    states = _hidden_states_like(module)
    if states is UNKNOWN:
        return {}
    return {name: states for name in _CROSS_INPUTS if name in signature.parameters}


def _required_masks(module: nn.Module, signature: inspect.Signature) -> dict:
    """A `(batch, length)` mask of ones for each required parameter called `*mask`: a forward that asks the mask's
    rank (`mask.dim() == 3`, XLM) then traces on, where an unknown mask stops it before the projections."""
    states = _hidden_states_like(module)
    if states is UNKNOWN:
        return {}
    return {
        name: torch.ones(states.shape[:2], dtype=torch.bool, device="meta")
        for name, parameter in list(signature.parameters.items())[1:]
        if name.endswith("mask") and parameter.default is parameter.empty
    }


def _no_required_masks(module: nn.Module, signature: inspect.Signature) -> dict:
    """None for each required `*mask` parameter, as an unpadded batch passes it to most attentions: a layer that
    unpacks its attention's result (`hidden_states, _ = self.self_attn(...)`) then knows the result's length."""
    return {
        name: None
        for name, parameter in list(signature.parameters.items())[1:]
        if name.endswith("mask") and parameter.default is parameter.empty
    }


def _image_shaped_states(module: nn.Module, signature: inspect.Signature) -> dict:
    """Hidden states shaped `(batch, height, width, channels)` for the first parameter: windowed vision attentions
    (SAM's, GOT-OCR2's) unpack four dimensions where a text attention unpacks three."""
    states = _hidden_states_like(module)
    parameters = list(signature.parameters)[1:]
    if states is UNKNOWN or not parameters:
        return {}
    return {parameters[0]: torch.empty(2, 2, 3, states.shape[-1], dtype=states.dtype, device="meta")}


_FILLED_INPUTS = (_cross_attention_states, _required_masks, _no_required_masks, _image_shaped_states)


def _hidden_states_like(module: nn.Module) -> object:
    """A meta batch of hidden states for `module`: as wide as its first linear's input, or, with no linear child
    (a norm), as its own 1-d weight. Only the shape matters: it lets shape code trace; the graph is never run."""
    linear = next((child for child in module.children() if isinstance(child, nn.Linear)), None)
    if linear is not None:
        return torch.empty(2, 3, linear.in_features, dtype=linear.weight.dtype, device="meta")
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return torch.empty(2, 3, weight.shape[0], dtype=weight.dtype, device="meta")
    return UNKNOWN


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
