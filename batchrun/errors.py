"""Error types. User-facing errors carry a message naming the file/field and the fix."""


class ConfigError(ValueError):
    """Bad configuration (job file, model directory, adapter): fails before any GPU work."""


class ModelLoadError(ConfigError):
    """The model directory cannot be used (pickle checkpoint, missing/extra tensor, bad shape)."""


class AdapterError(ConfigError):
    """A LoRA adapter cannot be used with this base model / engine settings."""


class JobChanged(ConfigError):
    """The output directory holds results of a different job (fingerprint mismatch). Exit 5."""


class InputChanged(JobChanged):
    """An input file changed (or vanished) while the run was reading it. Exit 5."""


class OutputIOError(Exception):
    """The output directory cannot be written or read (disk full, read-only, permissions). Exit 7.

    The message names the path and the fix; committed units are kept and temp files removed.
    """


def io_message(e: OSError, what: str) -> str:
    """One line for an OSError on the output side: the path, the system's words, the fix."""
    import errno
    where = e.filename or "the output directory"
    fix = {errno.ENOSPC: "free some space (or choose an output.path with room)",
           errno.EDQUOT: "free some space in your quota (or choose an output.path with room)",
           errno.EROFS: "the file system is read-only; choose a writable output.path",
           errno.EACCES: "fix the permissions, or choose another output.path",
           errno.EPERM: "fix the permissions, or choose another output.path"}.get(e.errno, "fix the cause")
    return f"{what}: {where}: {e.strerror or e}. {fix}, then rerun the same command: committed units are kept"
