"""scikit-learn hidden from transformers in the test processes (imported first by conftest) and, through
``sitecustomize.py`` first on PYTHONPATH, in every process they start (which never lifts it): sitecustomize.py says
why."""

import os
import sys

FOLDER = os.path.dirname(__file__)

if FOLDER not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (FOLDER, os.environ.get("PYTHONPATH", "")) if p)
sys.modules.setdefault("sklearn", None)  # type: ignore[arg-type]


def lift() -> None:
    """Once transformers has looked for scikit-learn: it may be imported in this process again (seqeval)."""
    if "sklearn" in sys.modules and sys.modules["sklearn"] is None:
        del sys.modules["sklearn"]
