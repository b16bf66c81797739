"""The top layer: the ``fusionserve`` command and the built-in model's bootstrap. It sits above both halves —
``fusionserve.export`` (torch) and ``fusionserve.serving`` / ``fusionserve.scoring`` (no torch) — and is the only
place that may reach into all of them; each subcommand parses its options and calls one library function."""
