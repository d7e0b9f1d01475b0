"""Reads of the timeline shared by the CLI, diagnosis and the demo: per-minute summaries (`summary`), steps and GPU
counters around a moment (`timeline`), per-request figures vLLM does not give (`perrequest`), the window a
command line names (`window`)."""
