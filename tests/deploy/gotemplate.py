"""A small Go-template renderer for the subset the spotguard chart uses, for machines without helm.

Supported: text/template whitespace trimming (`{{-`, `-}}`), comments, `define`,
`if`/`else`/`end`, `with`/`end`, pipelines (`a | b`), field chains (`.Values.x.y`,
`.`), string/number/bool literals, and the functions `include`, `toYaml`,
`nindent`, `indent`, `quote`, `default`, `trunc`, `trimSuffix`, `printf`. Anything
else raises, so a template that strays beyond this subset fails the test loudly
instead of rendering wrong.
"""

from __future__ import annotations

import re
import shlex
from typing import Any, Callable

import yaml

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)


class TemplateError(ValueError):
    pass


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    for m in _ACTION.finditer(text):
        chunk = text[pos:m.start()]
        if m.group(1):
            chunk = chunk.rstrip()
        out.append(("text", chunk))
        out.append(("action", m.group(2).strip()))
        pos = m.end()
        if m.group(3):
            rest = text[pos:]
            pos += len(rest) - len(rest.lstrip())
    out.append(("text", text[pos:]))
    return out


def _parse(tokens: list[tuple[str, str]], i: int, stop: tuple[str, ...]) -> tuple[list[Any], int, str]:
    """Nodes until one of `stop` keywords; returns (nodes, next index, the stop keyword)."""
    nodes: list[Any] = []
    while i < len(tokens):
        kind, val = tokens[i]
        i += 1
        if kind == "text":
            nodes.append(("text", val))
            continue
        if val.startswith("/*"):
            continue
        word = val.split(None, 1)[0] if val else ""
        if word in stop:
            return nodes, i, val
        if word in ("if", "with"):
            body, i, end = _parse(tokens, i, ("else", "end"))
            other: list[Any] = []
            if end == "else":
                other, i, _ = _parse(tokens, i, ("end",))
            nodes.append((word, val[len(word):].strip(), body, other))
        elif word == "define":
            body, i, _ = _parse(tokens, i, ("end",))
            nodes.append(("define", shlex.split(val)[1], body))
        elif word in ("range", "template", "block"):
            raise TemplateError(f"unsupported action: {val}")
        else:
            nodes.append(("pipe", val))
    if stop:
        raise TemplateError(f"missing {{{{ end }}}} (expected one of {stop})")
    return nodes, i, ""


def _truthy(v: Any) -> bool:
    return not (v is None or v is False or v == 0 or v == "" or v == [] or v == {})


def _to_yaml(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=False).rstrip("\n")


def _quote(v: Any) -> str:
    s = "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


class Renderer:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.defines: dict[str, list[Any]] = {}
        self.funcs: dict[str, Callable[..., Any]] = {
            "include": lambda name, ctx: self._render_nodes(self.defines[name], ctx),
            "toYaml": _to_yaml,
            "nindent": lambda n, s: "\n" + "\n".join(" " * int(n) + line if line else line for line in str(s).split("\n")),
            "indent": lambda n, s: "\n".join(" " * int(n) + line if line else line for line in str(s).split("\n")),
            "quote": _quote,
            "default": lambda d, v=None: v if _truthy(v) else d,
            "trunc": lambda n, s: str(s)[: int(n)],
            "trimSuffix": lambda suf, s: str(s)[: -len(suf)] if suf and str(s).endswith(suf) else str(s),
            "printf": lambda fmt, *a: re.sub(r"%[sdv]", "{}", fmt).format(*a),
        }

    def load(self, text: str) -> list[Any]:
        nodes, _, _ = _parse(_tokens(text), 0, ())
        for n in nodes:
            if n[0] == "define":
                self.defines[n[1]] = n[2]
        return nodes

    def render(self, text: str) -> str:
        return self._render_nodes(self.load(text), self.root)

    def _render_nodes(self, nodes: list[Any], dot: Any) -> str:
        out = []
        for n in nodes:
            if n[0] == "text":
                out.append(n[1])
            elif n[0] == "pipe":
                v = self._pipeline(n[1], dot)
                out.append("" if v is None else str(v).lower() if isinstance(v, bool) else str(v))
            elif n[0] in ("if", "with"):
                v = self._pipeline(n[1], dot)
                if _truthy(v):
                    out.append(self._render_nodes(n[2], v if n[0] == "with" else dot))
                else:
                    out.append(self._render_nodes(n[3], dot))
            elif n[0] == "define":
                pass
        return "".join(out)

    def _arg(self, tok: str, dot: Any) -> Any:
        if tok.startswith('"'):
            return shlex.split(tok)[0]
        if re.fullmatch(r"-?\d+", tok):
            return int(tok)
        if tok in ("true", "false"):
            return tok == "true"
        if tok == ".":
            return dot
        if tok.startswith("."):
            cur = dot
            for part in tok[1:].split("."):
                if not isinstance(cur, dict):
                    raise TemplateError(f"{tok}: cannot index {type(cur).__name__}")
                if part not in cur:
                    raise TemplateError(f"{tok}: no key {part!r}")
                cur = cur[part]
            return cur
        raise TemplateError(f"unsupported operand {tok!r}")

    def _pipeline(self, text: str, dot: Any) -> Any:
        value: Any = None
        for i, cmd in enumerate(text.split("|")):  # no "|" inside literals in this chart
            words = shlex.split(cmd.strip(), posix=False)
            head, args = words[0], [self._arg(w, dot) for w in words[1:]]
            if head in self.funcs:
                if i:
                    args.append(value)
                value = self.funcs[head](*args)
            elif head in ("not",):
                value = not _truthy(args[0] if args else value)
            else:
                if i or args:
                    raise TemplateError(f"unknown function {head!r} in {text!r}")
                value = self._arg(head, dot)
        return value


def _coalesce(base: dict[str, Any], over: dict[str, Any]) -> None:
    """``-f values.yaml`` over the chart's defaults as Helm merges them: maps deeply, everything else replaced."""
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _coalesce(base[k], v)
        else:
            base[k] = v


def render_chart(chart_dir: Any, release: str = "spotguard", namespace: str = "kube-system",
                 values: dict[str, Any] | None = None) -> dict[str, str]:
    """{template file name: rendered text} for every manifest template, like `helm template`."""
    from pathlib import Path
    chart_dir = Path(chart_dir)
    chart = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    vals = yaml.safe_load((chart_dir / "values.yaml").read_text()) or {}
    _coalesce(vals, values or {})
    root = {
        "Values": vals,
        "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart.get("appVersion", "")},
        "Release": {"Name": release, "Namespace": namespace, "Service": "Helm"},
    }
    r = Renderer(root)
    templates = sorted((chart_dir / "templates").iterdir())
    for t in templates:
        if t.name.endswith(".tpl"):
            r.load(t.read_text())
    out = {}
    for t in templates:
        if t.suffix in (".yaml", ".yml") and not t.name.startswith("_"):
            out[t.name] = r.render(t.read_text())
    return out
