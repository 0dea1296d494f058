"""One way to check an error by its whole message (the message is the spec: the argument, what it
got, what was expected)."""

import re

import pytest


def raises_exactly(error: type[BaseException], message: str):
    """pytest.raises(error) whose message must equal ``message``, character for character."""
    return pytest.raises(error, match="^" + re.escape(message) + "$")
