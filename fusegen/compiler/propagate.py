"""Stage 6: every class that (transitively) names a fused class is emitted too.

The decoder layer constructs the fused attention, the model constructs the
decoder layer, the causal LM the model; the pretrained base names module
classes in `_can_record_outputs`, and the model classes inherit from it. Each
of them is copied with those references renamed to the fused classes, so the
generated file holds a self-contained tree from the causal LM down. A class
built from a module-level class table is reached through a fused copy of the
table (`ClassTable`); one built through `AutoModel.from_config` through a call
naming its fused copy, where the config fixes which class that is
(`name_auto_built`).
"""

from __future__ import annotations

import ast
import inspect
import sys
from dataclasses import dataclass
from types import ModuleType

from torch import nn

from fusegen.core import astutil
from fusegen.core.plan import Refused
from fusegen.errors import InputError

PREFIX = "Fused"


def fused_name(name: str) -> str:
    return PREFIX + name


@dataclass
class Emitted:
    """A class statement to write into the generated file, and the module it came from.

    For a class table (see `ClassTable`) `classdef` is a module of statements: the table's fused copy.
    """

    classdef: ast.ClassDef | ast.Module
    module: ModuleType

    @property
    def lineno(self) -> int:
        return getattr(self.classdef, "lineno", 0)


def fused_names(emitted: dict[str, Emitted]) -> dict[str, str]:
    """`{original name: fused name}` for everything emitted: `FusedX` for a class, `FUSED_X` for a table."""
    return {
        name: fused_name(name) if isinstance(item.classdef, ast.ClassDef) else f"{PREFIX.upper()}_{name}"
        for name, item in emitted.items()
    }


@dataclass
class ClassTable:
    """A module-level dict literal whose values are classes (or None): `ATTENTION_CLASSES = {"eager": XAttention}`.

    A model that builds `ATTENTION_CLASSES[config._attn_implementation](...)` reaches the fused class
    only through a fused copy of the table, emitted with the classes that read it.
    """

    name: str
    statement: ast.Assign
    entries: dict[object, str]
    """Each key and the name of the class it maps to."""
    module: ModuleType

    def fused_copy(self, built: set[str]) -> ast.Module:
        """The table, keeping the entries whose class the analysed model builds (renamed later if fused).

        A class the model never built was never analysed nor validated: it may hold the very projections the
        stacked mapping merges (GPT-Neo's flash-attention class inherits them), and loading a fused checkpoint
        into it would leave weights unfilled. Its entry points at a class of its own (`left_out_class`) that
        refuses to be built with a `ValueError` naming the entry, the class and the entries that are fused, so
        selecting it (`attn_implementation="flash_attention_2"`) fails clearly instead of with a bare KeyError.
        """
        statement = astutil.copy_tree(self.statement)
        left_out = {key: name for key, name in self.entries.items() if name not in built}
        kept = [key for key, name in self.entries.items() if name in built]
        stubs: dict[str, ast.ClassDef] = {}
        for value in statement.value.values:
            if isinstance(value, ast.Name) and value.id not in built:
                keys = [key for key, name in left_out.items() if name == value.id]
                stub = stubs.setdefault(value.id, self.left_out_class(keys, value.id, kept))
                value.id = stub.name
        body: list[ast.stmt] = [*stubs.values(), statement]
        module = ast.Module(body=body, type_ignores=[])
        module.lineno = self.statement.lineno
        return module

    def left_out_class(self, keys: list, name: str, kept: list) -> ast.ClassDef:
        """`class <name>NotFused` whose construction raises: the table entries `keys` of a class never analysed."""
        fused = ", ".join(repr(k) for k in kept) or "none"
        entries = f"entry {keys[0]!r}" if len(keys) == 1 else f"entries {', '.join(map(repr, keys))}"
        message = (
            f"{name} ({entries} of {self.name}) is not fused: the model fusegen analysed never builds it, so it "
            f"was neither analysed nor validated. Use an entry that is fused ({fused}), for example through "
            "`attn_implementation=`, or the original Transformers class."
        )
        source = (
            f"class {name}NotFused:\n"
            f"    {ast.unparse(ast.Constant(message))}\n\n"
            "    def __init__(self, *args, **kwargs):\n"
            "        raise ValueError(type(self).__doc__)\n"
        )
        return ast.parse(source).body[0]


