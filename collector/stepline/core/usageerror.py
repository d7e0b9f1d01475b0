"""The error a command line or its window is refused with: the message names the argument."""


class UsageError(ValueError):
    """An argument stepline cannot act on (a duration, a time, a window that contradicts itself); the message
    names it. `stepline` prints it on one line and exits 2."""
