"""The steps of an engine, or of several, in a time window: the condition a read of `steps` starts from.

`steps` is sorted by (host, engine, engine_index, ts, step): a condition on the engine and the time prunes a day's
table to the granules of the window.
"""

from __future__ import annotations

from stepline.queries.window import EACH_ENGINE, ENGINES, IN_WINDOW, between, one_engine


def of_engine(engine: str = "engine", start: str = "start", end: str = "end") -> str:
    """The steps of the engine bound as `engine` in [start, end], each a parameter of that name."""
    return f"{one_engine(engine)} AND {between(start, end)}"


OF_ENGINE = of_engine()
OF_ENGINES = f"{ENGINES} AND {IN_WINDOW}"
OF_EACH_ENGINE = f"{EACH_ENGINE} AND {IN_WINDOW}"