def name_auto_built(cls: type, classdef: ast.ClassDef, model: nn.Module, emitted: set[str]) -> bool:
    """Rewrite `self.x = AutoModel.from_config(<config>)` in `__init__` so that it names `T`, the class built
    there, when `T` is emitted, so the fused copy of `T` is named and built.

    Where the class's `config_class` declares the config field (`config.<field>`, a concrete config class)
    and the Auto class maps it to `T`, the call becomes `T._from_config(config.<field>)` (`_from_config_builds`
    says when the two are the same call for every config of the type). Where the field may hold any model type
    (declared `AutoConfig`, or a value read some other way), the call becomes a dispatch on the value's type
    that is the same call for every config (`_dispatch`): `T._from_config(x)` when `x` is exactly `T`'s config
    class and names no remote code, `AutoModel.from_config(x)` as before otherwise. Anything else is left as it
    is, and stays unreachable. Returns whether a call was rewritten.
    """
    rewritten = False
    init = astutil.method(classdef, "__init__")
    if init is None:
        return False
    config_is_parameter = _config_is_the_parameter(init)
    module = sys.modules[cls.__module__]
    auto_built = [
        stmt
        for stmt in astutil.walk(init)
        if isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and astutil.self_attr(stmt.targets[0])
        and _is_auto_from_config(stmt.value, module)
    ]
    instances = [sub for sub in model.modules() if type(sub) is cls] if auto_built else []
    for stmt in auto_built if instances else []:
        call = stmt.value
        built = {type(getattr(instance, stmt.targets[0].attr, None)) for instance in instances}
        if len(built) != 1:
            continue
        (built_class,) = built
        if built_class.__name__ not in emitted:
            continue
        auto = getattr(module, call.func.value.id)
        if config_is_parameter and _from_config_builds(call, cls, auto) is built_class:
            call.func = ast.Attribute(ast.Name(built_class.__name__, ast.Load()), "_from_config", ast.Load())
            rewritten = True
        elif _dispatches_to(call, auto, built_class):
            stmt.value = _dispatch(call, built_class)
            rewritten = True
    return rewritten


def _dispatches_to(call: ast.Call, auto: type, built: type) -> bool:
    """Whether `built._from_config(x)` is exactly `auto.from_config(x)` whenever `type(x)` is `built.config_class`
    and `x` names no remote code for `auto`.

    `auto.from_config` then takes its local-code path: it looks the model class up by the config's type, which
    must give `built` itself (not several classes to choose from by `architectures`), and builds the text part
    instead only when the config declares a text sub-config of that very class, which is checked not to be so.
    The argument must be a plain name or attribute read (`config.text_config`, `text_config`), since the
    dispatch reads it three times.
    """
    argument = call.args[0] if call.args else call.keywords[0].value
    if call.keywords and call.keywords[0].arg != "config":
        return False
    node = argument
    while isinstance(node, ast.Attribute):
        node = node.value
    if not isinstance(node, ast.Name):
        return False
    config_class = getattr(built, "config_class", None)
    if not isinstance(config_class, type):
        return False
    try:
        mapped = auto._model_mapping[config_class]
    except (KeyError, TypeError):
        return False
    return mapped is built and getattr(config_class, "sub_configs", {}).get("text_config") is not config_class


def _dispatch(call: ast.Call, built: type) -> ast.expr:
    """`T._from_config(x) if <x is exactly T's config class> and <no remote code> else <call>`.

    The config class is named by module and qualified name, so the generated file need not import it. The Auto
    mapping is read at build time, as for `T._from_config` (a class registered over it later is not seen).
    """
    argument = ast.unparse(call.args[0] if call.args else call.keywords[0].value)
    auto = call.func.value.id
    config_class = built.config_class
    qualified = (config_class.__module__, config_class.__qualname__)
    source = (
        f"{built.__name__}._from_config({argument}) "
        f"if (type({argument}).__module__, type({argument}).__qualname__) == {qualified!r} "
        f'and {auto}.__name__ not in (getattr({argument}, "auto_map", None) or {{}}) else {ast.unparse(call)}'
    )
    return ast.parse(source, mode="eval").body


def _config_is_the_parameter(init: ast.FunctionDef) -> bool:
    """`__init__(self, config, ...)` never rebinds `config`, so `config.<field>` is a field of the class's config."""
    parameters = init.args.posonlyargs + init.args.args
    if len(parameters) < 2 or parameters[1].arg != "config":
        return False
    return not any(
        isinstance(node, ast.Name) and node.id == "config" and not isinstance(node.ctx, ast.Load)
        for node in astutil.walk(init)
    )


