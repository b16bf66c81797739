"""The documentation's reference pages, written from the code at build time so they cannot drift from it.

Each ``*_page()`` returns one Markdown page: the command line from the argparse parsers, the HTTP API from the
FastAPI app's OpenAPI schema and routes (imported, never served: importing ``fusionserve.serving.app`` starts no
Ray), the gRPC API from the ``.proto`` and its compiled descriptor, the metrics from a ``Metrics`` registry, the
error types from every ``HTTPError(status, "type", ...)`` in ``serving/`` and the typed exceptions, the
environment variables from every literal the source reads. Needs the ``[serve]`` extra (FastAPI, Ray Serve,
prometheus-client, grpcio). ``docs/hooks/site.py`` adds them to the site; ``tests/test_docs.py`` checks them
against the code by other means.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# the package's source folders (pyproject's package-dir): where the code that reads settings and raises errors lives
SOURCE_DIRS = ("fusionserve", "serving", "scoring", "cli", "export", "training")
PAGES = {  # site path -> (title, generator name)
    "reference/cli.md": "cli_page",
    "reference/http.md": "http_page",
    "reference/grpc.md": "grpc_page",
    "reference/metrics.md": "metrics_page",
    "reference/errors.md": "errors_page",
    "reference/environment.md": "environment_page",
}
_GENERATED = "<!-- generated from the code by docs/hooks/reference.py at build time: edit the code, not this page -->\n"


def _md(text: str) -> str:
    """A docstring's reStructuredText literals (``x``) as Markdown code (`x`)."""
    return re.sub(r"``(.+?)``", r"`\1`", text)


def _cell(text: object) -> str:
    """Text fit for one Markdown table cell."""
    return _md(" ".join(str(text).split())).replace("|", "\\|")


def _source_files() -> Iterator[Path]:
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "_pb2" not in path.name:
                yield path


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# --- command line ----------------------------------------------------------------------------------------------


def subcommands(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], str, argparse.ArgumentParser]]:
    """Every subcommand, nested ones too, depth first: (words after ``fusionserve``, its one-line help, its parser)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:  # an alias: the same parser under another name
                    continue
                seen.add(id(sub))
                words = (*prefix, name)
                yield words, helps.get(name, ""), sub
                yield from subcommands(sub, words)


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            name = ", ".join(f"`{s}`" for s in action.option_strings)
        else:
            name = f"`{action.metavar or action.dest}`"
        takes = ""
        if not action.option_strings:
            takes = "(optional)" if action.nargs == "?" else ""
        elif action.choices is not None:
            takes = " \\| ".join(f"`{c}`" for c in action.choices)
        elif action.nargs != 0:
            metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
            many = {"*": " ...", "+": " ...", "?": " (optional)"}.get(str(action.nargs), "")
            takes = f"`{metavar}`{many}"
        if action.option_strings and getattr(action, "required", False):
            takes += " (required)"
        help_text = formatter._expand_help(action) if action.help else ""
        rows.append(f"| {name} | {takes} | {_cell(help_text)} |")
    return rows


def cli_page() -> str:
    from fusionserve.cli.main import build_parser

    parser = build_parser()
    out = [
        "# Command line",
        _GENERATED,
        "Every `fusionserve` subcommand and option, read from the argparse parsers (`cli/`). "
        "`fusionserve SUBCOMMAND --help` says the same in a terminal.",
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
        "| subcommand | what it does |",
        "|---|---|",
    ]
    commands = list(subcommands(parser))
    for words, help_text, _ in commands:
        out.append(f"| [`{' '.join(words)}`](#fusionserve-{'-'.join(words)}) | {_cell(help_text)} |")
    for words, help_text, sub in commands:
        out += ["", f"## fusionserve {' '.join(words)} {{ #fusionserve-{'-'.join(words)} }}", ""]
        if help_text:
            out += [help_text[0].upper() + help_text[1:] + ".", ""]
        if sub.description:
            out += [sub.description, ""]
        out += ["```text", sub.format_usage().strip().removeprefix("usage: "), "```", ""]
        rows = _argument_rows(sub)
        if rows:
            out += ["| argument | takes | meaning |", "|---|---|---|", *rows]
        if sub.epilog:
            out += ["", sub.epilog]
    return "\n".join(out) + "\n"


# --- HTTP ------------------------------------------------------------------------------------------------------


def http_routes() -> list[tuple[str, str, bool]]:
    """(method, path, in the OpenAPI schema) of every route of the replica's FastAPI app."""
    from fusionserve.serving.app import app

    def walk(routes: list[Any]) -> Iterator[Any]:
        for route in routes:
            if hasattr(route, "original_router"):  # a router included into the app (FastAPI >= 0.16x)
                yield from walk(route.original_router.routes)
            else:
                yield route

    found = []
    for route in walk(app.routes):
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                found.append((method, route.path, bool(getattr(route, "include_in_schema", True))))
    return found


