"""fusionserve: serve AdapterFusion models as one ONNX graph.

The package is split along the data flow: ``fusionserve.export`` (torch side: AdapterHub checkpoints -> validated
artifact), ``fusionserve.serving`` (runtime side, no torch: the artifact's light contracts and the HTTP server) and
``fusionserve.scoring`` (offline work over files), with ``fusionserve.cli`` on top. This top-level module holds
only what every layer shares and what imports nothing heavy.
"""

__version__ = "0.1.0"