def _is_auto_from_config(call: ast.expr, module: ModuleType) -> bool:
    """`<Auto class>.from_config(config.<field>)`, the Auto class read from `module`."""
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    if not (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "from_config"
        and isinstance(call.func.value, ast.Name)
        and len(call.args) + len(call.keywords) == 1
    ):
        return False
    auto = getattr(module, call.func.value.id, None)
    return isinstance(auto, type) and issubclass(auto, _BaseAutoModelClass)


def _from_config_builds(call: ast.Call, cls: type, auto: type) -> type | None:
    """The class `auto.from_config(config.<field>)` builds in `cls.__init__(config)` for every config, or None."""
    argument = call.args[0] if call.args else call.keywords[0].value
    if call.keywords and call.keywords[0].arg != "config":
        return None
    if not (isinstance(argument, ast.Attribute) and isinstance(argument.value, ast.Name)):
        return None
    if argument.value.id != "config":
        return None
    declared = getattr(getattr(cls, "config_class", None), "sub_configs", {}).get(argument.attr)
    if not isinstance(declared, type):
        return None
    try:
        built = auto._model_mapping[declared]
    except KeyError:
        return None
    text = getattr(declared, "sub_configs", {}).get("text_config")
    if text is not None and getattr(built, "config_class", None) == text:
        return None
    return built


def class_tables(universe: list[type]) -> dict[str, ClassTable]:
    """The class tables of the modules the model's classes come from, naming at least one of those classes.

    Only a plain `NAME = {constant: ClassName, ...}` counts, and only when the
    module's live object is that very dict (same keys, same classes): a table
    built or changed at run time is not copied, nor a name two modules use.
    """
    names = {cls.__name__ for cls in universe}
    found: dict[str, ClassTable] = {}
    ambiguous: set[str] = set()
    for module in dict.fromkeys(sys.modules[cls.__module__] for cls in universe):
        try:
            tree = ast.parse(inspect.getsource(module))
        except (OSError, TypeError, SyntaxError):
            continue
        for statement in tree.body:
            table = _class_table(statement, module)
            if table is None or not set(table.entries.values()) & names:
                continue
            if table.name in found and found[table.name].module is not module:
                ambiguous.add(table.name)  # renaming by name could point one module's code at the other's table
            found.setdefault(table.name, table)
    return {name: table for name, table in found.items() if name not in ambiguous}


def _is_class_or_none(value: ast.expr) -> bool:
    return isinstance(value, ast.Name) or (isinstance(value, ast.Constant) and value.value is None)


def _class_table(statement: ast.stmt, module: ModuleType) -> ClassTable | None:
    if not (
        isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Name)
        and isinstance(statement.value, ast.Dict)
        and all(isinstance(key, ast.Constant) for key in statement.value.keys)
        and all(_is_class_or_none(value) for value in statement.value.values)
    ):
        return None
    name = statement.targets[0].id
    pairs = list(zip(statement.value.keys, statement.value.values))
    entries = {key.value: value.id for key, value in pairs if isinstance(value, ast.Name)}
    live = getattr(module, name, None)
    if not isinstance(live, dict) or list(live) != [key.value for key, _ in pairs]:
        return None
    if not all(
        isinstance(live[key], type) and live[key] is getattr(module, cls, None) for key, cls in entries.items()
    ):
        return None
    if any(live[key.value] is not None for key, value in pairs if not isinstance(value, ast.Name)):
        return None
    return ClassTable(name, statement, entries, module)


