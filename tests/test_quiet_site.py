"""scikit-learn is hidden from transformers in the test processes and in every process they start (tests/quiet_site:
transformers would import ``sklearn.metrics``, 1.5-1.7 CPU-s, in each process that loads a model), and importable
again in the test processes for seqeval, test_metrics' reference (which would otherwise skip, not fail)."""

import os
import subprocess
import sys

from transformers.utils import import_utils

from tests import quiet_site


def test_transformers_here_found_no_scikit_learn_and_seqeval_still_imports():
    assert import_utils.is_sklearn_available() is False
    import seqeval.metrics  # noqa: F401  # needs scikit-learn: lifted after transformers looked

    assert sys.modules["sklearn"] is not None


def test_a_process_the_tests_start_finds_no_scikit_learn():
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == quiet_site.FOLDER
    code = "import importlib.util; print(importlib.util.find_spec('sklearn'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "None"
