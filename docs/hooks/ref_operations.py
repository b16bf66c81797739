"""Reference pages of what running fusionserve shows, from the code: the metrics (a fresh ``Metrics`` registry), the
error types (every ``HTTPError(status, "type", ...)`` in ``serving/``) and typed exceptions, the environment
variables (every literal the source reads), and the install extras (pyproject.toml)."""

from __future__ import annotations

import ast
import re

from ref_common import GENERATED, ROOT, cell, md, rel, source_files

# --- metrics ---------------------------------------------------------------------------------------------------


def metric_families() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(name as scraped, type, help, label names) of everything a replica's ``/metrics`` can report."""
    from prometheus_client.parser import text_string_to_metric_families

    from fusionserve.serving.api import metrics as module

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
    from fusionserve.serving.api import metrics as module

    out = [
        "# Metrics",
        GENERATED,
        "What `GET /metrics` reports (Prometheus text format), read from a fresh `Metrics` registry "
        "(`serving/api/metrics.py`). How they are recorded:",
        "",
        md((module.__doc__ or "").strip()),
        "",
        "| metric | type | labels | what |",
        "|---|---|---|---|",
    ]
    for name, kind, doc, labels in metric_families():
        out.append(f"| `{name}` | {kind} | {', '.join(f'`{x}`' for x in labels)} | {cell(doc)} |")
    return "\n".join(out) + "\n"


# --- errors ----------------------------------------------------------------------------------------------------


def _int(node: ast.AST) -> int | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, int) else None


def _str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _template(node: ast.AST) -> str:
    """A message as a reader sees it: a string's text, an f-string's text with ``<code>{value}</code>`` where a value
    goes, or the function that writes it."""
    if (text := _str(node)) is not None:
        return cell(text)
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.FormattedValue):
                inner = v.value
                name = inner.attr if isinstance(inner, ast.Attribute) else getattr(inner, "id", "...")
                parts.append(f"<code>{{{name}}}</code>")
            else:
                parts.append(re.sub(r"\s+", " ", _str(v) or "").replace("|", "\\|"))
        return "".join(parts)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return f"written by `{node.func.id}()`"
    return "written where it is raised"


_HTTP_ONLY = {"app.py"}
_RANK = {"app.py": 1, "grpc_ingress.py": 2}


def _preference(where: str, message: str) -> tuple[bool, int]:
    """Which place to show for an error type: one with a message; on the path both protocols share, else HTTP's."""
    return bool(message), -_RANK.get(where.split(":")[0], 0)


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
                    message = _template(node.args[2]) if len(node.args) > 2 else ""
                    pairs.append((_int(node.args[0]), _str(node.args[1]), message))
            elif isinstance(node, ast.Dict):
                pairs += [(_int(k), _str(v), "") for k, v in zip(node.keys, node.values, strict=True) if k is not None]
            for status, kind, message in pairs:
                if status is None or kind is None or not 400 <= status < 600 or not re.fullmatch(r"[a-z_]+", kind):
                    continue
                where = f"{path.name}:{node.lineno}"  # every one is in serving/
                grpc[(status, kind)] = grpc.get((status, kind), False) or path.name not in _HTTP_ONLY
                known = found.get((status, kind))
                if known is None or _preference(where, message) > _preference(*known):
                    found[(status, kind)] = (where, message)
    return sorted((status, kind, where, message, grpc[key]) for key, (where, message) in found.items() for status, kind in [key])