def classes_to_emit(
    target_module: ModuleType, model: nn.Module, rewritten: dict[type, ast.ClassDef]
) -> dict[str, Emitted]:
    """Class statements to emit, keyed by original name, each after what its body needs.

    `rewritten` holds the fused classes; any class the model is built from
    that uses one of the emitted names (in its body or bases) joins them,
    until nothing more changes. A class may live in another model's module
    (`got_ocr2` builds on other models' classes); it is read in its own
    module's terms.
    """
    universe = model_specific_classes(target_module, model)
    tables = class_tables(universe)
    by_name: dict[str, type] = {}
    for cls in [*rewritten, *universe]:
        if by_name.setdefault(cls.__name__, cls) is not cls:
            raise InputError(
                f"two classes named {cls.__name__} ({cls.__module__}, {by_name[cls.__name__].__module__})"
            )
    emitted = {cls.__name__: Emitted(classdef, sys.modules[cls.__module__]) for cls, classdef in rewritten.items()}
    sources: dict[str, ast.ClassDef | Refused] = {}
    changed = True
    while changed:
        changed = False
        for cls in universe:
            if cls.__name__ in emitted:
                if cls not in rewritten:  # emitted for another reason (a base): may still name what it builds
                    changed |= name_auto_built(cls, emitted[cls.__name__].classdef, model, set(emitted))
                continue
            if cls.__name__ not in sources:
                try:
                    sources[cls.__name__] = astutil.parse_class(cls)
                except Refused as refusal:
                    sources[cls.__name__] = refusal
            classdef = sources[cls.__name__]
            if not isinstance(classdef, Refused):
                name_auto_built(cls, classdef, model, set(emitted))
            if not isinstance(classdef, Refused) and astutil.loaded_names(classdef) & set(emitted):
                emitted[cls.__name__] = Emitted(classdef, sys.modules[cls.__module__])
                changed = True
        for name, table in tables.items():
            if name not in emitted and set(table.entries.values()) & set(emitted):
                emitted[name] = Emitted(table.fused_copy({cls.__name__ for cls in universe}), table.module)
                changed = True
    for cls in universe:
        if isinstance(sources.get(cls.__name__), Refused) and _uses_any(cls, emitted):
            raise InputError(f"{cls.__name__} must be regenerated but {sources[cls.__name__].reason}")
    return _definition_order(emitted, target_module)


def constructed_classes(emitted: dict[str, Emitted], root: str) -> set[str]:
    """Emitted classes the causal LM `root` can actually build: named in a method (not in a type check), or a base.

    A class picked out of a module-level table (`ATTENTION_CLASSES[kind](...)`)
    is reached through the table's fused copy, which the classes reading the
    table are emitted with. A class built through `AutoModel.from_config` is
    never named where it is built; its fused copy would sit unused in the
    generated file (and type checks renamed to it would stop matching the
    original that is built instead), so its fusion is refused.
    """
    reached = {root} if root in emitted else set()
    frontier = list(reached)
    while frontier:
        classdef = emitted[frontier.pop()].classdef
        if not isinstance(classdef, ast.ClassDef):  # a class table: every class it names can be built
            named, bases = astutil.loaded_names(classdef), set()
        else:
            named = set().union(*(_built_names(stmt) for stmt in classdef.body if isinstance(stmt, ast.FunctionDef)))
            bases = {base.id for base in classdef.bases if isinstance(base, ast.Name)}
        for name in (named | bases) & set(emitted) - reached:
            reached.add(name)
            frontier.append(name)
    return reached


def unreachable_reasons(target_module: ModuleType, model: nn.Module, stray: set[str], root: str) -> dict[str, str]:
    """For each class in `stray` (fused, but not reached from `root`), why the causal LM never builds the copy.

    The modules above an instance of it are looked up in the model, nearest
    first: one whose `__init__` calls `AutoModel.from_config(...)` picks the
    class of what it builds from the config's type at run time, and
    `name_auto_built` found no exact rewrite naming the copy; otherwise the
    construction is one fusegen cannot follow.
    """
    universe = {cls.__name__: cls for cls in model_specific_classes(target_module, model)}
    reasons = {}
    for name in stray:
        ancestors = _ancestors(model, name)
        calls = [(owner, _from_config_call(universe.get(owner), attr)) for owner, attr in ancestors]
        owner, call = next(((owner, call) for owner, call in calls if call is not None), (None, None))
        if call is not None:
            reasons[name] = (
                f"{root} reaches it only through `{ast.unparse(call)}` in {owner}.__init__ (line {call.lineno}), "
                "which picks the class from the config's type at run time, and no call naming the fused copy is the "
                "same call for every config (the argument is not a plain read, or the Auto class does not map the "
                "built class's own config class to it), so a fused copy would never be used"
            )
        else:
            builder = ancestors[0][0] if ancestors else "an unknown module"
            reasons[name] = (
                f"{root} never names this class where it is built (by {builder}), so a fused copy would never be used"
            )
    return reasons


