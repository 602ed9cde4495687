"""One escaping function for user-controlled text on its way to a terminal or a table.

Layer and module names, file names, model specs, class labels, safetensors metadata and notes
can hold anything: an ESC starts a terminal escape sequence (colours, cursor moves, titles,
hyperlinks), a newline splits a table row, a bidi override reorders what is read. `escape`
shows each such character as its Python escape (`\\x1b`, `\\n`, `\\u202e`), so what is
printed is what the text holds, one line, inert. Rich markup (`[bold]`) is kept literal by
the renderers handing Rich `Text` objects, never markup strings.

`markdown` and `csv_cell` add what those formats need on top; JSON stays raw (it is data).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# bidirectional controls: invisible, and they reorder the text around them
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_UNSAFE = frozenset(("Cc", "Cs", "Zl", "Zp"))  # controls, lone surrogates, line separators


def _char(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    if ch in _BIDI or unicodedata.category(ch) in _UNSAFE:
        code = ord(ch)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
    return ch


def escape(text: str) -> str:
    """text with every control character (C0, C1, DEL), line or paragraph separator, lone
    surrogate (an undecodable file name byte) and bidi control shown as its escape."""
    if text.isprintable():  # nearly always: nothing to do
        return text
    return "".join(_char(ch) for ch in text)


def few(items: Sequence[str], n: int = 3) -> str:
    """The first n items, comma-joined, and how many more there are: "a, b, c (+4 more)"."""
    shown = ", ".join(items[:n])
    return shown + (f" (+{len(items) - n} more)" if len(items) > n else "")


def markdown(text: str) -> str:
    """A Markdown table cell or line: escaped, `|` kept from ending the cell, and text, never
    markup: `&` and `<` as entities (a module named `<img onerror=…>` is no live HTML where the
    file is rendered), a leading `>` no quote, and `](` kept from making a link."""
    out = escape(text).replace("&", "&amp;").replace("<", "&lt;")
    out = out.replace("|", "\\|").replace("](", "]\\(")
    return "\\" + out if out.startswith(">") else out


_FORMULA = ("=", "+", "-", "@")


def csv_cell(text: str) -> str:
    """A CSV text cell: escaped, and a cell a spreadsheet would run as a formula (`=cmd|…`,
    `+…`, `-…`, `@…`) prefixed with `'`; a number (`-1.5`) is left a number."""
    out = escape(text)
    if out.startswith(_FORMULA):
        try:
            float(out)
        except ValueError:
            return "'" + out
    return out
