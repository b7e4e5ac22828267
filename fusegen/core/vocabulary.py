"""The one vocabulary of names the analyses trust or fear: pure, in-place and reflective names.

Each set says what a name *does* to the values it is handed (reads them only, writes them in place, or reaches
every name of a frame). The hoisting rules of the merged-linear family (`fusegen.fusions.merged.hoist`), its
dataflow (`fusegen.fusions.merged.dataflow`) and the piece detaching of the forward rewrite
(`fusegen.fusions.merged.rewrite_forward.detach_written_pieces`) all read these sets and no other copy, so a name
added here is trusted, or feared, everywhere at once.
"""

from __future__ import annotations

METADATA_ATTRS = frozenset(
    {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad", "is_meta", "is_sparse",
     "is_quantized", "is_leaf", "names"}
)  # fmt: skip
"""Attributes that are ints, tuples or flags: they share no storage with the tensor."""


METADATA_METHODS = frozenset(
    {"size", "dim", "numel", "stride", "is_contiguous", "element_size", "get_device", "nelement", "item", "tolist",
     "is_floating_point", "is_complex", "storage_offset", "ndimension", "has_names"}
)  # fmt: skip
"""Methods that return ints, tuples, flags or Python copies of the values. Not `data_ptr`: its int is the storage's
address, which `ctypes` (or any C extension) can write through, so it counts as reaching the tensor."""


PURE_METHODS = frozenset(
    {
        *METADATA_METHODS,
        "data_ptr",
        "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "contiguous", "unsqueeze",
        "squeeze", "flatten", "unflatten", "expand", "expand_as", "repeat", "repeat_interleave", "chunk", "split",
        "narrow", "select", "unbind", "t", "to", "float", "half", "bfloat16", "double", "int", "long", "bool",
        "type", "type_as", "clone", "detach", "cpu", "matmul", "mm", "bmm", "add", "sub", "mul", "div",
        "pow", "sqrt", "rsqrt", "exp", "log", "mean", "sum", "norm", "softmax", "log_softmax", "sigmoid", "tanh",
        "masked_fill", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "abs", "neg", "max", "min",
        "amax", "amin", "argmax", "argmin", "cumsum", "var", "std", "clamp", "clip", "where", "gather", "flip",
        "roll", "tril", "triu", "sin", "cos", "relu", "square", "reciprocal", "any", "all", "eq", "ne", "lt",
        "le", "gt", "ge", "isnan", "isinf", "topk", "sort", "argsort", "index_select", "masked_select", "movedim",
        "swapaxes", "mT", "unfold", "float_power", "floor_divide", "remainder", "fmod", "round", "floor", "ceil",
        "__getitem__", "__len__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
        "__truediv__", "__rtruediv__", "__matmul__", "__neg__", "__pow__", "__eq__", "__ne__", "__lt__", "__gt__",
        "__le__", "__ge__", "__bool__", "__float__", "__int__",
    }
)  # fmt: skip
"""Tensor methods that never write their receiver or arguments (some return views: those alias)."""


PURE_TORCH = frozenset(
    {
        "cat", "concat", "concatenate", "stack", "hstack", "vstack", "matmul", "mm", "bmm", "baddbmm", "addmm",
        "einsum", "softmax", "log_softmax", "sigmoid", "tanh", "relu", "exp", "log", "sqrt", "rsqrt", "abs",
        "sin", "cos", "pow", "mean", "sum", "prod", "max", "min", "amax", "amin", "argmax", "argmin", "cumsum",
        "var", "std", "norm", "clamp", "clip", "where", "gather", "index_select", "masked_fill", "masked_select",
        "zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like", "zeros", "ones", "full",
        "empty", "arange", "linspace", "tensor", "as_tensor", "split", "chunk", "unbind", "transpose", "permute",
        "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "narrow", "select", "flip", "roll", "tril",
        "triu", "outer", "polar", "view_as_real", "view_as_complex", "topk", "sort", "argsort", "eq", "ne", "lt",
        "le", "gt", "ge", "isnan", "isinf", "isfinite", "all", "any", "logical_not", "logical_and", "logical_or",
        "add", "sub", "mul", "div", "neg", "erf", "square", "reciprocal", "movedim", "swapaxes", "broadcast_to",
        "diag", "diagonal", "repeat_interleave", "is_tensor", "is_floating_point", "is_complex", "numel",
        "finfo", "iinfo", "is_grad_enabled", "is_autocast_enabled", "get_default_dtype", "result_type",
        "promote_types", "dropout", "layer_norm", "group_norm", "floor", "ceil", "round", "sign", "maximum",
        "minimum", "lerp", "addcmul", "addcdiv", "bucketize", "searchsorted", "cdist", "dot", "clone", "detach",
        "float_power", "remainder", "fmod", "floor_divide", "logsumexp", "tile", "expand_copy", "atleast_1d",
        "atleast_2d", "atleast_3d",
    }
)  # fmt: skip
"""Functions of the `torch` namespace that return new values (views alias) and write nothing.

Not every `torch` function without a trailing underscore is pure: the
collectives (`torch.distributed.all_reduce`), `nn.utils.vector_to_parameters`
and `torch.ops` overloads write their arguments, so only these names count.
"""


