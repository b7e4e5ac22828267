"""The runtime test a generated forward makes before trusting what an object's class claims.

A merged call moves the later projections up to the first one's place, so whatever runs between them must run no
code of the caller's. Some forwards learn what a caller's object is with `isinstance(cache, EncoderDecoderCache)`
and then read it as that class (`cache.is_updated`, `cache.self_attention_cache`). Python lets an object lie to
`isinstance`: when its type is not a subclass, `isinstance` reads `obj.__class__`, which a property or a
`__getattribute__` of the caller's class can answer with anything, running the caller's code as it does. The
analysis (`fusegen.fusions.merged.region_rules`, `Claim`) trusts such a test only under `class_is_honest`, and the
generated forward falls back to each projection at its own place when the test fails.
"""

from __future__ import annotations

_OBJECT_CLASS = object.__dict__["__class__"]
_CLASS_DICT = type.__dict__["__dict__"]
_CLASS_MRO = type.__dict__["__mro__"]
_GENERIC_GETATTRIBUTE = frozenset(
    id(kind.__dict__["__getattribute__"])
    for kind in (object, int, float, complex, bool, str, bytes, tuple, list, dict, set, frozenset)
    if "__getattribute__" in kind.__dict__
)
"""The `__getattribute__` slots that read attributes generically (`object`'s, and the ones Python's own number,
string and container types expose): a class whose lookup reaches one of these first, and nothing else, answers
`__class__` from its type. Any other, Python or C (`weakref.proxy` hands the read to the object behind it), may
not."""
_MISSING = object()


def class_is_honest(*objects: object) -> bool:
    """Does reading `__class__` from each of `objects` give its type, with none of its class's code run?

    Sound because an attribute read goes through the first `__getattribute__` on the type's MRO: where that is one
    of `_GENERIC_GETATTRIBUTE`, and the first `__class__` on the MRO is `object`'s descriptor (not a property, not
    a plain value that would let the instance's `__dict__` answer), the read returns `type(obj)` (a data descriptor
    wins over the instance's `__dict__`, and `__getattr__` is never asked for a name that is found). Then
    `isinstance(obj, C)`, for a class `C` whose metaclass keeps `type.__instancecheck__` (the analysis checks that
    when it builds), is `issubclass(type(obj), C)`, and runs no code of the object's. The lookups here read the
    class dictionaries through `type`'s own descriptors, so a metaclass of the caller's runs nothing either. Cost:
    a walk of the MRO, about a microsecond per object.
    """
    for obj in objects:
        getattribute = _first_on_mro(type(obj), "__getattribute__")
        if id(getattribute) not in _GENERIC_GETATTRIBUTE or _first_on_mro(type(obj), "__class__") is not _OBJECT_CLASS:
            return False
    return True


def _first_on_mro(cls: type, name: str) -> object:
    """What the first class on `cls`'s MRO whose dictionary holds `name` holds there (every MRO ends in `object`,
    which holds both names asked for here)."""
    for klass in _CLASS_MRO.__get__(cls):
        found = _CLASS_DICT.__get__(klass).get(name, _MISSING)
        if found is not _MISSING:
            return found
    raise LookupError(name)
