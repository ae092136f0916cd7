"""Strict YAML for sweep files, cluster profiles and `key=value` overrides.

PyYAML's safe loader, made stricter in three ways, each of which used to reach users as a
traceback or as a silently different sweep:

- a duplicate key is an error (YAML says keys are unique; PyYAML keeps the last one);
- the composed document is walked before it is constructed: more than `MAX_NODES` distinct nodes
  is "too large", and more than `MAX_NODES` nodes *after* alias expansion with few distinct nodes
  is an alias bomb. The two are told apart, so a big honest file is not called an alias problem;
- `${...}` interpolation is refused: OmegaConf would resolve `${oc.env:SECRET}` into the stored
  spec and into error messages. Sweep files are plain data.

Every error names the file, the line and the column (1-based), and the key where one is known.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

MAX_NODES = 200_000
"""Distinct nodes, and nodes after alias expansion, one document may hold."""
INTERPOLATION = re.compile(r"\$\{")



class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """YAML 1.1's safe loader with YAML 1.2's floats (`1e12`, `2.0e-4` are numbers, as in
    OmegaConf) and no timestamps (a date stays the string that was written)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
            |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


class YamlError(ValueError):
    """A YAML problem, as `FILE:LINE:COL: problem`."""

    def __init__(
        self, source: str, message: str, line: int | None = None, column: int | None = None, *, key: str | None = None
    ):
        where = source if line is None else f"{source}:{line}:{column}"
        super().__init__(f"{where}: {key + ': ' if key else ''}{message}")
        self.source, self.line, self.column, self.detail, self.key = source, line, column, message, key

    @property
    def location(self) -> str:
        """Where in the file: the key if known, else line and column, else the file as a whole."""
        if self.key:
            return self.key
        return "file" if self.line is None else f"line {self.line}, column {self.column}"


def load_file(path: Path) -> Any:
    """The data of one YAML file (a single document)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise YamlError(str(path), f"cannot read: {exc.strerror if isinstance(exc, OSError) else exc}") from None
    return load_text(text, str(path))


def load_text(text: str, source: str) -> Any:
    """Parse `text` strictly; `source` names it in errors (a file path, or `override 'k=v'`)."""
    try:
        node = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        raise _marked(source, exc, text) from None
    except yaml.YAMLError as exc:
        raise YamlError(source, f"not valid YAML: {exc}") from None
    if node is None:
        return None
    _check_size(source, node)
    _check_keys(source, node)
    try:
        data = yaml.SafeLoader(text).construct_document(node)
    except yaml.MarkedYAMLError as exc:
        raise _marked(source, exc, text) from None
    except yaml.YAMLError as exc:  # pragma: no cover - composition catches what construction would
        raise YamlError(source, f"not valid YAML: {exc}") from None
    _check_interpolation(source, data, "")
    return data


def _marked(source: str, exc: yaml.MarkedYAMLError, text: str) -> YamlError:
    mark = exc.problem_mark or exc.context_mark
    problem = " ".join(p for p in (exc.context, exc.problem) if p) or "not valid YAML"
    lines = text.splitlines()
    if mark is not None and mark.line < len(lines) and "\t" in lines[mark.line][: mark.column + 1]:
        problem += " (a tab character: YAML indents with spaces)"
    if "could not determine a constructor" in problem:
        problem = problem.replace("could not determine a constructor for the tag", "tag not allowed (plain data only):")
    if mark is None:
        return YamlError(source, problem)
    return YamlError(source, problem, mark.line + 1, mark.column + 1)


def _check_size(source: str, root: yaml.Node) -> None:
    """Count distinct nodes and expanded nodes (an alias re-visits its anchor's subtree)."""
    distinct: set[int] = set()
    expanded = 0
    stack: list[yaml.Node] = [root]
    while stack:
        node = stack.pop()
        expanded += 1
        distinct.add(id(node))
        if expanded > MAX_NODES:
            mark = root.start_mark
            if len(distinct) > MAX_NODES // 2:
                raise YamlError(source, f"too large: more than {MAX_NODES:,} YAML nodes", mark.line + 1, mark.column + 1)
            raise YamlError(
                source,
                f"aliases expand to more than {MAX_NODES:,} nodes ({len(distinct):,} distinct): an alias bomb?",
                mark.line + 1,
                mark.column + 1,
            )
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack += (key, value)
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value


def _check_keys(source: str, root: yaml.Node) -> None:
    """No mapping holds the same key twice (checked once per distinct mapping node)."""
    seen_nodes: set[int] = set()
    stack: list[yaml.Node] = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys: dict[str, yaml.Node] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if key.value in keys:
                        first = keys[key.value].start_mark.line + 1
                        mark = key.start_mark
                        raise YamlError(
                            source, f"duplicate key {key.value!r} (first at line {first})", mark.line + 1, mark.column + 1
                        )
                    keys[key.value] = key
                stack += (key, value)
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value


def _check_interpolation(source: str, data: Any, where: str) -> None:
    if isinstance(data, str) and INTERPOLATION.search(data):
        raise YamlError(
            source,
            "interpolation ('${...}') is not supported in sweep files: write the value itself"
            " (resolvers such as oc.env would copy secrets into the stored sweep)",
            key=where or "value",
        )
    if isinstance(data, dict):
        for key, value in data.items():
            _check_interpolation(source, key, where)
            _check_interpolation(source, value, f"{where}.{key}" if where else str(key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            _check_interpolation(source, value, f"{where}[{i}]")
