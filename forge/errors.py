class UnsupportedModelError(ValueError):
    """The model's architecture is not in forge's table."""


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here (package missing, no suitable device)."""
