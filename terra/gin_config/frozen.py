"""Built objects frozen to the gin config they were built under: what gin cannot do.

The layers are plain Flax modules (``terra/gin_config/registration.py`` registers them with gin), but an
unevaluated reference (``EncoderDecoderTransformer.feed_forward = @SparseFeedForward``) hands the
model gin's registered form of the class, which reads gin's global bindings whenever it is called
(for a layer, when Flax initialises, applies or traces the model), and gin has no way to hand out
the class with the values in force at build time instead. :func:`freeze_configurables` replaces
each such form by a :class:`FrozenConfigurable` holding the values gin supplied at build time, in
the scope it supplied them (``MODEL/...`` bindings included). The models of ``terra.models``
freeze their network when they are constructed (so also where gin injects ``%MODEL``: the
trainer, the evaluator), and ``terra.gin_config.parsing.build_macro`` freezes what it builds. Parsing
another config afterwards (``terra.build``, ``terra.load``) then changes nothing in a model
already built. Only gin's public API is used.
"""

import copy
import dataclasses
import functools
import inspect
import sys
from typing import Optional, Sequence

import gin


class FrozenConfigurable:
    """A gin configurable class or function with the parameter values gin supplied when it was
    frozen: calling it calls the undecorated class or function with those values (a fresh deep
    copy per call, as gin passes them) and the caller's arguments, which win, as they do over
    gin. It reads nothing from gin, so a config parsed later does not reach it.

    It stands where the configurable stood: attributes (``__name__``, static methods such as
    ``params_read_per_token``) are the configurable's, it compares equal to (and hashes as)
    another with the same callable and values, deep-copies to itself and pickles when its
    callable and values do.

    Attributes:
      target: the undecorated class or function called.
      bindings: the parameter values passed (a copy).
      gin_scope: the gin scope they were read in (``'MODEL'``; ``''`` for none).
    """

    def __init__(self, target, bindings, gin_scope: str = ""):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_bindings", dict(bindings))
        object.__setattr__(self, "_gin_scope", gin_scope)

    @property
    def target(self):
        return self._target

    @property
    def bindings(self) -> dict:
        return dict(self._bindings)

    @property
    def gin_scope(self) -> str:
        return self._gin_scope

    @functools.cached_property
    def _signature(self) -> Optional[inspect.Signature]:
        try:
            return inspect.signature(self._target)
        except (TypeError, ValueError):
            return None

    def __call__(self, *args, **kwargs):
        values = copy.deepcopy(self._bindings)
        parameters = list(self._signature.parameters.values()) if self._signature else []
        positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][: len(args)]
        for name in positional:  # given positionally by the caller: gin's value gives way
            values.pop(name, None)
        values.update(kwargs)
        return self._target(*args, **values)

    def __getattr__(self, name):
        # Only reached for what the instance lacks; absent while unpickling.
        try:
            target = object.__getattribute__(self, "_target")
        except AttributeError:
            raise AttributeError(name) from None
        return getattr(target, name)

    def __setattr__(self, name, value):
        raise AttributeError(f"a FrozenConfigurable is immutable (setting {name!r})")

    def __eq__(self, other):
        if not isinstance(other, FrozenConfigurable):
            return NotImplemented
        try:
            return bool(self.target is other.target and self.bindings == other.bindings)
        except (TypeError, ValueError):  # values without a plain equality (arrays)
            return False

    def __hash__(self):
        return hash((self._target, _hashable(self._bindings)))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (FrozenConfigurable, (self._target, self._bindings, self._gin_scope))

    def __repr__(self) -> str:
        name = getattr(self._target, "__qualname__", repr(self._target))
        values = ", ".join(f"{k}={v!r}" for k, v in sorted(self._bindings.items()))
        scope = f" (gin scope {self._gin_scope!r})" if self._gin_scope else ""
        return f"<frozen gin configurable {name}({values}){scope}>"


def _hashable(value):
    if isinstance(value, dict):
        return tuple(sorted(((repr(k), _hashable(v)) for k, v in value.items()), key=lambda kv: kv[0]))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


