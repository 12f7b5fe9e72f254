"""Schema-aware typing of glm47 tool-call argument values (spec/chat_api.md §2.2).

The model writes every argument value as bare text: strings verbatim, everything else
`json.dumps`-ed, so `"2"` and `2` look the same and the request's tool schema decides the type:

* a parameter whose schema allows only strings keeps the raw text verbatim (`{"a":1}`, `[1,2]`,
  `001`, `true` stay strings);
* otherwise the text is tried as JSON, then JSON-unescaped JSON (`{\\"a\\": 1}`), then a Python
  literal (`True`, `None`, single quotes); the first candidate that fits one of the allowed
  non-string types wins. `integer` takes `3` and `3.0` but not `1.5`; `number` takes int or float;
* nothing fits: the raw text if `string` is allowed, else the first parsed candidate (so
  `"1.5"` for an integer stays the number 1.5, never truncated), else the raw text;
* no usable schema (unknown parameter, no `type` anywhere): JSON, else the raw text. Python
  literals are not tried there, because without a declared type `None`/`True` is as likely
  meant to be text.

`$ref` (local `#/...` pointers into the tool's `parameters`), `anyOf`/`oneOf` (union of the
branches), `allOf` (intersection), `enum`/`const` (types of the listed values) and bare
`properties`/`items` (object/array) are resolved to a set of JSON type names.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

STRING_ONLY = frozenset({"string"})
_NON_STRING_TYPES = ("null", "boolean", "integer", "number", "array", "object")
_MAX_SCHEMA_DEPTH = 32
_MISSING: Any = object()


def json_type(value: Any) -> str:
    """JSON Schema type name of a Python JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def schema_types(schema: Any, root: Mapping[str, Any], depth: int = 0) -> frozenset[str]:
    """Allowed JSON type names of `schema`; empty means "anything" (no usable type information)."""
    if not isinstance(schema, Mapping) or depth > _MAX_SCHEMA_DEPTH:
        return frozenset()
    if isinstance(schema.get("$ref"), str):
        return schema_types(_resolve_ref(root, schema["$ref"]), root, depth + 1)
    if "const" in schema:
        return frozenset({json_type(schema["const"])})
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return frozenset(json_type(v) for v in schema["enum"])
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset({declared})
    if isinstance(declared, list):
        return frozenset(t for t in declared if isinstance(t, str))
    return _combined_types(schema, root, depth)


def _branches(schema: Mapping[str, Any], keyword: str) -> list:
    """The subschemas of a combinator (none where a client sent something else than a list)."""
    value = schema.get(keyword)
    return value if isinstance(value, list) else []


def _combined_types(schema: Mapping[str, Any], root: Mapping[str, Any], depth: int) -> frozenset:
    branches = _branches(schema, "anyOf") + _branches(schema, "oneOf")
    if branches:
        sets = [schema_types(b, root, depth + 1) for b in branches]
        # NOTE: one untyped branch admits anything, so the union is unconstrained too.
        return frozenset() if not all(sets) else frozenset().union(*sets)
    all_of = [s for s in (schema_types(b, root, depth + 1) for b in _branches(schema, "allOf"))
              if s]
    if all_of:
        return frozenset.intersection(*all_of) or frozenset().union(*all_of)
    if "properties" in schema:
        return frozenset({"object"})
    return frozenset({"array"}) if "items" in schema else frozenset()


def _resolve_ref(root: Mapping[str, Any], ref: str) -> Any:
    if not ref.startswith("#"):
        return None
    node: Any = root
    for part in filter(None, ref[1:].split("/")):
        key = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def coerce_value(raw: str, types: frozenset[str]) -> Any:
    """Typed value for the raw argument text, given the parameter's allowed types."""
    if types == STRING_ONLY:
        return raw
    if not types:
        value = _load_json(raw.strip())
        return raw if value is _MISSING else value
    first = _MISSING
    for value in _candidates(raw.strip()):
        first = value if first is _MISSING else first
        for name in _NON_STRING_TYPES:
            typed = _as_type(value, name) if name in types else _MISSING
            if typed is not _MISSING:
                return typed
    if "string" in types or first is _MISSING:
        return raw
    return first


