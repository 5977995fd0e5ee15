"""``$where``: the small subset of JavaScript predicates the simulator can run without a JS engine.

mongod runs ``$where`` with its embedded JavaScript engine. The simulator evaluates
only an expression (or ``function() { return <expression>; }``) built from
``this.<dotted.path>``, number, string, ``true``/``false``/``null`` literals, the
comparisons ``< <= > >= == === != !==``, ``&&``, ``||``, ``!`` and parentheses; anything
else fails with BadValue (2) naming what is not supported. Code with scope fails as on
4.4+ (mongod removed it from ``$where``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from bson.code import Code

from ..core.errors import CommandError

_TOKEN = re.compile(
    r"\s*(?:(?P<path>this(?:\.[A-Za-z_$][\w$]*)+)|(?P<num>-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
    r"|(?P<str>'[^'\\]*'|\"[^\"\\]*\")|(?P<word>true|false|null)"
    r"|(?P<op>===|!==|==|!=|<=|>=|&&|\|\||[<>!()]))"
)
_FUNCTION = re.compile(r"^\s*function\s*\(\s*\)\s*\{\s*return\s+(.*?);?\s*\}\s*$", re.S)
_OPS = {"===": "==", "!==": "!=", "&&": " and ", "||": " or ", "!": " not "}
_WORDS = {"true": "True", "false": "False", "null": "None"}
_MISSING = object()


def _unsupported(code: str, why: str) -> CommandError:
    return CommandError(
        2,
        f"$where {code!r} is not supported by the simulator ({why}): it runs only "
        "comparisons of this.<field> with literals joined by &&, || and !",
    )


def compile_where(value: Any) -> Callable[[dict[str, Any]], bool]:
    """A predicate for a ``$where`` value, or BadValue when it is outside the subset."""
    if isinstance(value, Code):
        if value.scope is not None:
            raise CommandError(2, "$where no longer supports deprecated BSON type CodeWScope")
        value = str(value)
    if not isinstance(value, str):
        raise CommandError(2, "$where got bad type")
    source = value
    function = _FUNCTION.match(source)
    if function:
        source = function.group(1)
    parts: list[str] = []
    paths: list[list[str]] = []
    pos = 0
    source = source.strip()
    while pos < len(source):
        match = _TOKEN.match(source, pos)
        if match is None or match.end() == pos:
            raise _unsupported(value, f"at {source[pos : pos + 20]!r}")
        pos = match.end()
        kind = match.lastgroup
        text = match.group(kind or "")
        if text == "(" and parts and parts[-1] not in ("(", " not ", " and ", " or "):
            raise _unsupported(value, "calls are not supported")
        if kind == "path":
            paths.append(text.split(".")[1:])
            parts.append(f"_v[{len(paths) - 1}]")
        elif kind == "word":
            parts.append(_WORDS[text])
        elif kind == "op":
            parts.append(_OPS.get(text, text))
        else:
            parts.append(text)
    expression = "".join(parts)
    try:
        code = compile(expression, "<$where>", "eval")
    except SyntaxError:
        raise _unsupported(value, "not an expression") from None

    def predicate(doc: dict[str, Any]) -> bool:
        values = [_lookup(doc, path) for path in paths]
        try:
            return bool(eval(code, {"__builtins__": {}}, {"_v": values}))  # only whitelisted tokens
        except TypeError:
            return False  # JavaScript compares mismatched types as false

    return predicate


def _lookup(doc: Any, path: list[str]) -> Any:
    for part in path:
        if not isinstance(doc, dict) or part not in doc:
            return None  # undefined; compared as null
        doc = doc[part]
    return doc
