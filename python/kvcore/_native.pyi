"""Type stubs of the native extension ``kvcore._native``."""

__version__: str

class KvcoreError(Exception):
    """Base class of every exception kvcore raises."""