def _schema_type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in schema:  # an optional field's null is said by "required" and "default"
            return " or ".join(_schema_type(s) for s in schema[key] if s.get("type") != "null")
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_schema_type(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema and isinstance(schema["additionalProperties"], dict):
        return f"map of {_schema_type(schema['additionalProperties'])}"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    return str(kind)


def _schema_table(name: str, schema: dict[str, Any]) -> list[str]:
    out = [f"### {name} {{ #{name.lower()} }}", ""]
    if schema.get("description"):
        out += [schema["description"], ""]
    props = schema.get("properties")
    if not props:
        return [*out, f"`{_schema_type(schema)}`", ""]
    required = set(schema.get("required", ()))
    out += ["| field | type | required | default | meaning |", "|---|---|---|---|---|"]
    for field, spec in props.items():
        default = f"`{json.dumps(spec['default'])}`" if "default" in spec else ""
        meaning = spec.get("description") or spec.get("title", "")
        bounds = [f"{k} {spec[k]}" for k in ("minItems", "maxItems", "minLength", "maxLength", "minimum", "maximum") if k in spec]
        if bounds:
            meaning = f"{meaning} ({', '.join(bounds)})" if meaning else ", ".join(bounds)
        yes = "yes" if field in required else ""
        out.append(f"| `{field}` | {_schema_type(spec)} | {yes} | {default} | {_cell(meaning)} |")
    return [*out, ""]


def http_page() -> str:
    from fusionserve.serving.app import app

    schema = app.openapi()
    out = [
        "# HTTP API",
        _GENERATED,
        f"{schema['info'].get('description', '')} Read from the replica's FastAPI app (`serving/app.py`, version "
        f"{schema['info']['version']}): a running server serves the same schema at `/openapi.json` and a browsable "
        'page at `/docs`. Every refusal has the body `{"error": {"type": ..., "message": ...}}`: the types are '
        "in [Errors](errors.md).",
        "",
        "| method | path | what |",
        "|---|---|---|",
    ]
    documented = {(m, p) for m, p, listed in http_routes() if listed}
    unlisted = {  # routes FastAPI keeps out of the schema: what they are
        "/openapi.json": "this schema, as JSON",
        "/docs": "the API's browsable page (Swagger UI, served from the package: no CDN)",
    }
    for method, path, listed in http_routes():
        op = schema["paths"].get(path, {}).get(method.lower(), {}) if listed else {}
        what = op.get("description", "").split("\n")[0] or op.get("summary", "")
        if not listed:
            what = unlisted.get(path, "files of the `/docs` page" if path.startswith("/docs") else "") + " (not in the schema)"
        anchor = (
            f"[`{path}`](#{method.lower()}{re.sub(r'[^a-z0-9]+', '-', path.lower()).rstrip('-')})"
            if (method, path) in documented
            else f"`{path}`"
        )
        out.append(f"| `{method}` | {anchor} | {_cell(what)} |")
    inline: dict[str, Any] = {}
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            anchor = f"{method}{re.sub(r'[^a-z0-9]+', '-', path.lower()).rstrip('-')}"
            out += ["", f"## {method.upper()} {path} {{ #{anchor} }}", ""]
            if op.get("description"):
                out += [op["description"], ""]
            body = op.get("requestBody", {}).get("content", {})
            for media, content in body.items():
                shape = content.get("schema", {})
                if "properties" in shape and "title" in shape:  # a request model written inline: shown with the others
                    inline[shape["title"]] = shape
                    inline.update(shape.get("$defs", {}))
                    shape = {"$ref": f"#/components/schemas/{shape['title']}"}
                out += [f"Request body (`{media}`): {_schema_type(shape)}", ""]
            out += ["| status | meaning | body |", "|---|---|---|"]
            for status, resp in op.get("responses", {}).items():
                content = resp.get("content", {})
                shape = ", ".join(_schema_type(c.get("schema", {})) for c in content.values() if c.get("schema"))
                out.append(f"| {status} | {_cell(resp.get('description', ''))} | {shape} |")
    out += ["", "## Schemas", ""]
    for name, spec in {**inline, **schema.get("components", {}).get("schemas", {})}.items():
        out += _schema_table(name, spec)
    out += ["## The schema itself", "", '??? note "openapi.json"', "    ```json"]
    out += ["    " + line for line in json.dumps(schema, indent=2).splitlines()]
    out += ["    ```", ""]
    return "\n".join(out)


# --- gRPC ------------------------------------------------------------------------------------------------------


def grpc_methods() -> list[tuple[str, str, str, str]]:
    """(service full name, method, input message, output message) from the compiled descriptor."""
    from fusionserve.serving import fusionserve_pb2 as pb

    return [
        (service.full_name, method.name, method.input_type.full_name, method.output_type.full_name)
        for service in pb.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]


def _scalar_names() -> dict[int, str]:
    from google.protobuf.descriptor import FieldDescriptor

    return {getattr(FieldDescriptor, k): k.removeprefix("TYPE_").lower() for k in dir(FieldDescriptor) if k.startswith("TYPE_")}


def _repeated(field: Any) -> bool:
    flag = getattr(field, "is_repeated", None)  # protobuf >= 6; older ones only have the label
    return bool(flag) if flag is not None else field.label == field.LABEL_REPEATED


def grpc_page() -> str:
    from fusionserve.serving import fusionserve_pb2 as pb

    scalars = _scalar_names()
    proto = (ROOT / "serving" / "fusionserve.proto").read_text()
    out = [
        "# gRPC API",
        _GENERATED,
        "From `serving/fusionserve.proto` (installed with the package as `fusionserve/serving/fusionserve.proto`) and "
        "the stubs compiled from it. Send the metadata `application: fusionserve` with every call. How to serve and "
        "call it: [the gRPC guide](../guides/grpc.md).",
        "",
        "| method | request | response |",
        "|---|---|---|",
    ]
    for service, method, request, response in grpc_methods():
        out.append(
            f"| `/{service}/{method}` | [`{request}`](#{request.rsplit('.', 1)[-1].lower()}) | [`{response}`](#{response.rsplit('.', 1)[-1].lower()}) |"
        )
    out += ["", "## Messages", ""]
    for message in pb.DESCRIPTOR.message_types_by_name.values():
        out += [f"### {message.name} {{ #{message.name.lower()} }}", "", "| field | number | type |", "|---|---:|---|"]
        for field in message.fields:
            kind = field.message_type.name if field.message_type else scalars.get(field.type, str(field.type))
            repeated = "repeated " if _repeated(field) else ""
            out.append(f"| `{field.name}` | {field.number} | {repeated}`{kind}` |")
        out.append("")
    out += ["## The .proto file", "", "```protobuf", proto.rstrip(), "```", ""]
    return "\n".join(out)


# --- metrics ---------------------------------------------------------------------------------------------------


def metric_families() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(name as scraped, type, help, label names) of everything a replica's ``/metrics`` can report."""
    from prometheus_client.parser import text_string_to_metric_families

    from fusionserve.serving import metrics as module

    registry_owner = module.Metrics()
    body, _ = registry_owner.render()
    labels: dict[str, tuple[str, ...]] = {}
    for collector in list(registry_owner.registry._collector_to_names):
        for name in registry_owner.registry._collector_to_names[collector]:
            labels[name] = tuple(getattr(collector, "_labelnames", ()))
    for obj in vars(module).values():  # collectors computed at scrape time (their families carry their label names)
        if isinstance(obj, type) and hasattr(obj, "collect") and obj.__module__ == module.__name__:
            try:
                families = list(obj(registry_owner.registry).collect())
            except TypeError:
                continue
            for family in families:
                labels[family.name] = tuple(getattr(family, "_labelnames", ()))
    found = []
    families = list(text_string_to_metric_families(body.decode()))
    names = {family.name for family in families}
    for family in families:
        if family.name.endswith("_created") and family.name.removesuffix("_created") in names:
            continue  # the creation time prometheus_client adds beside an unlabelled histogram: not a metric of ours
        name = family.name + ("_total" if family.type == "counter" else "")
        found.append((name, family.type, family.documentation, labels.get(name) or labels.get(family.name, ())))
    return found


def metrics_page() -> str:
    from fusionserve.serving import metrics as module

    out = [
        "# Metrics",
        _GENERATED,
        "What `GET /metrics` reports (Prometheus text format), read from a fresh `Metrics` registry "
        "(`serving/metrics.py`). How they are recorded:",
        "",
        _md((module.__doc__ or "").strip()),
        "",
        "| metric | type | labels | what |",
        "|---|---|---|---|",
    ]
    for name, kind, doc, labels in metric_families():
        out.append(f"| `{name}` | {kind} | {', '.join(f'`{x}`' for x in labels)} | {_cell(doc)} |")
    return "\n".join(out) + "\n"


# --- errors ----------------------------------------------------------------------------------------------------


def _int(node: ast.AST) -> int | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, int) else None


