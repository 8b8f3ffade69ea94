"""gin text read as data, and gin's errors turned into messages that name the fix.

:func:`read_statements` reads a config's statements without resolving its references and
macros, so a config can be read (checked, or looked at before it is trusted) before the modules
it names are imported. :func:`explain_gin_error` adds the closest valid names to gin's message
for a misspelled configurable or parameter. Only gin's public API is used.
"""

import dataclasses
import difflib
import inspect
import re
import sys
import tokenize
from typing import Any, List, Optional, Tuple

import gin
from gin import config_parser

_UNKNOWN_PARAM = re.compile(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'")
_UNKNOWN_CONFIGURABLE = re.compile(r"No configurable matching (?:reference )?'@?([\w.]+)'")


class GinConfigError(ValueError):
    """A gin file or binding that cannot be applied; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class GinText:
    """A config already read from ``path`` (and checked there): gin parses ``text`` as it is and
    does not read the file again, so what was checked is what is parsed."""

    path: str
    text: str


@dataclasses.dataclass(frozen=True)
class Reference:
    """``@name`` or ``@name()`` in a value, left unresolved."""

    name: str
    evaluate: bool


@dataclasses.dataclass(frozen=True)
class MacroUse:
    """``%NAME`` in a value, left unresolved."""

    name: str


class _UnresolvedDelegate(config_parser.ParserDelegate):
    """Keeps references and macros as names: reading a text then needs none of the modules it
    names, and nothing is bound."""

    def configurable_reference(self, scoped_configurable_name, evaluate):
        return Reference(scoped_configurable_name, evaluate)

    def macro(self, macro_name):
        return MacroUse(macro_name)


def read_statements(text_or_file) -> List[Any]:
    """gin's statements (``BindingStatement``, ``IncludeStatement``, ...) of a text or an open
    file, values as Python literals with :class:`Reference` and :class:`MacroUse` in them. A text
    gin cannot read raises ``SyntaxError`` (gin's own, or for an unclosed bracket, which
    Python's tokenizer reports as a ``TokenError``)."""
    try:
        return list(config_parser.ConfigParser(text_or_file, _UnresolvedDelegate()))
    except tokenize.TokenError as e:
        opened = _left_open(text_or_file)
        where = " (an unclosed bracket or quote?)"
        if opened:
            where = f": the {opened[0]} on line {opened[1]} is never closed"
        raise SyntaxError(f"{e.args[0]}{where}") from None
    except SyntaxError as e:  # gin's, at the line where it gave up: name a bracket left open before it
        opened = _left_open(text_or_file)
        if opened is None or e.lineno is None or opened[1] >= e.lineno:
            raise
        message = f"the {opened[0]} on line {opened[1]} is never closed (gin gave up on line {e.lineno})"
        raise SyntaxError(message) from None


def _left_open(text_or_file) -> Optional[Tuple[str, int]]:
    """:func:`unclosed` of a text, or of a file read again from its start (None if it cannot be)."""
    if isinstance(text_or_file, str):
        return unclosed(text_or_file)
    try:
        text_or_file.seek(0)
        return unclosed(text_or_file.read())
    except (OSError, ValueError, AttributeError):
        return None


_CLOSING = {")": "(", "]": "[", "}": "{"}


def unclosed(text: str) -> Optional[Tuple[str, int]]:
    """``(what, line)`` of the first bracket (``'['``) or string (``string``) that ``text`` opens
    and never closes, outside comments and strings; None when everything closes. Python's tokenizer
    only reports the end of the file it reached looking for the close."""
    stack: List[Tuple[str, int]] = []
    quote, quote_line, line, i = None, 0, 1, 0
    while i < len(text):
        c = text[i]
        if quote is not None:
            if text.startswith(quote, i):
                i, quote = i + len(quote), None
                continue
            if c == "\\" and i + 1 < len(text):
                line += text[i + 1] == "\n"
                i += 2
                continue
            line += c == "\n"
            i += 1
            continue
        if c == "#":
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
            continue
        if c in "'\"":
            quote = text[i : i + 3] if text.startswith(c * 3, i) else c
            quote_line = line
            i += len(quote)
            continue
        if c in "([{":
            stack.append((f"'{c}'", line))
        elif c in _CLOSING and stack and stack[-1][0] == f"'{_CLOSING[c]}'":
            stack.pop()
        line += c == "\n"
        i += 1
    if stack:
        return stack[0]
    return ("string", quote_line) if quote is not None else None


def _configurable_names() -> List[str]:
    """Short names of terra's gin configurables, for suggestions: every public class or function
    of a loaded terra module that gin resolves (gin has no public listing of its registry)."""
    names = set()
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("terra.") or module is None:
            continue
        for attr, value in vars(module).items():
            if attr.startswith("_") or attr in names or not (inspect.isclass(value) or inspect.isfunction(value)):
                continue
            try:
                gin.get_configurable(attr)
            except ValueError:
                continue
            names.add(attr)
    return sorted(names)


def configurable_target(selector: str):
    """What gin calls for ``selector``, undecorated: for a registered class the class itself, not
    gin's subclass of it (whose signature is ``(*args, **kwargs)``). ValueError for a name gin
    does not know."""
    fn = gin.get_configurable(selector)
    if inspect.isclass(fn) and len(fn.__bases__) == 1:
        try:
            if gin.get_configurable(fn.__bases__[0]) is fn:
                return fn.__bases__[0]
        except ValueError:  # an ordinary base class
            pass
    return fn


def _parameter_names(selector: str) -> List[str]:
    try:
        fn = configurable_target(selector)
        return list(inspect.signature(fn).parameters)
    except (ValueError, TypeError):
        return []


def explain_gin_error(error: Exception, where: str) -> GinConfigError:
    """Turns a gin parse or call error into a message that names the fix."""
    message = str(error).strip()
    hint = ""
    match = _UNKNOWN_PARAM.search(message)
    if match:
        names = _parameter_names(match.group(1))
        close = difflib.get_close_matches(match.group(2), names, n=3)
        if close:
            hint = f"Did you mean {' or '.join(repr(c) for c in close)}? "
        if names:
            hint += f"Parameters of {match.group(1)}: {', '.join(n for n in names if n != 'self')}."
    match = _UNKNOWN_CONFIGURABLE.search(message)
    if match:
        close = difflib.get_close_matches(match.group(1).split(".")[-1], _configurable_names(), n=3)
        if close:
            hint = f"Did you mean {' or '.join(repr(c) for c in close)}?"
    text = f"Invalid gin configuration ({where}): {message}"
    return GinConfigError(text + (f"\n  {hint}" if hint else ""))