def exception_classes() -> list[tuple[str, str, str]]:
    """(class, module path, docstring) of every exception deriving, at any depth, from ``FusionServeError``."""
    classes: dict[str, tuple[list[str], str, str]] = {}
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases]
                classes.setdefault(node.name, (bases, rel(path), ast.get_docstring(node) or ""))
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
    from fusionserve.serving.api.grpc_ingress import ERROR_TYPE_KEY, grpc_code

    out = [
        "# Errors",
        GENERATED,
        "## HTTP and gRPC refusals",
        "",
        'Every refusal of the HTTP API is `{"error": {"type": TYPE, "message": ...}}` with the status below; over gRPC '
        f"the status becomes the code below and the type rides in the trailing metadata `{ERROR_TYPE_KEY}`. The message "
        "names the bad field or value; the column shows how the code writes it. Found in `serving/` wherever a "
        "refusal is made. What each means for a caller: [Serving, errors](../guides/serving.md#errors).",
        "",
        "| type | HTTP | gRPC | message | in `serving/` |",
        "|---|---:|---|---|---|",
    ]
    for status, kind, where, message, over_grpc in error_types():
        shown = message
        code = f"`{grpc_code(status).name}`{{ .nowrap }}" if over_grpc else "(HTTP only)"
        out.append(f"| `{kind}` | {status} | {code} | {shown} | `{where}`{{ .nowrap }} |")
    out += [
        "",
        "## Exceptions (Python API and command line)",
        "",
        "The command line prints these as one line, `fusionserve: error: MESSAGE`, and exits 2 (`cli/main.py`):",
        "",
        "> " + md(" ".join((cli_main.__doc__ or "").split())),
        "",
        "| exception | defined in | meaning |",
        "|---|---|---|",
    ]
    for name, where, doc in exception_classes():
        out.append(f"| `{name}` | `{where}` | {cell(doc.split(chr(10) + chr(10))[0])} |")
    return "\n".join(out) + "\n"


# --- environment -----------------------------------------------------------------------------------------------

_ENV_NAME = re.compile(r"[A-Z][A-Z0-9]*(_[A-Za-z0-9]+)*")  # one word too, read by name: CC
_READERS = {"get", "getenv", "pop", "setdefault", "environ"}


def environment_variables() -> list[tuple[str, str, str]]:
    """(name, how the code uses it: reads / sets, where) for every ``FUSIONSERVE_*`` literal in the source and every
    variable read with ``os.environ.get`` / ``os.getenv`` / ``os.environ[...]`` / ``setdefault`` by name."""
    found: dict[str, tuple[str, str]] = {}
    for path in source_files():
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
                found[name] = (use, f"{rel(path)}:{getattr(node, 'lineno', 0)}")
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
        GENERATED,
        "Every variable fusionserve's code reads (or sets for Ray), found in the source. fusionserve's own share the "
        "`FUSIONSERVE_` prefix and are read in `fusionserve/settings.py`:",
        "",
        "> " + md(" ".join((settings.__doc__ or "").split("\n\n")[0].split())),
        "",
        "## Read by fusionserve",
        "",
        "| variable | use | meaning | in the code |",
        "|---|---|---|---|",
    ]
    for name, use, where in environment_variables():
        meaning = described.get(name) or _OTHERS.get(name, "")
        out.append(f"| `{name}` | {use} | {cell(meaning)} | `{where}` |")
    from fusionserve.serving.process.ingress import INGRESSES, node_env

    envs = {ingress: node_env(ingress) for ingress in INGRESSES}
    out += [
        "",
        "## Set for Ray Serve's ingress",
        "",
        "`fusionserve serve` starts Ray with these settings of the `--ingress` it serves behind (`serving/process/ingress.py`); "
        "Ray's processes read them when they start, so on a cluster every `ray start` needs them "
        "(`fusionserve serve --print-config` lists them; see [Scaling out](../guides/scaling-out.md)). The thread "
        "count follows the machine's cores.",
        "",
        "| variable | " + " | ".join(f"`--ingress {i}`" for i in INGRESSES) + " |",
        "|---|" + "---|" * len(INGRESSES),
    ]
    for name in sorted(set().union(*envs.values())):
        out.append(f"| `{name}` | " + " | ".join(f"`{envs[i][name]}`" if name in envs[i] else "" for i in INGRESSES) + " |")
    out.append("")
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
        rows.append(f"| `[{name}]` | {shown} | {cell(comments.get(name, ''))} |")
    return "\n".join(rows)


def private_page() -> str:
    """What fusionserve relies on in Ray, Serve, Serve's HAProxy and ONNX Runtime beyond their public APIs: the table of
    ``serving/private.py``'s docstring, its one home."""
    from fusionserve.serving import private

    intro, table = _split_private(private.__doc__ or "")
    return "\n".join([
        "# What fusionserve relies on in Ray, Serve and ONNX Runtime",
        GENERATED,
        md(" ".join(intro.split())),
        "",
        table.strip(),
        "",
    ])  # fmt: skip


def _split_private(doc: str) -> tuple[str, str]:
    """(the prose before the table, the table) of serving/private.py's docstring."""
    prose, _, table = doc.partition("\n| part |")
    return prose, "| part |" + table