_NO_BINDING = object()


def _is_reference(value) -> bool:
    """Whether ``value`` is a gin reference (``@name``, ``@name()``, ``%NAME``) of a parsed
    config, as ``gin.get_bindings(..., resolve_references=False)`` and ``gin.query_parameter``
    return them."""
    return isinstance(value, gin.config.ConfigurableReference)


def _is_macro(reference) -> bool:
    return reference.evaluate and reference.configurable.selector == "gin.macro"


def _raw_bindings(fn_or_selector, scope: Sequence[str]) -> dict:
    """gin's bindings of a configurable in ``scope`` (the scope's own, then its outer ones, then
    the unscoped), references unresolved; ``{}`` for what gin does not know."""
    try:
        with gin.config_scope(list(scope)):
            return gin.get_bindings(fn_or_selector, resolve_references=False)
    except ValueError:
        return {}


def _unscoped_configurable(fn_or_cls):
    """gin's configurable for ``fn_or_cls`` (its undecorated or decorated form) ignoring the
    current scope, or None."""
    try:
        with gin.config_scope(None):
            return gin.get_configurable(fn_or_cls)
    except (ValueError, TypeError, KeyError):
        return None


def _decorated_in_place(cls) -> TypeError:
    # Calling a class decorated in place reads gin whatever is passed to it, so there is no
    # undecorated class to freeze.
    return TypeError(
        f"{cls.__qualname__} is decorated with @gin.configurable, so a built model holding it would read the "
        "gin config in force whenever it is called; register it with gin.register instead (as "
        "terra/gin_config/registration.py registers terra's layers)."
    )


def _gin_wrapper_target(value):
    """For gin's form of a registered class or function (what ``@name`` or ``@scope/name``
    resolves to): the undecorated class or function, which is also what gin's bindings are looked
    up by; None for anything else (an undecorated class, a plain function, an object)."""
    if inspect.isclass(value):
        if _unscoped_configurable(value) is value:
            raise _decorated_in_place(value)
        if len(value.__bases__) == 1:
            base = value.__bases__[0]
            if _unscoped_configurable(base) is value:  # gin.register's subclass of ``base``
                return base
            scoped = type(value).__bases__ == (type(base),)  # a scope's subclass has a metaclass of its own
            if scoped and len(base.__bases__) == 1 and _unscoped_configurable(base.__bases__[0]) is base:
                return base.__bases__[0]
        return None
    wrapped = getattr(value, "__wrapped__", None) if callable(value) else None
    if wrapped is None:
        return None
    if _unscoped_configurable(value) is value:  # gin's wrapper of a function
        return wrapped
    if _unscoped_configurable(wrapped) is wrapped:  # a scope's wrapper of gin's wrapper
        return wrapped.__wrapped__
    return None


