"""Exceptions of the pypto backend, importable without torch or pypto (errors cross process boundaries)."""


class PyptoUnavailableError(RuntimeError):
    """pypto (or a tool it needs) is missing, or the installed version is not the supported one."""


class KernelOutputError(RuntimeError):
    """A kernel left part of an output unwritten (the sentinel survived)."""
