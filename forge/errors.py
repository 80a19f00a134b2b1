class UnsupportedModelError(ValueError):
    """The model's architecture is not in forge's table."""


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here (package missing, no suitable device)."""


class LabelDtypeError(TypeError, RuntimeError):
    """Labels of a dtype the loss does not take (anything but int64). A TypeError, as forge's
    other wrong-dtype errors, and a RuntimeError, the type eager ``F.cross_entropy`` raises for
    int32 labels, so code written against either catches it."""
