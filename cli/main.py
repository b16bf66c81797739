"""The ``fusionserve`` command: one parser, one handler per subcommand, and the one place that turns errors into
exit codes — 2 with a readable line for anything fusionserve refuses (bad input, bad model, a missing extra, a
Ray that does not start), never a traceback for those."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fusionserve import __version__
from fusionserve.errors import FusionServeError

from .model_commands import add_export, add_inspect, add_predict
from .pruning_commands import add_pruning
from .score_command import add_score
from .serve_command import add_serve

# A missing module -> the extra that brings it. Modules every command needs depend on the command (``needs``).
_MODULE_EXTRAS = {"torch": "export", "transformers": "export", "onnx": "export", "safetensors": "export",
                  "pyarrow": "batch", "fastapi": "serve", "prometheus_client": "serve", "starlette": "serve"}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusionserve", description="Serve AdapterFusion models trained with AdapterHub.")
    p.add_argument("--version", action="version", version=f"fusionserve {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (add_export, add_predict, add_score, add_serve, add_pruning, add_inspect):
        add(sub)
    return p


def missing_extra(command: str, needs: str, exc: ModuleNotFoundError) -> str:
    """The one line said when a package a command needs is not installed: the package and the extra to install."""
    module = (exc.name or "").split(".")[0] or "a package"
    extra = _MODULE_EXTRAS.get(module, needs)
    return f"'fusionserve {command}' needs {module}, which is not installed: pip install 'fusionserve[{extra}]'"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.own_process = argv is None  # the command line of a process of its own (the console script, python -m)
    try:
        return int(args.run(args))
    except FusionServeError as exc:
        print(f"fusionserve: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("fusionserve"):  # our own code is broken: that is a bug to see in full
            raise
        print(f"fusionserve: error: {missing_extra(args.command, args.needs, exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early: not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
