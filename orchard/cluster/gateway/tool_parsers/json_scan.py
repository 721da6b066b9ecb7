"""How far a JSON value reaches in text that may still be arriving.

Tool-call parsers stream a call's arguments as the model writes them, so they must tell a
value that is incomplete (the text ends inside it: wait) from one that is malformed (give
up on the call). `json.loads` tells neither; these helpers do, without building values.
"""

from __future__ import annotations

import json
import re

_WS = " \t\r\n"
_PRIMITIVE = set("0123456789+-.eEtrufalsn")
_CLOSERS = {"{": "}", "[": "]"}


class Malformed(ValueError):
    """The text cannot be the start of a JSON value."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # the unrolled loop: runs of plain characters at C speed
_STRUCTURE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|"|[{}\[\]]')  # whole strings, an unclosed quote, brackets


def string_end(text: str, i: int) -> int | None:
    """The index after the string starting at text[i] (a quote); None when the text ends first."""
    m = _STRING.match(text, i)
    return m.end() if m else None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at text[i]; None when the text ends first."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in _CLOSERS:
        return _nested_end(text, i)
    if c not in _PRIMITIVE:
        raise Malformed(f"unexpected {c!r} at {i}")
    j = i
    while j < len(text) and text[j] in _PRIMITIVE:
        j += 1
    return None if j == len(text) else j


def _nested_end(text: str, i: int) -> int | None:
    stack: list[str] = []
    for m in _STRUCTURE.finditer(text, i):
        token = m.group()
        if token == '"':
            return None  # a string still arriving
        if token[0] == '"':
            continue
        if token in _CLOSERS:
            stack.append(_CLOSERS[token])
        elif not stack or token != stack.pop():
            raise Malformed(f"mismatched {token!r} at {m.start()}")
        elif not stack:
            return m.end()
    return None


class ObjectScan:
    """The top-level fields of a JSON object seen so far: each key's value span."""

    def __init__(self, text: str):
        self.text = text
        self.spans: dict[str, tuple[int, int | None]] = {}
        self.end: int | None = None  # index after the closing brace, once it has arrived

    def raw(self, key: str) -> str | None:
        """The value's text so far (a prefix of its final text), None if the key has not begun."""
        if key not in self.spans:
            return None
        start, end = self.spans[key]
        return self.text[start:end] if end is not None else self.text[start:]

    def complete(self, key: str) -> bool:
        return key in self.spans and self.spans[key][1] is not None

    def string(self, key: str) -> str | None:
        """The decoded value of a string field, once it is complete."""
        raw = self.raw(key)
        if raw is None or not self.complete(key) or not raw.startswith('"'):
            return None
        return json.loads(raw)


def scan_object(text: str, i: int) -> ObjectScan:
    """Scan the object starting at text[i] (a brace). Raises Malformed."""
    scan = ObjectScan(text)
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return scan
        if text[j] == "}":
            scan.end = j + 1
            return scan
        if scan.spans:
            if text[j] != ",":
                raise Malformed(f"expected ',' at {j}")
            j = skip_ws(text, j + 1)
            if j >= len(text):
                return scan
        if text[j] != '"':
            raise Malformed(f"expected a key at {j}")
        key_end = string_end(text, j)
        if key_end is None:
            return scan
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return scan
        if text[j] != ":":
            raise Malformed(f"expected ':' at {j}")
        j = skip_ws(text, j + 1)
        end = value_end(text, j) if j < len(text) else None
        scan.spans[key] = (j, end)
        if end is None:
            return scan
        j = end
