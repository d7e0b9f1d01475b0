"""The SQL the timeline's readers share, written once (STYLE rule 15): a column rename is one edit here.

Public: `requests` (the merged read of `requests`, one row per request: `merged`, `merged_matching`, and the
request's moments and prompt band), `steps` (the steps of an engine, or of several, in a time window, and the decode
tokens they generated rather than scheduled), `baselines` (an engine's own figures from its steps: decode-only step
time and ITL, its steps alone), `window` (the engine and time conditions they are built from) and `query` (`Query`,
which runs a text with bound {name:Type} parameters and prints that same text with its values; `param` and `moment`,
the one way a fragment writes a parameter; `which_span`; `Reads`, what a reader needs from a store) and `rows` (`Row`,
a query's row read by column name, `named`, `only`, `first_or_none`, `scalar`). The other modules are fragments,
nothing that runs a query.
"""
