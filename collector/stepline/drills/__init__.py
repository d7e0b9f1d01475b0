"""Incidents with a known cause, run through the real collector into a real store: the scenario library
(`scenarios.make_scenario`, `scenarios.run_scenario`, `scenarios.run_engines`), generated cases with a judge
(`generator.generate`, `generator.judge`), a scenario served live on the wall clock (`live`), and time to truth
from the cause's onset to the first finding and page (`timetotruth.run_live`). What the diagnosis evaluation,
the whatif validation and the end-to-end alert tests stand on."""