def _str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


_HTTP_ONLY = {"app.py"}  # where a refusal is made -> which protocol can carry it


def error_types() -> list[tuple[int, str, str, str, bool]]:
    """(HTTP status, error type, where, message, can reach gRPC) of every refusal in ``serving/``: each
    ``HTTPError(status, "type", message)`` or ``_error(...)`` call and each ``{status: "type"}`` mapping, one row per
    (status, type). Refusals made only in ``app.py`` (HTTP routing, bodies) never reach a gRPC caller."""
    found: dict[tuple[int, str], tuple[str, str]] = {}
    grpc: dict[tuple[int, str], bool] = {}
    for path in sorted((ROOT / "serving").rglob("*.py")):
        if "_pb2" in path.name:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            pairs: list[tuple[int | None, str | None, str]] = []
            if isinstance(node, ast.Call) and len(node.args) >= 2:
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if func in ("HTTPError", "_error"):
                    message = ast.unparse(node.args[2]) if len(node.args) > 2 else ""
                    pairs.append((_int(node.args[0]), _str(node.args[1]), message))
            elif isinstance(node, ast.Dict):
                pairs += [(_int(k), _str(v), "") for k, v in zip(node.keys, node.values, strict=True) if k is not None]
            for status, kind, message in pairs:
                if status is None or kind is None or not 400 <= status < 600 or not re.fullmatch(r"[a-z_]+", kind):
                    continue
                where = f"{_rel(path)}:{node.lineno}"
                grpc[(status, kind)] = grpc.get((status, kind), False) or path.name not in _HTTP_ONLY
                if (status, kind) not in found or (message and not found[(status, kind)][1]):
                    found[(status, kind)] = (where, message)
    return sorted((status, kind, where, message, grpc[key]) for key, (where, message) in found.items() for status, kind in [key])


