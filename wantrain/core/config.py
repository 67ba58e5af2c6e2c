"""Config machinery: TOML tables into frozen attrs sections, with errors a user can act on.

Each package owns the section it reads (``core.settings.TrainConfig``, ``models.wan22.config.ModelConfig``, ...)
and declares its keys with :func:`setting`, which records the documentation, the valid range or choices, and the
default. :func:`structure` turns a TOML table into a section and raises :class:`ConfigError` with one line that
names the full key path and what would be valid:

* unknown keys, with a did-you-mean from the same table, or the table where the key belongs when it was put in
  the wrong one (peer trainers silently ignore such keys and lose whole runs to them);
* wrong types (``train.max_steps = "ten"``: expected an integer);
* out-of-range values and unknown choices, naming the range or the choices;
* a NaN or an infinity in any float value of any key (``optimizer.eps = inf``: not a finite number), one check
  for every section (:class:`_Checks`), not code per key;
* strings that break a key's :class:`Rule` (``run.name = "../x"``), and empty paths (``data.path = ""``).

Types are checked while a TOML table is read; ranges, choices and rules are the keys' attrs validators (built by
:func:`setting`), so a section built in code or changed with ``attrs.evolve`` is refused like the same value in
a file, naming the key (``TrainConfig(max_steps=-5)``: ``config key 'train.max_steps' = -5 is out of range``).

A path may start with ``~`` (the user's home folder); it is expanded here, when the key is read, so that nothing
later mistakes it for a relative path.

:func:`config_reference` renders the documentation of every key (``docs/config.md`` is generated from it, and a
test keeps the two in sync).
"""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs

from wantrain.core.errors import ConfigError
from wantrain.core.problems import VALUE, Problem, Refused, collecting

_DOC = "wantrain_doc"
_RANGE = "wantrain_range"
_CHOICES = "wantrain_choices"
_ALIASES = "wantrain_aliases"
_RULE = "wantrain_rule"

NOTHING = attrs.NOTHING


