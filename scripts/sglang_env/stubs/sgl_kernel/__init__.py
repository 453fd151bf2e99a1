"""An import-only stand-in for ``sgl_kernel`` (its CPU build is not on the package index).

SGLang imports ``sgl_kernel`` at module level on its CPU path but calls none of its functions
when serving the tiny test model. Every attribute here is a function that raises at once and
says which name was called (on stderr too, so the server's log shows it): if SGLang ever calls
one, the request fails loudly instead of passing silently, and the tests look for the line.
"""

import sys

MARK = "sgl_kernel stand-in called:"


class StandInCalled(RuntimeError):
    """A function of the stand-in was called."""


def _stand_in(name):
    def call(*args, **kwargs):
        message = f"{MARK} {name}"
        print(message, file=sys.stderr, flush=True)
        raise StandInCalled(message)

    call.__name__ = name.rsplit(".", 1)[-1]
    call.__qualname__ = name
    return call


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _stand_in(f"sgl_kernel.{name}")
