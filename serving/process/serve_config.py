"""A Ray Serve config file for an artifact (``fusionserve serve ART [options] --print-config``): Serve's own
multi-application format, deployed with stock Ray tools (``serve run FILE``, ``serve deploy FILE``, a KubeRay
RayService's ``serveConfigV2``). The application is ``builder.app_builder`` with the options as its arguments;
where Serve listens is the config's http_options / grpc_options; the ingress settings, which Ray reads when its
processes start, are printed as the environment every node's `ray start` needs.
"""

from __future__ import annotations

from typing import Any

import yaml

from fusionserve import __version__

from ..builder import IMPORT_PATH, AppArgs, check_artifact
from ..model.artifact import MANIFEST, load_artifact, sha256
from .ingress import node_env
from .server import APP_NAME, ServerConfig, grpc_options


def config(cfg: ServerConfig) -> dict[str, Any]:
    """The config as data (Serve's ServeDeploySchema). Raises ArtifactError for an unusable artifact: a config is
    written for an artifact that exists, at the path every node will read it from."""
    artifact = load_artifact(cfg.artifact)
    args = cfg.app_args(artifact_sha256=sha256(artifact.folder / MANIFEST))
    check_artifact(args)  # what the builder would refuse (a default task the artifact lacks), refused here already
    defaults = AppArgs(artifact=args.artifact)
    # only what differs from the builder's defaults, so the file shows what was chosen (artifact always)
    chosen = {k: v for k, v in args.model_dump().items() if k == "artifact" or v != getattr(defaults, k)}
    out: dict[str, Any] = {
        "proxy_location": "EveryNode",
        "http_options": {"host": cfg.host, "port": cfg.port},
    }
    if cfg.grpc_port is not None:
        out["grpc_options"] = grpc_options(cfg.grpc_port)
    out["applications"] = [{"name": APP_NAME, "route_prefix": "/", "import_path": IMPORT_PATH, "args": chosen}]
    return out


def render(cfg: ServerConfig) -> str:
    """The config file's text: a header saying how to use it, then the YAML."""
    env = " ".join(f"{k}={v}" for k, v in node_env(cfg.ingress).items())
    header = [
        f"# Ray Serve config for {cfg.artifact.resolve()} (fusionserve {__version__}, `fusionserve serve --print-config`).",
        "# Deploy with Ray's own tools: `serve run THIS_FILE` (joins RAY_ADDRESS or starts Ray), or `serve deploy",
        "# THIS_FILE` on a cluster with the dashboard. The artifact must be at this path on every node (its sha256 is",
        "# checked by every replica), or shipped: runtime_env: {working_dir: <zip URI>} with artifact: '.'.",
        f"# Start every Ray node with the {cfg.ingress} ingress's settings (Ray reads them when its processes start):",
        f"#   {env} ray start ...",
    ]
    if cfg.app.api_key_env:  # the config names the variable; the key itself is in no file
        header.append(
            f"# Every node's environment must hold the API key(s) in ${cfg.app.api_key_env} (KubeRay: from a Secret, see "
            "deploy/); replicas without it refuse to start."
        )
    return "\n".join(header) + "\n" + yaml.safe_dump(config(cfg), sort_keys=False)
