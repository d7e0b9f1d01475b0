"""A real vLLM engine (vLLM's CPU build) in the loop: its environment, a tiny model built here, and a harness."""