def exception_classes() -> list[tuple[str, str, str]]:
    """(class, module path, docstring) of every exception deriving, at any depth, from ``FusionServeError``."""
    classes: dict[str, tuple[list[str], str, str]] = {}
    for path in _source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases]
                classes.setdefault(node.name, (bases, _rel(path), ast.get_docstring(node) or ""))
    family = {"FusionServeError"}
    grew = True
    while grew:
        grew = False
        for name, (bases, _, _) in classes.items():
            if name not in family and family.intersection(bases):
                family.add(name)
                grew = True
    return sorted((name, classes[name][1], classes[name][2]) for name in family if name in classes)


def errors_page() -> str:
    from fusionserve.cli import main as cli_main
    from fusionserve.serving.grpc_ingress import ERROR_TYPE_KEY, grpc_code

    out = [
        "# Errors",
        _GENERATED,
        "## HTTP and gRPC refusals",
        "",
        'Every refusal of the HTTP API is `{"error": {"type": TYPE, "message": ...}}` with the status below; over gRPC '
        f"the status becomes the code below and the type rides in the trailing metadata `{ERROR_TYPE_KEY}`. The message "
        "names the bad field or value; the column shows how the code writes it. Found in `serving/` wherever a "
        "refusal is made. What each means for a caller: [Serving, errors](../guides/serving.md#errors).",
        "",
        "| type | HTTP | gRPC | message | raised at |",
        "|---|---:|---|---|---|",
    ]
    for status, kind, where, message, over_grpc in error_types():
        shown = f"`{_cell(message)}`" if message else ""
        code = f"`{grpc_code(status).name}`" if over_grpc else "(HTTP only)"
        out.append(f"| `{kind}` | {status} | {code} | {shown} | `{where}` |")
    out += [
        "",
        "## Exceptions (Python API and command line)",
        "",
        "The command line prints these as one line, `fusionserve: error: MESSAGE`, and exits 2 (`cli/main.py`):",
        "",
        "> " + _md(" ".join((cli_main.__doc__ or "").split())),
        "",
        "| exception | defined in | meaning |",
        "|---|---|---|",
    ]
    for name, where, doc in exception_classes():
        out.append(f"| `{name}` | `{where}` | {_cell(doc.split(chr(10) + chr(10))[0])} |")
    return "\n".join(out) + "\n"