def _candidates(text: str) -> Iterator[Any]:
    value = _load_json(text)
    if value is not _MISSING:
        yield value
    unescaped = _load_json(f'"{text}"') if "\\" in text else _MISSING
    if isinstance(unescaped, str):
        value = _load_json(unescaped.strip())
        if value is not _MISSING:
            yield value
    value = _load_literal(text)
    if value is not _MISSING:
        yield value


def _as_type(value: Any, name: str) -> Any:
    """`value` converted to JSON type `name`, or _MISSING when it does not fit."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "null":
        return None if value is None else _MISSING
    if name == "boolean":
        return value if isinstance(value, bool) else _MISSING
    if name == "integer":
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value if is_number and isinstance(value, int) else _MISSING
    if name == "number":
        return value if is_number else _MISSING
    if name == "array":
        return value if isinstance(value, list) else _MISSING
    return value if isinstance(value, dict) else _MISSING


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not JSON")


def _finite_float(text: str) -> float:
    """A JSON number as a float, refused where it overflows (1e400 would be written back as
    Infinity, which is not JSON)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a float")
    return value


def _load_json(text: str) -> Any:
    """The JSON value of `text`, or _MISSING where it is not JSON or holds what could not be
    written back as JSON (NaN, Infinity, numbers past a float's range)."""
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError):
        return _MISSING


def _load_literal(text: str) -> Any:
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _MISSING
    return _to_json_value(value)


def _to_json_value(value: Any) -> Any:
    """A Python literal as a JSON-compatible value (tuples become lists), or _MISSING."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _MISSING
    if isinstance(value, (list, tuple)):
        items = [_to_json_value(v) for v in value]
        return _MISSING if any(v is _MISSING for v in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        fields = {k: _to_json_value(v) for k, v in value.items()}
        return _MISSING if any(v is _MISSING for v in fields.values()) else fields
    return _MISSING


class ToolRegistry:
    """Function names and parameter schemas of one request's `tools`.

    `tools=None` disables name validation (any non-empty name is accepted, values are typed
    without a schema); a list, even an empty one, accepts only the names it declares.
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None) -> None:
        self._params: dict[str, Mapping[str, Any]] | None = None
        if tools is not None:
            self._params = dict(_iter_tools(tools))

    def is_known(self, name: str) -> bool:
        return bool(name) and (self._params is None or name in self._params)

    def param_types(self, name: str, key: str) -> frozenset[str]:
        root = self._root(name)
        props = root.get("properties")
        schema = props.get(key) if isinstance(props, Mapping) else None
        if schema is None and isinstance(root.get("additionalProperties"), Mapping):
            schema = root["additionalProperties"]
        return schema_types(schema, root)

    def is_string_param(self, name: str, key: str) -> bool:
        return self.param_types(name, key) == STRING_ONLY

    def coerce(self, name: str, key: str, raw: str) -> Any:
        return coerce_value(raw, self.param_types(name, key))

    def sole_param(self, name: str) -> str | None:
        """The parameter a keyless `<arg_value>` belongs to: the only property, else the only
        required one, else None."""
        root = self._root(name)
        props = root.get("properties")
        if isinstance(props, Mapping) and len(props) == 1:
            return next(iter(props))
        required = root.get("required")
        if isinstance(required, list) and len(required) == 1 and isinstance(required[0], str):
            return required[0]
        return None

    def _root(self, name: str) -> Mapping[str, Any]:
        return (self._params or {}).get(name) or {}


def _iter_tools(tools: Sequence[Mapping[str, Any]]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for tool in tools:
        function = tool.get("function")
        spec = function if isinstance(function, Mapping) else tool
        name = spec.get("name")
        params = spec.get("parameters")
        if isinstance(name, str):
            yield name, params if isinstance(params, Mapping) else {}
