"""Gateways in front of the engines: the decision record a router sends, and the row it becomes."""