@attrs.frozen
class Range:
    """An inclusive or exclusive numeric range; ``None`` means unbounded on that side."""

    low: float | None = None
    high: float | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True

    def contains(self, value: float) -> bool:
        if self.low is not None and (value < self.low or (value == self.low and not self.low_inclusive)):
            return False
        return not (
            self.high is not None and (value > self.high or (value == self.high and not self.high_inclusive))
        )

    def describe(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>=' if self.low_inclusive else '>'} {_number(self.low)}")
        if self.high is not None:
            parts.append(f"{'<=' if self.high_inclusive else '<'} {_number(self.high)}")
        return " and ".join(parts) if parts else "any number"


@attrs.frozen
class Rule:
    """A check on a string key: ``test(value)`` is True for valid values; ``describe`` says what is valid."""

    test: typing.Callable[[str], bool]
    describe: str


def _number(x: float) -> str:
    # integers exactly (a seed bound of 2**63 - 1 must not read 9.22337e+18), other numbers short
    return str(x) if isinstance(x, int) else f"{x:g}"


def at_least(low: float) -> Range:
    return Range(low=low)


def above(low: float) -> Range:
    return Range(low=low, low_inclusive=False)


def between(low: float, high: float) -> Range:
    return Range(low=low, high=high)


def setting(
    default: Any = NOTHING,
    *,
    doc: str,
    range: Range | None = None,
    choices: typing.Sequence[Any] | None = None,
    factory: typing.Callable[[], Any] | None = None,
    aliases: typing.Sequence[str] = (),
    rule: Rule | None = None,
) -> Any:
    """Declare one config key of a section.

    ``doc`` is the one-line meaning shown in ``docs/config.md``; ``range`` bounds numbers; ``choices`` lists the
    accepted values (for ``Literal`` types the choices are taken from the type); ``aliases`` are other key names
    accepted for this key (the seeds' spellings); ``rule`` checks a string key (e.g. a file name).
    """
    metadata = {
        _DOC: doc, _RANGE: range, _CHOICES: tuple(choices) if choices else None, _ALIASES: tuple(aliases),
        _RULE: rule,
    }
    validator = _Checks(range, tuple(choices) if choices else None, rule)
    if factory is not None:
        return attrs.field(factory=factory, metadata=metadata, validator=validator)
    return attrs.field(default=default, metadata=metadata, validator=validator)


class InvalidValue(ConfigError):
    """A value broke its key's range, choices or rule (raised by the key's attrs validator at construction).

    ``str()`` names the key as ``<section key>.<field>``; the TOML structurer and :func:`check_value` re-raise it
    under the key's full path in the document (``data.datasets[0].repeats``)."""

    def __init__(self, section_key: str, field: str, index: str, what: str) -> None:
        super().__init__(f"config key '{section_key}.{field}{index}' {what}")
        self.field, self.index, self.what = field, index, what

    def at(self, path: str) -> ConfigError:
        """The same error for the key at ``path`` (the field's full key path)."""
        return ConfigError(f"config key '{path}{self.index}' {self.what}")


@attrs.frozen
class _Checks:
    """The attrs validator of one key: its range, choices and rule, applied to the value (or to each item of a
    list value); ``None`` passes (an unset optional key). Runs wherever the section is built -- from TOML, in code,
    in ``attrs.evolve`` -- so a value is refused the same way everywhere.

    Every key of every section has one (:func:`section` gives it to keys declared without :func:`setting`): a NaN
    or an infinity is refused in any float value -- a number key, an item of a list, a value of a table (an
    external class's arguments) -- whatever the key's range, since no key means anything by them."""

    range: Range | None = None
    choices: tuple[Any, ...] | None = None
    rule: Rule | None = None

    def __call__(self, instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        problem = self.problem(value)
        if problem is not None:
            index, what = problem
            name = attribute.name
            if name == getattr(type(instance), "__wantrain_extra__", None) and index.startswith("."):
                name, index = index[1:], ""  # a key of the table itself (``optimizer.d_coef``)
            raise InvalidValue(section_key(type(instance)), name, index, what)

    def problem(self, value: Any) -> tuple[str, str] | None:
        """``(index suffix, what is wrong)`` for a bad value, else None."""
        if isinstance(value, Mapping):
            for name, item in value.items():
                if not _finite(item):
                    return f".{name}", f"= {item!r} is not a finite number; expected {self._finite_range()}"
            return None
        if isinstance(value, list | tuple):
            for i, item in enumerate(value):
                problem = self.problem(item)
                if problem is not None:
                    return f"[{i}]{problem[0]}", problem[1]
            return None
        if value is None:
            return None
        if not _finite(value):
            return "", f"= {value!r} is not a finite number; expected {self._finite_range()}"
        if self.range is not None:
            if isinstance(value, bool) or not isinstance(value, int | float):
                return "", f"= {_fmt(value)} has the wrong type; expected a number"
            if not self.range.contains(value):
                return "", f"= {value!r} is out of range; expected {self.range.describe()}"
        if isinstance(value, str):
            if self.choices and value not in self.choices:
                close = difflib.get_close_matches(value, [str(c) for c in self.choices], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                return "", (f"= {value!r} is not valid; expected one of "
                            f"{', '.join(repr(c) for c in self.choices)}{hint}")
            if self.rule is not None and not self.rule.test(value):
                return "", f"= {value!r} is not valid; expected {self.rule.describe}"
        return None

    def _finite_range(self) -> str:
        if self.range is None or self.range.describe() == "any number":
            return "a finite number (NaN and infinities are refused)"
        return f"a finite number {self.range.describe()}"


def _finite(value: Any) -> bool:
    """False for a float NaN or infinity, at any depth of lists and tables; True for anything else."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        return all(_finite(v) for v in value)
    if isinstance(value, Mapping):
        return all(_finite(v) for v in value.values())
    return True


def _checked_fields(cls: type, fields: list[attrs.Attribute]) -> list[attrs.Attribute]:
    """attrs field transformer of :func:`section`: a key declared without :func:`setting` still gets the
    finiteness check of :class:`_Checks`."""
    out = []
    for f in fields:
        if f.validator is None:
            f = f.evolve(validator=_Checks())
        elif not isinstance(f.validator, _Checks):
            f = f.evolve(validator=attrs.validators.and_(_Checks(), f.validator))
        out.append(f)
    return out


def section(cls: type | None = None, *, key: str | None = None) -> Any:
    """Make ``cls`` a frozen, slotted, keyword-only config section (``@section`` or ``@section(key="train")``).

    ``key`` is the section's table in the root config: a value refused at construction in code names the key as
    ``<key>.<field>`` (``train.max_steps``). Sections without one are named by :func:`name_sections`, or by their
    class name until then.

    A section that sets the class attribute ``__wantrain_extra__ = "field_name"`` receives the keys it does not
    declare in that ``dict`` field instead of an unknown-key error, and must validate them itself (its attrs
    validator raises ``ConfigError`` naming the key and the valid keys).
    """

    def make(cls: type) -> type:
        built = attrs.frozen(kw_only=True, field_transformer=_checked_fields)(cls)
        if key is not None:
            built.__wantrain_key__ = key
        return built

    return make(cls) if cls is not None else make


def section_key(cls: type) -> str:
    """The table of section ``cls`` in the root config (``train``), or its class name when none is known."""
    return cls.__dict__.get("__wantrain_key__") or cls.__name__


def name_sections(root: type) -> None:
    """Give every section reachable from ``root`` that has no key yet the key path it has under ``root`` (items
    of a list of sections: ``data.datasets[]``), so errors raised at construction in code name the full key."""

    def walk(cls: type, path: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in attrs.fields(cls):
            inner = _Structurer._section_of(hints[f.name])
            if inner is None:
                continue
            sub = f"{path}.{f.name}" if path else f.name
            if typing.get_origin(hints[f.name]) in (list, tuple):
                sub += "[]"
            if "__wantrain_key__" not in inner.__dict__:
                inner.__wantrain_key__ = sub
            walk(inner, sub)

    walk(root, "")


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and attrs.has(tp)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp in (str, Path):
        return "a string"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if origin in (list, tuple):
        return "a list"
    if origin is dict or tp is dict:
        return "a table"
    if _is_section(tp):
        return "a table"
    return getattr(tp, "__name__", str(tp))


def _fmt(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    return repr(value)


def _unindexed(key: str) -> str:
    """``key`` without its list indices (``data.datasets[0].path`` -> ``data.datasets.path``): a rule reads a
    table's key of every item."""
    return re.sub(r"\[\d+\]", "", key)


class _Structurer:
    """Walks a TOML document along a root section type. Holds the schema index for misplaced-key hints."""

    def __init__(self, root: type, hint: typing.Callable[[str, Any], str | None] | None = None) -> None:
        self.root = root
        # names and values from elsewhere (another trainer's keys, its spelling of a value): hint(key, value),
        # asked before the did-you-mean
        self.hint = hint
        self.errors: list[str] = []  # every problem of the document, in its order (one report: :func:`structure`)
        self.error_keys: list[str] = []  # the key (or table) of each of them, for its section in the report
        self.index: dict[str, list[str]] = {}
        self._index(root, "")

    def _index(self, cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in attrs.fields(cls):
            path = f"{prefix}{f.name}"
            for name in (f.name, *f.metadata.get(_ALIASES, ())):
                self.index.setdefault(name, []).append(path)
            tp = hints[f.name]
            inner = self._section_of(tp)
            if inner is not None:
                self._index(inner, path + ".")

    @staticmethod
    def _section_of(tp: Any) -> type | None:
        if _is_section(tp):
            return tp
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin in (list, tuple) and args:
            return _Structurer._section_of(args[0])
        if origin in (typing.Union, types.UnionType):
            for a in args:
                if _is_section(a):
                    return a
        return None

    def unknown_key(self, cls: type, key: str, path: str, value: Any = None) -> ConfigError:
        known = []
        for f in attrs.fields(cls):
            known.extend((f.name, *f.metadata.get(_ALIASES, ())))
        full = f"{path}.{key}" if path else key
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        named = self.hint(key, value) if self.hint is not None else None
        if named:
            hint = named
        elif close:
            hint = f"did you mean '{path + '.' if path else ''}{close[0]}'?"
        elif key in self.index:
            places = " or ".join(f"'{p}'" for p in self.index[key])
            hint = f"this key belongs at {places}; move it to that table"
        else:
            table = f"[{path}]" if path else "the top level"
            hint = f"valid keys in {table}: {', '.join(sorted(known))}"
        return ConfigError(f"unknown config key '{full}': {hint}")

    def structure(self, cls: type, data: Any, path: str) -> Any:
        if not isinstance(data, Mapping):
            raise ConfigError(f"'{path}' must be a table, got {_fmt(data)}")
        hints = typing.get_type_hints(cls)
        by_name: dict[str, attrs.Attribute] = {}
        for f in attrs.fields(cls):
            by_name[f.name] = f
            for alias in f.metadata.get(_ALIASES, ()):
                by_name[alias] = f
        kwargs: dict[str, Any] = {}
        extra_field = getattr(cls, "__wantrain_extra__", None)
        extras: dict[str, Any] = {}
        for key, value in data.items():
            f = by_name.get(key)
            if f is None and extra_field is not None:
                extras[key] = value  # the section validates these itself (e.g. an external class's arguments)
                continue
            if f is None:
                self.fail(f"{path}.{key}" if path else key, str(self.unknown_key(cls, key, path, value)))
                continue
            key_path = f"{path}.{key}" if path else key
            if f.name in kwargs:
                self.fail(key_path, f"config key '{key_path}' is given twice (once under another accepted name)")
                continue
            before = len(self.errors)
            try:
                kwargs[f.name] = self.value(hints[f.name], value, key_path, f)
                problem = f.validator.problem(kwargs[f.name]) if isinstance(f.validator, _Checks) else None
                if problem is not None:  # its range, choices or rule: found here too, beside the other problems
                    raise InvalidValue(section_key(cls), f.name, *problem).at(key_path)
            except ConfigError as exc:  # every key is read: the report names each problem at once
                self.fail(key_path, str(exc))
            if len(self.errors) > before and (not attrs.has(type(kwargs.get(f.name))) or f.name not in kwargs):
                # the key is wrong (or its table could not be built): the section takes its default; a table built
                # from its valid keys stays (its wrong keys are named, and the rules reading them dropped)
                kwargs.pop(f.name, None)
                self.error_keys[before:] = [k if k.startswith(key_path) else key_path for k in self.error_keys[before:]]
        if extra_field is not None:
            kwargs[extra_field] = {**kwargs.get(extra_field, {}), **extras}
        if self.errors:
            # a document with problems: the section is built from its valid keys (defaults for the others) so that
            # the rules across keys report too; a rule reading a wrong key is dropped (:func:`structure`)
            try:
                return cls(**kwargs)
            except Exception:  # noqa: BLE001 -- a rule that raises, not states problems: the key problems report
                self.fail(path, "")
                return None
        try:
            return cls(**kwargs)
        except InvalidValue as exc:  # a key's own check (its attrs validator): name it by its path here
            problem = exc.at(f"{path}.{exc.field}" if path else exc.field)
        except ConfigError as exc:
            problem = exc
        except (ValueError, TypeError) as exc:
            problem = ConfigError(f"[{path or 'config'}]: {exc}")
        if not path:
            raise problem
        self.fail(path, str(problem))  # a section that refuses itself: the others are still read and judged
        return None

    def fail(self, key: str, message: str) -> None:
        """Record one problem of the document at ``key`` (an empty message marks ``key`` as unreliable only)."""
        self.errors.append(message)
        self.error_keys.append(key)

    def reads_wrong_key(self, problem: Any, bad_values: Sequence[str] = ()) -> bool:
        """Whether ``problem`` (a rule across keys) reads a key the document got wrong (its default stood in), or
        one of ``bad_values`` (keys a section refused the value of: the rule would judge that value)."""
        wrong = [_unindexed(k) for k in (*self.error_keys, *bad_values) if k]
        keys = [_unindexed(k) for k in problem.keys]
        return any(k == w or k.startswith(w + ".") or w.startswith(k + ".") for k in keys for w in wrong) \
            or "" in self.error_keys

    def value(self, tp: Any, value: Any, path: str, f: attrs.Attribute | None = None) -> Any:
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            non_none = [a for a in args if a is not type(None)]
            if value is None and len(non_none) < len(args):
                return None
            errors = []
            for a in non_none:
                try:
                    return self.value(a, value, path, f)
                except ConfigError as exc:
                    errors.append(exc)
            tables = [e for a, e in zip(non_none, errors, strict=True) if _is_section(a)]
            if isinstance(value, Mapping) and len(tables) == 1:
                raise tables[0]  # a table given where a table is valid: its own error (an unknown key, a range)
            if len(errors) == 1:
                raise errors[0]
            raise ConfigError(f"config key '{path}' = {_fmt(value)} has the wrong type; expected {_type_name(tp)}")
        if _is_section(tp):
            return self.structure(tp, value, path)
        if origin in (list, tuple):
            if not isinstance(value, list | tuple):
                named = self.hint(path.rsplit(".", 1)[-1], value) if self.hint is not None else None
                raise ConfigError(f"config key '{path}' = {_fmt(value)} has the wrong type; expected a list"
                                  + (f"; {named}" if named else ""))  # a peer's file where a list goes
            item_tp = args[0] if args else Any
            items = [self.value(item_tp, v, f"{path}[{i}]", f) for i, v in enumerate(value)]
            return tuple(items) if origin is tuple else items
        if origin is dict or tp is dict:
            if not isinstance(value, Mapping):
                raise ConfigError(f"config key '{path}' must be a table, got {_fmt(value)}")
            return dict(value)
        if tp is Any:
            return value
        if origin is Literal:
            if value not in args:
                close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                named = self.hint(path.rsplit(".", 1)[-1], value) if self.hint is not None else None
                hint = f"; {named}" if named else hint  # another trainer's spelling: what it is here
                raise ConfigError(
                    f"config key '{path}' = {_fmt(value)} is not valid; expected one of "
                    f"{', '.join(repr(a) for a in args)}{hint}"
                )
            return value
        if tp is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"config key '{path}' = {_fmt(value)} has the wrong type; expected true or false")
            return value
        if tp is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"config key '{path}' = {_fmt(value)} has the wrong type; expected an integer")
            return value
        if tp is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"config key '{path}' = {_fmt(value)} has the wrong type; expected a number")
            return float(value)
        if tp is str:
            if not isinstance(value, str):
                raise ConfigError(f"config key '{path}' = {_fmt(value)} has the wrong type; expected a string")
            return value
        if tp is Path:
            if not isinstance(value, str):
                raise ConfigError(f"config key '{path}' = {_fmt(value)} has the wrong type; expected a path string")
            if not value.strip():
                # Path("") is ".", the current folder: never what an empty value meant
                raise ConfigError(f"config key '{path}' = {value!r} is empty; expected a file or folder path")
            try:
                # before anything treats "~/data" as relative (resolve_paths would make it <config folder>/~/data)
                return Path(value).expanduser()
            except RuntimeError:
                raise ConfigError(
                    f"config key '{path}' = {value!r}: cannot expand '{value.split('/')[0]}' (no such user or no "
                    "home folder); write the full path"
                ) from None
        raise TypeError(f"unsupported config type {tp!r} at {path}")  # a schema bug, not a user error


def structure(root: type, data: Mapping[str, Any],
              hint: typing.Callable[[str, Any], str | None] | None = None, *, found: Sequence[Problem] = ()) -> Any:
    """Build the section ``root`` from a parsed TOML document; raises :class:`ConfigError` (one line; a
    :class:`~wantrain.core.problems.Refused` carrying each problem). ``hint(key, value)`` names an unknown key's
    meaning when it knows it (another trainer's name for a key), before any did-you-mean, and a choice's value that
    another trainer spells so (``timestep_sampling = "shift"``). Every unknown key, wrong type and out-of-range
    value of the document is reported at once, with the problems ``found`` before (peer keys the caller knows) and
    those of the rules across keys (each section's :func:`~wantrain.core.problems.refuse`) that read only valid
    keys: a rule reading a wrong key would judge its default instead."""
    walker = _Structurer(root, hint)
    with collecting() as rules:
        try:
            built = walker.structure(root, data, "")
        except ConfigError as exc:
            walker.fail("", str(exc))
    bad_values = [k for p in rules if p.rule == VALUE for k in p.keys]  # a section's own refusal of a value
    problems = [*found, *(Problem(keys=(key,) if key else (), what=message)
                          for key, message in zip(walker.error_keys, walker.errors, strict=True) if message),
                *(p for p in rules if not walker.reads_wrong_key(p, () if p.rule == VALUE else bad_values))]
    if problems:
        raise Refused(dict.fromkeys(problems))  # a section built twice (evolved by a rule) reports once
    return built


def key_places(root: type) -> dict[str, list[str]]:
    """Every key name of the schema under ``root`` (and its accepted other names) -> the full keys it is
    (``"lr"`` -> ``["optimizer.lr"]``)."""
    return _Structurer(root).index


def _collected(errors: list[str]) -> None:
    """Raise the problems found: one as its line, several as a count and a line each."""
    messages = [e for e in errors if e]
    if messages:
        raise Refused(Problem(keys=(), what=e) for e in messages)


def check_value(owner: type, name: str, value: Any, path: str) -> Any:
    """Validate one value against the declared key ``owner.name`` (used for ``--set`` and by tests)."""
    f = attrs.fields_dict(owner)[name]
    walker = _Structurer(owner)
    value = walker.value(typing.get_type_hints(owner)[name], value, path, f)
    _collected(walker.errors)  # a table's keys (a list of [[data.datasets]]): every problem at once
    if isinstance(f.validator, _Checks):
        problem = f.validator.problem(value)
        if problem is not None:
            raise InvalidValue(section_key(owner), name, *problem).at(path)
    return value


def unstructure(obj: Any) -> Any:
    """The plain-data form of a section tree (for writing the resolved config); ``None`` values are dropped."""
    if attrs.has(type(obj)):
        out = {}
        extra_field = getattr(type(obj), "__wantrain_extra__", None)
        for f in attrs.fields(type(obj)):
            v = unstructure(getattr(obj, f.name))
            if f.name == extra_field:
                out.update(v or {})  # written back as the user wrote them: keys of the table itself
            elif v is not None:
                out[f.name] = v
        return out
    if isinstance(obj, list | tuple):
        return [unstructure(v) for v in obj]
    if isinstance(obj, dict):
        return {k: unstructure(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def _takes_plain_values(tp: Any) -> bool:
    """Whether a key whose type holds a section also takes plain values (``list[str | Section]``)."""
    if typing.get_origin(tp) in (list, tuple) and typing.get_args(tp):
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return False
    return any(not _is_section(a) and a is not type(None) for a in typing.get_args(tp))


def config_reference(root: type, title_prefix: str = "") -> str:
    """Markdown tables documenting every key: name, type, default and meaning, one table per section."""
    lines: list[str] = []

    def walk(cls: type, path: str) -> None:
        hints = typing.get_type_hints(cls)
        rows = []
        subsections = []
        extra_field = getattr(cls, "__wantrain_extra__", None)
        for f in attrs.fields(cls):
            if f.name == extra_field:
                continue
            tp = hints[f.name]
            inner = _Structurer._section_of(tp)
            if inner is not None:
                is_list = typing.get_origin(tp) in (list, tuple)
                subsections.append((f, inner, is_list))
                if not _takes_plain_values(tp):
                    continue
            if f.default is NOTHING:
                default = "required"
            elif isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
                default = f"`{_fmt(f.default.factory())}`"
            else:
                default = "unset" if f.default is None else f"`{_fmt(f.default)}`"
            extra = []
            if f.metadata.get(_RANGE) is not None:
                extra.append(f"range: {f.metadata[_RANGE].describe()}")
            if f.metadata.get(_CHOICES):
                extra.append("one of " + ", ".join(f"`{c}`" for c in f.metadata[_CHOICES]))
            if f.metadata.get(_RULE) is not None:
                extra.append(f"valid: {f.metadata[_RULE].describe}")
            if f.metadata.get(_ALIASES):
                extra.append("also accepted as " + ", ".join(f"`{a}`" for a in f.metadata[_ALIASES]))
            doc = f.metadata.get(_DOC, "")
            if extra:
                doc += " (" + "; ".join(extra) + ")"
            rows.append(f"| `{f.name}` | {_type_name(tp)} | {default} | {doc} |")
        if rows:
            lines.append(f"## `[{path}]`" if path else "## top level")
            lines.append("")
            if cls.__doc__:
                lines.append(" ".join(cls.__doc__.split()))
                lines.append("")
            lines.append("| key | type | default | meaning |")
            lines.append("|---|---|---|---|")
            lines.extend(rows)
            lines.append("")
        for f, inner, is_list in subsections:
            sub = f"{path}.{f.name}" if path else f.name
            walk(inner, f"[{sub}]" if is_list else sub)

    walk(root, "")
    return "\n".join(lines)