def _ancestors(model: nn.Module, name: str) -> list[tuple[str, str]]:
    """(class, attribute holding the way down) of each module above the first instance of class `name`, nearest
    first; containers (`ModuleList`) are skipped."""
    for path, module in model.named_modules():
        if type(module).__name__ != name or not path:
            continue
        parts = path.split(".")
        found = []
        for depth in range(len(parts) - 1, -1, -1):
            parent = model.get_submodule(".".join(parts[:depth]))
            if not isinstance(parent, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
                found.append((type(parent).__name__, parts[depth]))
        return found
    return []


def _from_config_call(cls: type | None, attribute: str) -> ast.Call | None:
    """The `<Auto class>.from_config(...)` call assigned to `self.<attribute>` in `cls`'s `__init__`, if any."""
    if cls is None:
        return None
    try:
        init = astutil.method(astutil.parse_class(cls), "__init__")
    except Refused:
        return None
    for stmt in astutil.walk(init) if init else []:
        if not (isinstance(stmt, ast.Assign) and any(astutil.self_attr(t, attribute) for t in stmt.targets)):
            continue
        for node in astutil.walk(stmt.value):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "from_config":
                return node
    return None


def _built_names(function: ast.FunctionDef) -> set[str]:
    """Names a method reads, except as the type in `isinstance`/`issubclass` (a check, not a construction)."""
    checked = {
        id(node)
        for call in astutil.walk(function)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id in ("isinstance", "issubclass")
        for argument in call.args[1:]
        for node in astutil.walk(argument)
    }
    return {
        node.id
        for node in astutil.walk(function)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and id(node) not in checked
    }


def _definition_order(emitted: dict[str, Emitted], target_module: ModuleType) -> dict[str, Emitted]:
    """Source order, adjusted so every class follows the classes its bases and body name."""
    pending = sorted(
        emitted,
        key=lambda name: (
            emitted[name].module is target_module,
            emitted[name].module.__name__,
            emitted[name].lineno,
        ),
    )
    needs = {name: _class_level_names(emitted[name].classdef) & set(emitted) - {name} for name in emitted}
    ordered: dict[str, Emitted] = {}
    while pending:
        ready = next((name for name in pending if needs[name] <= set(ordered)), None)
        if ready is None:
            raise InputError(f"the classes {', '.join(pending)} need each other at class level")
        ordered[ready] = emitted[ready]
        pending.remove(ready)
    return ordered


def _class_level_names(classdef: ast.ClassDef) -> set[str]:
    """Names evaluated when the class statement runs (bases, decorators, attributes), not in methods."""
    if not isinstance(classdef, ast.ClassDef):  # a class table: its values are evaluated at import
        return astutil.loaded_names(classdef)
    parts = [*classdef.bases, *classdef.keywords, *classdef.decorator_list]
    parts += [stmt for stmt in classdef.body if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return set().union(*(astutil.loaded_names(part) for part in parts)) if parts else set()


def model_specific_classes(target_module: ModuleType, model: nn.Module) -> list[type]:
    """Model-specific classes the model is built from (module classes and their bases).

    Classes of the target module or of any Transformers model module count;
    Transformers' shared machinery (`PreTrainedModel`, `GenerationMixin`) does not.
    """
    seen: dict[type, None] = {}
    for instance in model.modules():
        for cls in type(instance).__mro__:
            if cls.__module__ == target_module.__name__ or cls.__module__.startswith("transformers.models."):
                seen.setdefault(cls)
    return list(seen)


def _uses_any(cls: type, names: dict) -> bool:
    code_names: set[str] = set()
    for value in vars(cls).values():
        code = getattr(value, "__code__", None)
        if code is not None:
            code_names |= set(code.co_names)
    return bool(code_names & set(names)) or any(base.__name__ in names for base in cls.__bases__)


def rename_classes(classdef: ast.ClassDef, renames: dict[str, str]) -> None:
    """Point every reference to an emitted class at its fused copy, in place.

    Names, the class's own name, and string constants equal to a class name
    (`_no_split_modules = ["LlamaDecoderLayer"]`) are renamed.
    """
    if isinstance(classdef, ast.ClassDef) and classdef.name in renames:
        classdef.name = renames[classdef.name]
    for node in astutil.walk(classdef):
        if isinstance(node, ast.Name) and node.id in renames:
            node.id = renames[node.id]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in renames:
            node.value = renames[node.value]