# --- environment -----------------------------------------------------------------------------------------------

_ENV_NAME = re.compile(r"[A-Z][A-Z0-9]*(_[A-Za-z0-9]+)+")
_READERS = {"get", "getenv", "pop", "setdefault", "environ"}


def environment_variables() -> list[tuple[str, str, str]]:
    """(name, how the code uses it: reads / sets, where) for every ``FUSIONSERVE_*`` literal in the source and every
    variable read with ``os.environ.get`` / ``os.getenv`` / ``os.environ[...]`` / ``setdefault`` by name."""
    found: dict[str, tuple[str, str]] = {}
    for path in _source_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            name, use = None, "reads"
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                attr = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
                if (attr in ("get", "pop", "setdefault") and owner.endswith("environ")) or attr == "getenv":
                    name = _str(node.args[0])
                    use = "sets a default for Ray" if attr == "setdefault" else "reads"
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
                name = _str(node.slice)
            elif (text := _str(node)) is not None and re.fullmatch(r"FUSIONSERVE_[A-Z0-9_]+", text):
                name = text
            if name and _ENV_NAME.fullmatch(name) and (name not in found or found[name][0] != "reads"):
                found[name] = (use, f"{_rel(path)}:{getattr(node, 'lineno', 0)}")
    return sorted((name, use, where) for name, (use, where) in found.items())


