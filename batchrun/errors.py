"""Error types. User-facing errors carry a message naming the file/field and the fix."""


class ConfigError(ValueError):
    """Bad configuration (job file, model directory, adapter): fails before any GPU work."""


class ModelLoadError(ConfigError):
    """The model directory cannot be used (pickle checkpoint, missing/extra tensor, bad shape)."""


class AdapterError(ConfigError):
    """A LoRA adapter cannot be used with this base model / engine settings."""
