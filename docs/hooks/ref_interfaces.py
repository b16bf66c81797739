"""Reference pages of fusionserve's interfaces, from the code: the command line (the argparse parsers), the HTTP API
(the replica's FastAPI app: its OpenAPI schema and routes, imported, never served; importing it starts no Ray)
and the gRPC API (the .proto and its compiled descriptor)."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from typing import Any

from ref_common import GENERATED, ROOT, cell

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
        rows.append(f"| {name} | {takes} | {cell(help_text)} |")
    return rows


def cli_page() -> str:
    from fusionserve.cli.main import build_parser

    parser = build_parser()
    out = [
        "# Command line",
        GENERATED,
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
        out.append(f"| [`{' '.join(words)}`](#fusionserve-{'-'.join(words)}) | {cell(help_text)} |")
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
    from fusionserve.serving.api.app import app

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
        out.append(f"| `{field}` | {_schema_type(spec)} | {yes} | {default} | {cell(meaning)} |")
    return [*out, ""]


def http_page() -> str:
    from fusionserve.serving.api.app import app

    schema = app.openapi()
    out = [
        "# HTTP API",
        GENERATED,
        f"{schema['info'].get('description', '')} Read from the replica's FastAPI app (`serving/api/app.py`, version "
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
        out.append(f"| `{method}` | {anchor} | {cell(what)} |")
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
                out.append(f"| {status} | {cell(resp.get('description', ''))} | {shape} |")
    out += ["", "## Schemas", ""]
    for name, spec in {**inline, **schema.get("components", {}).get("schemas", {})}.items():
        out += _schema_table(name, spec)
    out += ["## The schema itself", "", '??? note "openapi.json"', "    ```json"]
    out += ["    " + line for line in json.dumps(schema, indent=2).splitlines()]
    out += ["    ```", ""]
    return "\n".join(out)


# --- gRPC ------------------------------------------------------------------------------------------------------


def _grpc_modules() -> list[tuple[Any, str]]:
    """(compiled module, .proto file name) of every gRPC service fusionserve serves."""
    from fusionserve.serving.api import fusionserve_pb2, grpc_predict_v2_pb2

    return [(fusionserve_pb2, "fusionserve.proto"), (grpc_predict_v2_pb2, "grpc_predict_v2.proto")]


def grpc_methods() -> list[tuple[str, str, str, str]]:
    """(service full name, method, input message, output message) from the compiled descriptors."""
    return [
        (service.full_name, method.name, method.input_type.full_name, method.output_type.full_name)
        for module, _ in _grpc_modules()
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]


def _scalar_names() -> dict[int, str]:
    from google.protobuf.descriptor import FieldDescriptor

    return {getattr(FieldDescriptor, k): k.removeprefix("TYPE_").lower() for k in dir(FieldDescriptor) if k.startswith("TYPE_")}


def _repeated(field: Any) -> bool:
    flag = getattr(field, "is_repeated", None)  # protobuf >= 6; older ones only have the label
    return bool(flag) if flag is not None else field.label == field.LABEL_REPEATED


def grpc_page() -> str:
    scalars = _scalar_names()
    out = [
        "# gRPC API",
        GENERATED,
        "From the .proto files installed with the package (`fusionserve/serving/api/fusionserve.proto`: fusionserve's own "
        "service; `grpc_predict_v2.proto`: the Open Inference Protocol's, KServe's v2) and the stubs compiled from them; "
        "both are served on the same port (`--grpc-port`). How to serve and call them: [the gRPC guide](../guides/grpc.md) "
        "and [the Open Inference Protocol guide](../guides/open-inference.md).",
        "",
        "| method | request | response |",
        "|---|---|---|",
    ]
    for service, method, request, response in grpc_methods():
        out.append(
            f"| `/{service}/{method}` | [`{request}`](#{request.rsplit('.', 1)[-1].lower()}) | [`{response}`](#{response.rsplit('.', 1)[-1].lower()}) |"
        )
    for module, _ in _grpc_modules():
        package = module.DESCRIPTOR.package
        out += ["", f"## Messages of `{package}`", ""]
        for message in module.DESCRIPTOR.message_types_by_name.values():
            out += [f"### {message.name} {{ #{message.name.lower()} }}", "", "| field | number | type |", "|---|---:|---|"]
            for field in message.fields:
                kind = field.message_type.name if field.message_type else scalars.get(field.type, str(field.type))
                if field.enum_type is not None:
                    kind = field.enum_type.name
                repeated = "repeated " if _repeated(field) else ""
                out.append(f"| `{field.name}` | {field.number} | {repeated}`{kind}` |")
            out.append("")
    for _, name in _grpc_modules():
        proto = (ROOT / "serving" / "api" / name).read_text()
        out += [f"## {name}", "", "```protobuf", proto.rstrip(), "```", ""]
    return "\n".join(out)