def _settings_descriptions() -> dict[str, str]:
    """``NAME``: text paragraphs of ``fusionserve/settings.py``'s docstrings and comments, by variable name."""
    source = (ROOT / "fusionserve" / "settings.py").read_text()
    tree = ast.parse(source)
    texts = [ast.get_docstring(tree) or ""]
    texts += [ast.get_docstring(n) or "" for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    described: dict[str, str] = {}
    for text in texts:
        for para in re.split(r"\n\s*\n", text):
            flat = " ".join(para.split())
            match = re.match(r"``([A-Z][A-Z0-9_]+)``:?\s*(.*)", flat)
            if match and match.group(1) not in described:
                described[match.group(1)] = match.group(2)
    for line in source.splitlines():  # NAME_ENV = "FUSIONSERVE_X"  # what it does
        match = re.match(r'\s*\w+\s*=\s*"([A-Z][A-Z0-9_]+)"\s*#\s*(.+)', line)
        if match and match.group(1) not in described:
            described[match.group(1)] = match.group(2)
    return described


_OTHERS = {  # variables fusionserve reads or sets that belong to other tools: what they do there
    "RAY_ADDRESS": "the Ray cluster to join (`serve`, `score --ray`); unset: a local Ray instance is started",
    "PROMETHEUS_MULTIPROC_DIR": "set by `fusionserve serve` for its replicas: one folder per node pools every replica's samples",
    "HF_HUB_OFFLINE": "Hugging Face libraries: never reach the network",
    "RAY_USAGE_STATS_ENABLED": "Ray's usage reporting; fusionserve turns it off (0) unless it is set",
    "RAY_worker_niceness": "the nice level of Ray's workers; a local Ray started by fusionserve runs them at 0, not Ray's 15",
}


def environment_page() -> str:
    from fusionserve import settings

    described = _settings_descriptions()
    out = [
        "# Environment variables",
        _GENERATED,
        "Every variable fusionserve's code reads (or sets for Ray), found in the source. fusionserve's own share the "
        "`FUSIONSERVE_` prefix and are read in `fusionserve/settings.py`:",
        "",
        "> " + _md(" ".join((settings.__doc__ or "").split("\n\n")[0].split())),
        "",
        "| variable | use | meaning | in the code |",
        "|---|---|---|---|",
    ]
    for name, use, where in environment_variables():
        meaning = described.get(name) or _OTHERS.get(name, "")
        out.append(f"| `{name}` | {use} | {_cell(meaning)} | `{where}` |")
    out += [
        "",
        "`fusionserve serve` also gives Ray Serve's HAProxy ingress its settings as `RAY_SERVE_*` variables when it "
        "starts Ray; on a cluster they go to every `ray start` (`fusionserve serve --print-config` lists them): see "
        "[Scaling out](../guides/scaling-out.md).",
        "",
    ]
    return "\n".join(out)


# --- install extras --------------------------------------------------------------------------------------------


def extras_table() -> str:
    """pyproject.toml's extras: each with what it installs and the comment lines written above it."""
    import tomllib

    text = (ROOT / "pyproject.toml").read_text()
    extras = tomllib.loads(text)["project"]["optional-dependencies"]
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            pending.append(line.lstrip("# ").strip())
            continue
        match = re.match(r"([A-Za-z0-9_-]+)\s*=\s*\[", line)
        if match and match.group(1) in extras:
            comments[match.group(1)] = " ".join(pending)
        pending = []
    rows = ["| extra | installs | notes |", "|---|---|---|"]
    for name, packages in extras.items():
        shown = ", ".join(f"`{p}`" for p in packages)
        rows.append(f"| `[{name}]` | {shown} | {_cell(comments.get(name, ''))} |")
    return "\n".join(rows)


def all_pages() -> dict[str, str]:
    """Site path -> Markdown of every reference page."""
    return {path: globals()[name]() for path, name in PAGES.items()}
