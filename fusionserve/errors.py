"""Typed errors shared by both halves. Each message names the file or field, the bad value and what is allowed."""


class FusionServeError(Exception):
    """Base class: every error fusionserve raises on purpose derives from it (the CLI prints it without a traceback)."""


class SpecError(FusionServeError):
    """The model spec file is malformed or points at something that is not there."""


class CheckpointError(FusionServeError):
    """An AdapterHub checkpoint folder is missing files or weights, or uses a configuration fusionserve refuses."""


class InputError(FusionServeError):
    """A prediction input (text, pair, task name) is unusable."""


class MissingDependency(FusionServeError):
    """An optional package a feature needs is not installed; the message names the extra that brings it."""
