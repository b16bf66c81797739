"""The documentation's reference pages, written from the code at build time so they cannot drift from it.

Each page is written by one function of ``ref_interfaces.py`` or ``ref_operations.py``: the command line from the
argparse parsers, the HTTP API from the FastAPI app's OpenAPI schema and routes (imported, never served: importing
``fusionserve.serving.api.app`` starts no Ray), the gRPC API from the ``.proto`` and its compiled descriptor, the metrics
from a ``Metrics`` registry, the error types from every ``HTTPError(status, "type", ...)`` in ``serving/`` and the
typed exceptions, the environment variables from every literal the source reads. Needs the ``[serve]`` extra
(FastAPI, Ray Serve, prometheus-client, grpcio). ``docs/hooks/site.py`` adds the pages to the site;
``tests/test_docs.py`` checks them against the code by other means.
"""

from __future__ import annotations

from ref_common import ROOT
from ref_interfaces import cli_page, grpc_methods, grpc_page, http_page, http_routes, subcommands
from ref_operations import (
    environment_page,
    environment_variables,
    error_types,
    errors_page,
    exception_classes,
    extras_table,
    metric_families,
    metrics_page,
    private_page,
)

PAGES = {  # site path -> the function that writes it
    "reference/cli.md": cli_page,
    "reference/http.md": http_page,
    "reference/grpc.md": grpc_page,
    "reference/metrics.md": metrics_page,
    "reference/errors.md": errors_page,
    "reference/environment.md": environment_page,
    "reference/private.md": private_page,
}
__all__ = [
    "PAGES", "ROOT", "all_pages", "environment_variables", "error_types", "exception_classes", "extras_table",
    "grpc_methods", "http_routes", "metric_families", "subcommands",
]  # fmt: skip


def all_pages() -> dict[str, str]:
    """Site path -> Markdown of every reference page."""
    return {path: write() for path, write in PAGES.items()}