class _Freezer:
    """Walks an object gin built, with the bindings it was built from where they are known
    (to tell each configurable's scope), freezing every configurable found in it.

    Scopes follow gin's: the configurable a reference ``@name`` resolves to reads its
    bindings in the scope where it is called, here ``base_scope``, the scope of the build
    (the model's layers are first constructed by the model's checks while it is built); a
    scoped reference ``@scope/name`` reads them in its own scope; an evaluated reference
    ``@name()`` (and a macro) was called in the scope of the configurable whose value it is.
    """

    def __init__(self, base_scope: Sequence[str]):
        self.base_scope = list(base_scope)

    def frozen(self, target, scope: Sequence[str]) -> FrozenConfigurable:
        raw = _raw_bindings(target, scope)
        values = {name: self.value(binding, scope) for name, binding in raw.items()}
        return FrozenConfigurable(target, values, "/".join(scope))

    def reference(self, reference) -> FrozenConfigurable:
        configurable = reference.configurable
        if configurable.wrapped is configurable.wrapper:
            raise _decorated_in_place(configurable.wrapped)
        return self.frozen(configurable.wrapped, list(reference.scopes) or self.base_scope)

    def value(self, binding, scope: Sequence[str]):
        """A bound value as the frozen configurable passes it: references frozen or evaluated."""
        if _is_reference(binding):
            if _is_macro(binding):
                return self.value(self.macro_value(binding), binding.scopes)
            if not binding.evaluate:
                return self.reference(binding)
            with gin.config_scope(list(scope)):
                built = copy.deepcopy(binding)  # gin's evaluation of ``@name()``
            return self.built(built, scope, binding)
        if isinstance(binding, (list, tuple)) and not hasattr(binding, "_fields"):
            return type(binding)(self.value(v, scope) for v in binding)
        if isinstance(binding, dict):
            return {k: self.value(v, scope) for k, v in binding.items()}
        return binding

    @staticmethod
    def macro_value(reference):
        return gin.query_parameter("%" + "/".join(reference.scopes))

    def built(self, value, scope: Sequence[str], binding=_NO_BINDING):
        """``value`` (built by gin from ``binding`` in ``scope``, where known) with every
        configurable in it frozen; ``value`` itself when there is none."""
        while _is_reference(binding) and _is_macro(binding):
            binding, scope = self.macro_value(binding), list(binding.scopes)
        fields = None
        if _is_reference(binding):
            if not binding.evaluate and value is binding.scoped_configurable_fn:
                return self.reference(binding)
            if binding.evaluate:
                scope = list(binding.scopes) or scope
                fields = _raw_bindings(binding.configurable.selector, scope)
            binding = _NO_BINDING
        if isinstance(value, FrozenConfigurable):
            return value
        target = _gin_wrapper_target(value)
        if target is not None:
            # Not built from a binding seen here: read in the scope of the build (a scoped form
            # built outside the config, gin.get_configurable('scope/name'), loses its scope).
            return self.frozen(target, self.base_scope)
        if isinstance(value, functools.partial):
            func = self.built(value.func, scope)
            return value if func is value.func else functools.partial(func, *value.args, **value.keywords)
        if isinstance(value, (list, tuple)):
            same_length = isinstance(binding, (list, tuple)) and len(binding) == len(value)
            items = [self.built(v, scope, binding[i] if same_length else _NO_BINDING) for i, v in enumerate(value)]
            if all(new is old for new, old in zip(items, value)):
                return value
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        if isinstance(value, dict):
            known = binding if isinstance(binding, dict) else {}
            items = {k: self.built(v, scope, known.get(k, _NO_BINDING)) for k, v in value.items()}
            if all(items[k] is value[k] for k in value):
                return value
            return type(value)(items)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self.dataclass(value, scope, fields)
        return value

    def dataclass(self, value, scope: Sequence[str], fields: Optional[dict]):
        if fields is None:
            fields = _raw_bindings(type(value), scope)
        flax_linen = sys.modules.get("flax.linen")
        is_module = flax_linen is not None and isinstance(value, flax_linen.Module)
        changes = {}
        for field in dataclasses.fields(value):
            if not field.init or (is_module and field.name in ("parent", "name")):
                continue
            old = getattr(value, field.name)
            new = self.built(old, scope, fields.get(field.name, _NO_BINDING))
            if new is not old:
                changes[field.name] = new
        if not changes:
            return value
        return value.clone(**changes) if is_module else dataclasses.replace(value, **changes)


def freeze_configurables(value, *, reference=None, scope: Optional[Sequence[str]] = None):
    """``value`` with every gin configurable class or function reachable in it (in dataclass
    fields, Flax modules' included, nested, and in lists, tuples and dicts) replaced by a
    :class:`FrozenConfigurable` carrying the values gin supplies now, in the scope it would
    supply them: ``scope`` (default: the current one) for what ``@name`` resolved to, the
    reference's own for ``@scope/name``. References inside those values are frozen the same
    way. ``reference``: the gin reference ``value`` was built from, if known (as
    :func:`build_macro` knows it), to tell which scope each configurable came with. Objects
    other than those are left as they are; nothing is copied where nothing changes.
    """
    freezer = _Freezer(gin.current_scope() if scope is None else scope)
    return freezer.built(value, freezer.base_scope, _NO_BINDING if reference is None else reference)
