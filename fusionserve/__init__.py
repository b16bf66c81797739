"""fusionserve: serve AdapterFusion models as one ONNX graph.

The package is split along the data flow: ``fusionserve.export`` (torch side: AdapterHub
checkpoints -> validated model/artifact) and ``fusionserve.serving`` (runtime side, no torch).
This top-level module holds only what both halves share and what imports nothing heavy.
"""

__version__ = "0.1.0"
