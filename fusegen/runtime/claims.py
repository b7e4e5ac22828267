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
_CLASS_FLAGS = type.__dict__["__flags__"]
_HEAP_TYPE = 1 << 9
"""`Py_TPFLAGS_HEAPTYPE`: set on every class a `class` statement (or `type(...)`) makes, clear on classes written in
C."""


def class_is_honest(*objects: object) -> bool:
    """Does reading `__class__` from each of `objects` give its type, with none of its class's code run?

    Sound because attribute reads go through the type's `__getattribute__`: where the first one on the type's MRO is
    defined by a class written in C (`object`'s, or `int`'s, `str`'s, ... which read attributes generically), not by
    a class made by a `class` statement, and the first `__class__` is `object`'s descriptor, the read returns
    `type(obj)` (a data descriptor wins over the instance's `__dict__`, and `__getattr__` is never asked for a name
    that is found). Then `isinstance(obj, C)`, for a class `C` whose metaclass keeps `type.__instancecheck__` (the
    analysis checks that when it builds), is `issubclass(type(obj), C)`, and runs no code of the object's. The
    lookups here read the class dictionaries through `type`'s own descriptors, so a metaclass of the caller's runs
    nothing either. Cost: a walk of the MRO, about a microsecond per object.
    """
    for obj in objects:
        owner, _ = _first_on_mro(type(obj), "__getattribute__")
        _, descriptor = _first_on_mro(type(obj), "__class__")
        if _CLASS_FLAGS.__get__(owner) & _HEAP_TYPE or descriptor is not _OBJECT_CLASS:
            return False
    return True


def _first_on_mro(cls: type, name: str) -> tuple[type, object]:
    """The first class on `cls`'s MRO whose dictionary holds `name`, and what it holds there (every MRO ends in
    `object`, which holds both names asked for here)."""
    for klass in _CLASS_MRO.__get__(cls):
        found = _CLASS_DICT.__get__(klass).get(name)
        if found is not None:
            return klass, found
    raise LookupError(name)
