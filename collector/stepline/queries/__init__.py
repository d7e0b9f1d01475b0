"""The SQL the timeline's readers share, written once (STYLE rule 15): a column rename is one edit here.

Public: `requests` (the merged read of `requests`, one row per request: `merged`, `merged_matching`, and the
request's moments and prompt band), `steps` (the steps of an engine, or of several, in a time window, and the decode
tokens they generated rather than scheduled), `baselines` (an engine's own figures from its steps: decode-only step
time and ITL, its steps alone) and `window` (the engine and time conditions they are built from). Fragments with
bound {name:Type} parameters, nothing that runs a query.
"""
