"""``nl.NKIObject``: the base class of user data classes passed to and between kernel helpers.

NKI's front end treats a subclass as a record: its declared fields are the annotated names and the
plain class attributes (``field = None``), in declaration order; an instance is built by keyword or
in field order, a declared field left out is None (or its class default), and an unknown keyword
is an error. ``@dataclass`` on such a class keeps this constructor (it never replaces an
``__init__`` the class defines) and sees every field, so equality and ``repr`` cover them all.
"""

from __future__ import annotations

import dataclasses
import typing

__all__ = ["NKIObject"]


def _is_plain_value(name, value) -> bool:
    """A class attribute that is a field: public, not a function/descriptor/class."""
    return not (name.startswith("_") or callable(value) or hasattr(value, "__get__")
                or isinstance(value, dataclasses.Field))


def _is_classvar(annotation) -> bool:
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return annotation is typing.ClassVar or typing.get_origin(annotation) is typing.ClassVar \
        or text.startswith(("ClassVar", "typing.ClassVar"))


class NKIObject:
    """Base class for user data classes (dataclass style); see the module docstring."""

    _nki_fields: tuple = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        notes = dict(own.get("__annotations__", {}))
        fields = [n for n, a in notes.items() if not _is_classvar(a)]
        for name, value in list(own.items()):
            if name not in notes and _is_plain_value(name, value):
                fields.append(name)
                if value.__class__.__hash__ is not None:      # dataclass refuses unhashable defaults
                    notes[name] = typing.Any
        for name in fields:
            if name not in own:
                setattr(cls, name, None)                      # a left-out field is None
        cls.__annotations__ = notes
        inherited = [f for f in cls._nki_fields if f not in fields]
        cls._nki_fields = tuple(inherited + fields)
        if "__init__" not in own and _inherits_record_init(cls):
            cls.__init__ = _record_init

    def __init__(self, **fields):
        for key, value in fields.items():
            setattr(self, key, value)


def _inherits_record_init(cls) -> bool:
    init = cls.__init__
    return init is NKIObject.__init__ or init is _record_init


def _record_init(self, *args, **kwargs):
    """Constructor of an NKIObject subclass: fields by position (declared order) or keyword."""
    cls = type(self)
    names = cls._nki_fields
    if len(args) > len(names):
        raise TypeError(f"{cls.__name__}() takes {len(names)} positional field(s), got {len(args)}")
    values = dict(zip(names, args))
    for key, value in kwargs.items():
        if key in values:
            raise TypeError(f"{cls.__name__}() got field {key!r} twice")
        if names and key not in names:
            raise TypeError(f"{cls.__name__}() got an unknown field {key!r} (fields: {', '.join(names)})")
        values[key] = value
    defaults = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    for name in names:
        if name not in values:
            values[name] = _default(cls, name, defaults.get(name))
    for key, value in values.items():
        object.__setattr__(self, key, value)                  # frozen dataclasses too
    post = getattr(self, "__post_init__", None)
    if post is not None:
        post()


def _default(cls, name, field):
    if field is not None and field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    value = getattr(cls, name, None)
    return copy_default(value)


def copy_default(value):
    """A fresh copy of a mutable class-level default (list/dict/set), the value itself otherwise."""
    return type(value)(value) if isinstance(value, (list, dict, set)) else value