FRESH_METHODS = frozenset({"clone", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"})
"""Tensor methods whose result is always new storage, whatever the receiver: it aliases nothing."""


FRESH_TORCH = frozenset(
    {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "zeros", "ones",
     "full", "empty", "arange", "linspace", "logspace", "rand", "randn", "randint", "eye", "tensor", "clone"}
)  # fmt: skip
"""Functions of the `torch` namespace whose result is always new storage: it aliases none of their operands
(`torch.tensor` copies its data; `torch.as_tensor` may not, so it is not here)."""


PURE_BUILTINS = frozenset(
    {"len", "isinstance", "tuple", "list", "range", "min", "max", "int", "float", "bool", "str", "type", "zip",
     "enumerate", "hasattr", "print", "repr", "abs", "sum", "any", "all", "sorted", "reversed", "id", "divmod",
     "round", "dict", "set", "frozenset", "slice", "next", "callable", "issubclass",
     "hash", "format", "ValueError", "TypeError", "RuntimeError", "NotImplementedError", "KeyError",
     "AssertionError", "IndexError", "AttributeError", "Exception"}
)  # fmt: skip
"""Builtins that may read a tensor but never write it (not `map`, `filter`, `iter`: they call what they are given)."""


PURE_OPERATORS = frozenset(
    {"add", "sub", "mul", "truediv", "floordiv", "matmul", "neg", "pos", "pow", "mod", "getitem", "itemgetter",
     "attrgetter", "eq", "ne", "lt", "le", "gt", "ge", "not_", "truth", "is_", "is_not", "index", "contains",
     "length_hint", "and_", "or_", "xor", "invert", "abs"}
)  # fmt: skip
"""`operator` functions that compute a value; the `i*` forms, `setitem` and `delitem` write their first operand."""


IN_PLACE_OPERATORS = frozenset(
    {"iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow", "ilshift", "irshift", "iand",
     "ixor", "ior", "iconcat", "setitem", "delitem"}
)  # fmt: skip
"""`operator` functions that write their first operand (`operator.imul(g, 2)`, `operator.setitem(g, 0, 1)`)."""

INPLACE_DUNDERS = frozenset(f"__{name}__" for name in IN_PLACE_OPERATORS)
"""The same operations as dunders, which write their receiver (and keep no reference to their operands):
`g.__imul__(2)`, `g.__setitem__(0, 1)`."""


REFLECTION_NAMES = frozenset(
    {"eval", "exec", "locals", "vars", "globals", "compile", "__import__", "breakpoint", "__builtins__"}
)
"""Builtins that reach every name of the frame, whatever they are handed."""

ATTRIBUTE_BY_NAME = frozenset({"setattr", "delattr"})
"""Builtins that write an attribute spelled as a string (`setattr(g, "data", t)`): no analysis of names sees which.
The hoisting rules judge them where they reach the input (`dynamic-attribute`); the forward rewrite counts every
piece as written when the forward calls one of them or a `REFLECTION_NAMES` builtin."""


FRAME_ATTRS = frozenset(
    {"__dict__", "_getframe", "currentframe", "f_locals", "f_globals", "f_back", "getouterframes",
     "getinnerframes", "tb_frame", "gi_frame", "cr_frame", "settrace", "setprofile", "_current_frames",
     "get_objects", "get_referrers", "get_referents"}
)  # fmt: skip
"""Attributes that expose a frame's (or an object's) bindings, or every live object (`gc`), to code not handed them."""
