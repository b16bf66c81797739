"""First on PYTHONPATH of every process the tests start (conftest): scikit-learn is hidden from it.

scikit-learn is in the test environment only as seqeval's dependency (test_metrics' reference); once transformers
finds it installed, every process that imports a model class imports ``sklearn.metrics`` (1.5-1.7 CPU-s), which no
install of fusionserve does (no extra of it brings scikit-learn). ``None`` in ``sys.modules``: ``find_spec`` answers
None (transformers' check) and an import raises ModuleNotFoundError. conftest lifts it again in the test processes
themselves once transformers has looked, so that seqeval still imports there."""

import sys

sys.modules.setdefault("sklearn", None)  # type: ignore[arg-type]
